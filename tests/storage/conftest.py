"""Fixtures for the storage tests: a config on tmp_path, and every backend in turn."""

from __future__ import annotations

import pytest
from storage_util import BACKENDS, FILE_BACKENDS

from tba.config import Config
from tba.storage import open_backend


@pytest.fixture
def make_cfg(tmp_path):
    """A Config isolated from the environment, spilling under tmp_path, with 1 MiB slabs."""

    def make(**changes) -> Config:
        fields = {
            "spill_dir": str(tmp_path / "spill"),
            "slab_bytes": "1MiB",
            "min_free_bytes": 0,
            "io_threads": 4,
            "environ": {},
        }
        fields.update(changes)
        return Config(**fields)

    return make


@pytest.fixture(params=BACKENDS)
def backend(request, make_cfg):
    """Each backend in turn; every I/O test runs over all of them."""
    b = open_backend(make_cfg(backend=request.param))
    yield b
    b.close()


@pytest.fixture(params=FILE_BACKENDS)
def file_backend(request, make_cfg):
    """The slab-backed backends, whose syscalls a test can replace to inject faults."""
    b = open_backend(make_cfg(backend=request.param))
    yield b
    b.close()
