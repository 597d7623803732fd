"""The host tier's storage (NOTE [Host tier] in tba/storage/hosttier.py): its budget, the node's
share of it, what the node can spare (read from fake /proc and cgroup files), its bytes."""

from __future__ import annotations

import errno
import functools
import logging

import pytest
import torch

import tba.storage.hosttier as hosttier_mod
from tba.config import Config
from tba.errors import ConfigError, StorageError
from tba.host.memory import aligned_empty, as_memoryview
from tba.storage import open_backend
from tba.storage.hosttier import (
    HOST_LEDGER,
    HostExtent,
    HostTier,
    Room,
    TieredBackend,
    memory_room,
    with_host_tier,
)
from tba.storage.nodequota import read_ledger

MIB = 1 << 20
GIB = 1 << 30


def write_proc(tmp_path, avail_kib, cgroup=None, v1=False):
    """Fake /proc/meminfo, /proc/self/cgroup and cgroup files; returns memory_room over them.
    ``cgroup``: (limit, used) as the files would hold them ("max" allowed), or None."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {avail_kib} kB\n")
    root = tmp_path / "cgroup"
    self_cg = tmp_path / "self_cgroup"
    if cgroup is None:
        self_cg.write_text("")
    elif v1:
        d = root / "memory" / "job"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{cgroup[0]}\n")
        (d / "memory.usage_in_bytes").write_text(f"{cgroup[1]}\n")
        self_cg.write_text("12:cpu,cpuacct:/job\n4:memory:/job\n")
    else:
        d = root / "job.slice"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(f"{cgroup[0]}\n")
        (d / "memory.current").write_text(f"{cgroup[1]}\n")
        self_cg.write_text("0::/job.slice\n")
    return functools.partial(
        memory_room, meminfo=str(meminfo), cgroup_root=str(root), self_cgroup=str(self_cg)
    )


def cfg(spill_dir, **kw):
    kw.setdefault("backend", "posix")
    return Config(spill_dir=spill_dir, slab_bytes="4MiB", min_free_bytes=0, environ={}, **kw)


# -- what the node can spare -------------------------------------------------------------------
def test_room_reads_meminfo_and_cgroup_v2(tmp_path):
    room = write_proc(tmp_path, 8 * GIB // 1024, cgroup=(6 * GIB, 2 * GIB))()
    assert room == Room(8 * GIB, 6 * GIB, 2 * GIB)
    assert room.bytes == 4 * GIB  # the cgroup's room is the smaller


def test_room_reads_cgroup_v1_and_ignores_an_unlimited_one(tmp_path):
    v1 = write_proc(tmp_path / "a", 8 * GIB // 1024, cgroup=(3 * GIB, GIB), v1=True)()
    assert v1.bytes == 2 * GIB
    unlimited = write_proc(tmp_path / "b", 8 * GIB // 1024, cgroup=("max", GIB))()
    assert unlimited.cgroup_limit is None and unlimited.bytes == 8 * GIB


@pytest.fixture(autouse=True)
def _dirs(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()


def test_a_size_beyond_memavailable_is_refused_naming_the_figures(tmp_path, spill_dir):
    room = write_proc(tmp_path, 2 * GIB // 1024)
    backend = open_backend(cfg(spill_dir))
    try:
        with pytest.raises(
            ConfigError,
            match=r"TBA_HOST_BYTES \(argument\) = 4.0 GiB is more pinned host memory than this "
            r"node can spare now: 2.0 GiB \(MemAvailable 2.0 GiB\).*swap or the OOM killer.*"
            r"fraction",
        ):
            with_host_tier(cfg(spill_dir, host_bytes="4GiB"), backend, cuda=True, room=room)
    finally:
        backend.close()


def test_a_size_beyond_the_cgroup_limit_is_refused(tmp_path, spill_dir):
    room = write_proc(tmp_path, 64 * GIB // 1024, cgroup=(10 * GIB, 7 * GIB))
    backend = open_backend(cfg(spill_dir))
    try:
        with pytest.raises(
            ConfigError, match=r"3.0 GiB \(MemAvailable 64.0 GiB; cgroup limit 10.0 GiB with 7.0"
        ):
            with_host_tier(cfg(spill_dir, host_bytes="4GiB"), backend, cuda=True, room=room)
    finally:
        backend.close()


def test_a_fraction_is_of_what_the_node_can_spare(tmp_path, spill_dir):
    room = write_proc(tmp_path, 64 * GIB // 1024, cgroup=(10 * GIB, 2 * GIB))
    backend = open_backend(cfg(spill_dir))
    tiered, status = with_host_tier(cfg(spill_dir, host_bytes=0.25), backend, cuda=True, room=room)
    try:
        assert status.on and isinstance(tiered, TieredBackend)
        assert tiered.host.limit == 2 * GIB  # a quarter of the cgroup's 8 GiB of room
        assert tiered.name == backend.name and "host tier" in tiered.reason
    finally:
        tiered.close()


def test_no_tier_without_cuda_and_a_warning_only_when_set(tmp_path, spill_dir, caplog, monkeypatch):
    monkeypatch.setattr(hosttier_mod, "_said", set())  # once per process: this test's process
    backend = open_backend(cfg(spill_dir))
    try:
        caplog.set_level(logging.DEBUG, "tba.storage")
        same, status = with_host_tier(cfg(spill_dir), backend, cuda=False)
        assert same is backend and not status.on and "no CUDA device" in status.reason
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        with_host_tier(cfg(spill_dir, host_bytes="1GiB"), backend, cuda=False)
        with_host_tier(cfg(spill_dir, host_bytes="1GiB"), backend, cuda=False)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1
        assert "TBA_HOST_BYTES is set but the host tier is off" in warned[0].getMessage()
    finally:
        backend.close()


def test_no_tier_with_the_memory_backend_or_when_set_to_zero(tmp_path, spill_dir):
    mem = open_backend(cfg(spill_dir, backend="memory"))
    try:
        assert "TBA_BACKEND=memory" in with_host_tier(cfg(spill_dir), mem, cuda=True)[1].reason
        off = with_host_tier(cfg(spill_dir, host_bytes="off"), mem, cuda=True)[1]
        assert not off.on and off.reason == "TBA_HOST_BYTES=0"
    finally:
        mem.close()


@pytest.mark.parametrize("value", ["-1", "1.5", "lots", "150%"])
def test_bad_values_are_refused(spill_dir, value):
    with pytest.raises(ConfigError, match="TBA_HOST_BYTES=.*expected a fraction in"):
        Config(environ={"TBA_HOST_BYTES": value})


def test_values_parse():
    assert Config(environ={}).host_bytes == 0.5
    assert Config(environ={"TBA_HOST_BYTES": "64GiB"}).host_bytes == 64 * GIB
    assert Config(environ={"TBA_HOST_BYTES": "25%"}).host_bytes == 0.25
    assert Config(environ={"TBA_HOST_BYTES": "0"}).host_bytes == 0
    assert Config(host_bytes=1.0, environ={}).host_bytes == 1.0


# -- budget and bytes --------------------------------------------------------------------------
def plenty():
    return Room(64 * GIB, None, None)


def test_bytes_in_the_tier_never_exceed_its_budget():
    tier = HostTier(5 * MIB, chunk=2 * MIB, room=plenty)
    got = []
    while (ext := tier.allocate(MIB + 1)) is not None:  # rounded up to 1 MiB + a page
        got.append(ext)
        assert tier.used <= tier.reserved <= tier.limit
    assert len(got) == 4 and tier.refusals == 1
    tier.free(got.pop())
    assert tier.allocate(MIB) is not None  # room again once freed
    tier.close()


def test_pinned_extents_are_charged_what_torchs_pinned_allocator_takes():
    """torch rounds a pinned allocation up to a power of two: the budget counts that."""
    pinned = HostTier(GIB, pin=True, room=plenty)
    assert pinned.charge(MIB + 1) == 2 * MIB and pinned.charge(MIB) == MIB
    assert pinned.charge(3 * MIB) == 4 * MIB and pinned.charge(1) == 4096
    assert HostTier(GIB, room=plenty).charge(3 * MIB) == 3 * MIB  # unpinned: page-aligned


def test_a_reservation_never_leaves_the_node_less_than_the_guard(caplog):
    spare = [3 * GIB]
    tier = HostTier(8 * GIB, chunk=GIB, room=lambda: Room(spare[0], None, None), guard=GIB)
    assert tier.allocate(MIB) is not None  # 3 GiB spare: a 1 GiB chunk leaves 2 GiB
    spare[0] = GIB + MIB // 2  # the node filled up meanwhile
    big = tier.allocate(GIB)
    assert big is None and tier.refused_memory == 1 and tier.reserved == GIB
    assert "takes no more for now" in caplog.text and "Lower TBA_HOST_BYTES" in caplog.text
    tier.close()


def test_write_copies_and_read_back_is_the_buffer_itself():
    tier = HostTier(8 * MIB, room=plenty)
    src = torch.randint(0, 256, (2 * MIB,), dtype=torch.uint8)
    ext = tier.allocate(src.numel())
    assert isinstance(ext, HostExtent)
    digest = tier.write(ext, as_memoryview(src), "xxh3").result()
    src_copy = src.clone()
    src.zero_()  # the tier holds its own copy
    view = tier.view(ext)
    assert torch.equal(view, src_copy) and tier.view(ext).data_ptr() == view.data_ptr()
    out = torch.empty_like(src_copy)
    tier.read(ext, as_memoryview(out), "xxh3", digest).result()
    assert torch.equal(out, src_copy)
    view[7] ^= 1  # host memory overwritten while held: a typed error, never wrong bytes
    with pytest.raises(StorageError, match="host-tier extent") as err:
        tier.read(ext, as_memoryview(out), "xxh3", digest).result()
    assert err.value.errno == errno.EBADMSG
    tier.close()


@pytest.mark.parametrize("checksum, verified", [("auto", False), ("off", False), ("xxh3", True)])
def test_the_tier_is_checksummed_only_when_an_algorithm_is_named(
    tmp_path, spill_dir, checksum, verified
):
    """NOTE [Host tier] 6: the default checksum guards the disk; a named one the tier too."""
    room = write_proc(tmp_path, 64 * GIB // 1024)
    backend = open_backend(cfg(spill_dir))
    tiered, _ = with_host_tier(
        cfg(spill_dir, host_bytes="1GiB", checksum=checksum), backend, cuda=True, room=room
    )
    try:
        src = torch.randint(0, 256, (MIB,), dtype=torch.uint8)
        ext = tiered.allocate_host(src.numel())
        digest = tiered.write(ext, as_memoryview(src), "xxh3").result()
        assert (digest is not None) is verified
        tiered.host.view(ext)[3] ^= 1
        fut = tiered.read(ext, as_memoryview(torch.empty_like(src)), "xxh3", digest)
        if verified:
            with pytest.raises(StorageError, match="host-tier extent"):
                fut.result()
        else:
            assert fut.result() is None
    finally:
        tiered.close()


def test_tiered_backend_sends_each_extent_to_its_tier(spill_dir):
    backend = open_backend(cfg(spill_dir))
    tiered = TieredBackend(backend, HostTier(4 * MIB, align=backend.alignment, room=plenty))
    try:
        data = aligned_empty(MIB)
        data.copy_(torch.arange(MIB, dtype=torch.uint8))
        for ext in (tiered.allocate(MIB), tiered.allocate_host(MIB)):
            tiered.write(ext, as_memoryview(data)).result()
            out = aligned_empty(MIB)
            tiered.read(ext, as_memoryview(out)).result()
            assert torch.equal(out, data)
            tiered.free(ext)
        u = tiered.usage()
        assert u["host_tier_writes"] == 1 and u["writes"] >= 1 and u["host_tier_bytes_in_use"] == 0
    finally:
        tiered.close()


# -- the node's share (NOTE [Node quota] 6, the host tier's own ledger) ------------------------
def test_two_ranks_share_the_node_budget(tmp_path, spill_dir):
    room = write_proc(tmp_path, 64 * GIB // 1024)
    made = []
    for rank in (0, 1):
        b = open_backend(cfg(spill_dir, rank=rank))
        made.append(with_host_tier(cfg(spill_dir, rank=rank, host_bytes="8MiB"), b, True, room)[0])
    a, b = (t.host for t in made)
    for t in (a, b):
        t.chunk = MIB
    try:
        held = []
        while (ext := a.allocate(MIB)) is not None:  # alone, rank 0 may take the whole budget
            held.append(ext)
        assert len(held) == 8
        assert b.allocate(MIB) is None  # nothing left: rank 1 is refused, and wants space
        ledger = read_ledger(spill_dir)
        assert ledger is None  # the disk quota's ledger is not the host tier's
        for ext in held[:6]:  # rank 0's backward frees; it gives back what is over its share
            a.free(ext)
        assert a.reserved <= 4 * MIB
        got = [b.allocate(MIB) for _ in range(4)]
        assert all(g is not None for g in got)  # rank 1 gets its share
        assert a.used + b.used <= 8 * MIB
        assert (tmp_path / "spill" / HOST_LEDGER).exists()
    finally:
        for t in made:
            t.close()
