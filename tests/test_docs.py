"""The documents stay true: docs/configuration.md documents every setting and every stats()
key, the README starts with the two commands and links to the reference, every cited NOTE is
written out once, and every cited repository file exists."""

from __future__ import annotations

import os
import re

import tba
from tba.config import Config
from tba.records.reasons import KEPT_REASONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
CONFIGURATION = os.path.join(ROOT, "docs", "configuration.md")


def readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def configuration() -> str:
    with open(CONFIGURATION, encoding="utf-8") as f:
        return f.read()


def test_configuration_page_lists_every_variable_with_its_default():
    """Each TBA_* variable of Config.describe() has its own row in the reference table."""
    text = configuration()
    for _, env, _, _ in Config.describe():
        row = re.search(rf"^\| `{env}` \| ([^|]+) \| ([^|]+) \|", text, re.M)
        assert row, f"docs/configuration.md has no table row for {env}"
        assert row.group(1).strip() and row.group(2).strip(), f"{env}: no default or meaning"


def test_configuration_page_lists_every_stats_key(tmp_path):
    """Every pinned key, every key a real step's stats() returns, and every kept reason."""
    import torch

    text = configuration()
    for key in tba.PINNED_KEYS:
        assert f"| `{key}` |" in text, f"docs/configuration.md has no row for stats()['{key}']"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    with tba.Offloader(tba.Config(spill_dir=str(tmp_path), backend="memory")) as off:
        with off.step(model):
            loss = model(torch.randn(32, 64)).sum()
        loss.backward()
        keys = set(off.stats())
    for key in sorted(keys):
        assert f"`{key}`" in text, f"docs/configuration.md does not document stats()['{key}']"
    for reason in KEPT_REASONS:
        assert f"| `{reason}` |" in text, f"docs/configuration.md: no row for kept reason {reason}"


def test_readme_links_to_the_reference():
    text = readme()
    assert "(docs/configuration.md)" in text, "README.md does not link to docs/configuration.md"
    for name in ("TBA_SPILL_DIR", "TBA_BACKEND", "TBA_MEMORY_BUDGET", "TBA_POLICY"):
        assert f"`{name}`" in text, f"README.md's short settings table lacks {name}"


def test_readme_starts_with_the_two_commands():
    head = readme().split("\n## ")[0]
    assert "make demo" in head and "make test" in head


def test_torch_free_parts_import_without_torch():
    """`import tba` and the sidecar, metrics and config modules do not load torch; the
    Offloader does, on first use (PEP 562 in tba/__init__.py and tba/storage/__init__.py)."""
    import subprocess
    import sys

    code = (
        "import sys, tba, tba.sidecar.app, tba.metrics, tba.config, tba.storage.nodequota\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "tba.Offloader\n"
        "assert 'torch' in sys.modules\n"
        "from tba.storage import MemoryBackend, PosixBackend\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


SOURCES = ("tba", "tests", "benchmarks", "examples", "native", "deploy", "docs", ".ci")
TOP_DOCS = ("README.md", "BENCHMARKS.md", "Makefile", "pyproject.toml")
CITING = (".py", ".md", ".c", ".h", ".yml", ".yaml", ".json", ".service")


def _texts():
    """(path, text) of every source and document of the repository that cites things."""
    for name in TOP_DOCS:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            yield name, f.read()
    for top in SOURCES:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in files:
                if name.endswith(CITING) or name == "run":
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, ROOT), f.read()


def test_every_cited_note_is_defined_once():
    """A ``NOTE [...]`` cited anywhere is written out once: a line that starts with it (after a
    comment marker) and ends there or goes on with a parenthesis."""
    defined: dict[str, list[str]] = {}
    cited: dict[str, set[str]] = {}
    for path, text in _texts():
        head = r"^[ \t]*(?:#|//|\*|)[ \t]*NOTE \[([^\]\n]+)\](?:$| \()"
        for m in re.finditer(head, text, re.M):
            defined.setdefault(m.group(1), []).append(path)
        for m in re.finditer(r"NOTE \[([^\]\n]+)\]", text):
            cited.setdefault(m.group(1), set()).add(path)
    cited.pop("...", None)  # the convention itself, named in docs/CONTRIBUTING.md
    missing = {name: sorted(where) for name, where in cited.items() if name not in defined}
    assert not missing, f"NOTEs cited but never written out: {missing}"
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, f"NOTEs written out more than once: {twice}"


def test_cited_repository_files_exist():
    """Paths of this repository named in code and docs exist, and nothing cites the design
    notes that live outside it (their content is in docs/)."""
    pattern = re.compile(
        r"(?<![\w./-])((?:tba|tests|benchmarks|examples|native|deploy|docs)/[\w./-]*\w"
        r"|(?:README|BENCHMARKS)\.md)"
    )
    outside = re.compile(r"\b(ARCHITECTURE|ANCHORS|TECHNIQUES|PITFALLS|STYLE)\.md\b")
    bad, foreign = [], []
    for path, text in _texts():
        for m in pattern.finditer(text):
            ref = m.group(1).rstrip(".")
            token = re.match(r"[^\s`'\"]*", text[m.start() :]).group(0)
            if not re.search(r"\.\w+$", ref) or "*" in token:
                continue  # a directory, a name that is not a file, or a glob
            if not os.path.exists(os.path.join(ROOT, ref)):
                bad.append(f"{path}: {ref}")
        foreign += [f"{path}: {m.group(0)}" for m in outside.finditer(text)]
    assert not bad, "cited files that do not exist:\n" + "\n".join(sorted(set(bad)))
    assert not foreign, "cites design notes outside the repository:\n" + "\n".join(foreign)
