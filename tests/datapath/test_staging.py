"""The bounded staging pool and the extent allocator under it."""

from __future__ import annotations

import pytest

from tba.datapath.capture.staging import StagingPool
from tba.errors import TBAError
from tba.host.memory import aligned_empty
from tba.storage.alloc import ExtentAllocator


def test_pool_is_bounded_and_aligned():
    pool = StagingPool(aligned_empty(1 << 20), 4096)
    a = pool.alloc(5000)
    assert a.length == 8192 and a.tensor.data_ptr() % 4096 == 0
    b = pool.alloc((1 << 20) - 8192)
    assert b is not None and pool.in_use == 1 << 20
    assert pool.alloc(1) is None and pool.refusals == 1
    pool.free(a)
    c = pool.alloc(4096)
    assert c is not None and c.offset == 0 and pool.peak == 1 << 20
    assert len(c.view) == 4096


def test_allocator_coalesces_and_reuses():
    al = ExtentAllocator(10 * 4096, 4096)
    xs = [al.alloc(4096) for _ in range(10)]
    assert al.alloc(1) is None
    for x in xs[2:5]:
        al.free(x)
    assert al.largest_free == 3 * 4096
    assert al.alloc(3 * 4096) == xs[2]
    for x in xs[:2] + xs[2:3] + xs[5:]:
        al.free(x)
    assert al.used == 0 and al.largest_free == 10 * 4096 and al.live_extents == 0
    with pytest.raises(TBAError, match="double free or unknown extent at offset 0"):
        al.free(0)
