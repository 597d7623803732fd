"""Fixtures of the sidecar tests: a metrics dir and a spill root per test."""

from __future__ import annotations

import pytest


@pytest.fixture
def metrics_dir(tmp_path) -> str:
    d = tmp_path / "metrics"
    d.mkdir()
    return str(d)


@pytest.fixture
def spill_root(tmp_path) -> str:
    d = tmp_path / "spill"
    d.mkdir(mode=0o700)
    return str(d)
