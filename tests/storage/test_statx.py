from __future__ import annotations

import os

import pytest

from tba.storage import statx
from tba.storage.statx import dio_alignment, fs_type, io_alignment


def test_dio_alignment_of_a_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x")
    mem, off = dio_alignment(p)
    assert mem >= 0 and off >= 0
    for v in (mem, off):
        assert v == 0 or v & (v - 1) == 0  # a power of two when reported
    fd = os.open(p, os.O_RDONLY)
    try:
        assert dio_alignment(fd) == (mem, off)
    finally:
        os.close(fd)
    align = io_alignment((mem, off))
    assert align >= 4096 and align & (align - 1) == 0


def test_unknown_is_zero(tmp_path, monkeypatch):
    assert dio_alignment(tmp_path / "missing") == (0, 0)
    assert dio_alignment(tmp_path) == (0, 0)  # directories never report DIOALIGN

    class NoStatx:
        pass

    monkeypatch.setattr(statx, "_libc", NoStatx())
    f = tmp_path / "f"
    f.write_bytes(b"x")
    assert dio_alignment(f) == (0, 0)
    assert fs_type(f) == "unknown"


@pytest.mark.parametrize(
    "dio, expected",
    [((0, 0), 4096), ((512, 512), 4096), ((4096, 512), 4096), ((8192, 512), 8192)],
)
def test_io_alignment_is_at_least_a_page(dio, expected):
    assert io_alignment(dio) == expected


def test_fs_type_names_common_filesystems(tmp_path):
    assert fs_type(tmp_path) != "unknown"
    if os.path.isdir("/dev/shm"):
        assert fs_type("/dev/shm") == "tmpfs"
    assert fs_type(tmp_path / "missing") == "unknown"
