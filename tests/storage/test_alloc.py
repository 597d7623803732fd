from __future__ import annotations

import pytest

from tba.errors import TBAError
from tba.storage import ExtentAllocator


def test_rounds_up_and_aligns():
    a = ExtentAllocator(1 << 20, 4096)
    offs = [a.alloc(n) for n in (1, 4096, 4097, 0)]
    assert offs == [0, 4096, 8192, 16384]
    assert [a.size_of(o) for o in offs] == [4096, 4096, 8192, 4096]
    assert all(o % 4096 == 0 for o in offs)
    assert a.used == 20480


def test_full_returns_none():
    a = ExtentAllocator(16384, 4096)
    assert a.alloc(16384) == 0
    assert a.alloc(1) is None
    assert a.free_bytes == 0


def test_free_coalesces_back_to_one_range():
    a = ExtentAllocator(5 * 4096, 4096)
    offs = [a.alloc(4096) for _ in range(5)]
    for o in (offs[1], offs[3], offs[2], offs[0], offs[4]):
        a.free(o)
    assert a.used == 0
    assert a.largest_free == 5 * 4096
    assert a.alloc(5 * 4096) == 0


def test_freed_extent_is_reused_best_fit():
    a = ExtentAllocator(1 << 20, 4096)
    small = a.alloc(4096)
    a.alloc(4096)  # separator
    big = a.alloc(3 * 4096)
    a.alloc(4096)  # separator
    a.free(big)
    a.free(small)
    # Best fit: a one-page request goes to the one-page hole, not the three-page hole.
    assert a.alloc(4096) == small
    assert a.alloc(3 * 4096) == big
    assert a.live_extents == 4


def test_double_free_raises():
    a = ExtentAllocator(1 << 20, 4096)
    o = a.alloc(100)
    a.free(o)
    with pytest.raises(TBAError, match=r"tba\.storage: double free or unknown extent at offset 0"):
        a.free(o)


def test_alignment_must_be_power_of_two():
    with pytest.raises(ValueError, match="alignment must be a power of two, got 3000"):
        ExtentAllocator(1 << 20, 3000)
