"""The data path: a saved tensor from the pack hook to its write, and back from its read to
unpack, with the Offloader that builds the parts from a Config. Blocks and capture are the
lowest parts of it; the import-linter contract in pyproject.toml orders the rest."""
