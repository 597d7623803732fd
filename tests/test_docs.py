"""The README documents every setting and every stats() key."""

from __future__ import annotations

import os

import tba
from tba.config import Config

README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")


def readme() -> str:
    with open(README) as f:
        return f.read()


def test_readme_lists_every_variable_and_stats_key():
    text = readme()
    for _, env, _, _ in Config.describe():
        assert f"`{env}`" in text, f"README.md does not document {env}"
    for key in tba.PINNED_KEYS:
        assert f"`{key}`" in text, f"README.md does not document stats()['{key}']"


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
