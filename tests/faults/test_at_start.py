"""The same faults already there when the Offloader starts: a read-only, shut-down or full
spill filesystem. tba cannot make its per-process directory, and ``tba.Offloader()`` raises
``tba.ConfigError`` naming the directory and the errno's text, before any step (nothing
half-started, nothing left on disk)."""

from __future__ import annotations

import pytest

import tba

from .util import config


def read_only(fs):
    fs.must_remount("ro")
    return lambda: fs.remount("rw")


def shutdown(fs):
    fs.shutdown()
    return fs.cycle


def full(fs):
    fs.fill(256 << 10)
    fs.fill(4096)  # the last blocks too
    return fs.remove_hog


@pytest.mark.parametrize(
    "fault,text",
    [
        (read_only, "Read-only file system"),
        (shutdown, "Input/output error"),
        (full, "No space left on device"),
    ],
    ids=["read_only", "shutdown", "full"],
)
def test_a_faulty_spill_fs_at_start_is_a_config_error(loop_ext4, fault, text):
    fs = loop_ext4
    baseline = fs.baseline()
    repair = fault(fs)
    with pytest.raises(tba.ConfigError, match=rf"TBA_SPILL_DIR: cannot create {fs.root}/.*{text}"):
        tba.Offloader(config(fs.root))  # the default backend, auto
    repair()
    fs.assert_no_bytes_left(baseline)
