"""The host tier in the data path (NOTE [Host tier] in tba/storage/hosttier.py, NOTE [Tier order]
in tba/decide/tiers.py), over the fake CUDA of tests/_fake_cuda.py: the CPU is the "device" behind
the CUDA adapter, whose copies run only when something waits for them. Gradients are compared bit
for bit; no verdict depends on timing."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import tba.datapath.offloader as offloader_mod
import tba.storage.hosttier as hosttier_mod
from tba.errors import ConfigError

from .._fake_cuda import FakeCuda
from ..storage.test_hosttier import write_proc
from .test_device import offloader_with_fake_cuda

MIB = 1 << 20
NUMEL = 1 << 18  # 1 MiB of float32
BLOCKS = 4


class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.scale = nn.Parameter(torch.full((NUMEL,), 1.0 + i / 64))

    def forward(self, x):
        return torch.exp(x) * self.scale  # saves exp(x): 1 MiB per block


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(BLOCKS))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))  # tanh saves its output too: 2 MiB per block in all
        return x.sum()


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def train(off, model, x, steps):
    """``steps`` steps; per step the gradients and (with ``off``) its stats and group records."""
    out = []
    for _ in range(steps):
        model.zero_grad()
        if off is None:
            model(x).backward()
            out.append((grads(model), None, None))
            continue
        with off.step(model):
            loss = model(x)
            off.synchronize()  # written before backward: every read-back comes from a tier
        loss.backward()
        off.synchronize()
        out.append((grads(model), off.stats(), off._last.group_records()))
    return out


@pytest.fixture
def gpu_host(monkeypatch, tmp_path):
    """A CUDA host as far as the host tier can tell: CUDA present, 64 GiB to spare."""
    monkeypatch.setattr(offloader_mod, "cuda_present", lambda: True)
    room = write_proc(tmp_path, 64 << 20)
    monkeypatch.setattr(hosttier_mod, "memory_room", room)
    return room


@pytest.fixture
def data():
    torch.manual_seed(0)
    return Stack(), torch.randn(NUMEL) / 4


def test_everything_fits_round_trips_bit_exact_from_host_memory(make_offloader, gpu_host, data):
    model, x = data
    want = train(None, model, x, 2)
    off = offloader_with_fake_cuda(make_offloader, FakeCuda(), host_bytes="64MiB")
    adapter = off.io.device(torch.device("cpu"))[0]
    made = []
    real = adapter.host_buffer
    adapter.host_buffer = lambda n, a: made.append(n) or real(n, a)
    got = train(off, model, x, 2)
    for (g, st, _), (w, _, _) in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
        assert st["host_tier"] == "on" and st["bytes_reloaded"] > 0
        assert st["host_tier_bytes"] > 0 and st["ssd_tier_bytes"] == 0
        assert st["host_tier_spill_groups"] == 0
    assert made == []  # read-backs are the host tier's buffers: no copy before the upload
    assert off.stats()["host_tier_bytes_in_use"] == 0  # backward freed every extent
    assert off.backend.usage()["writes"] == 0  # nothing reached the spill disk


def test_a_short_budget_sends_the_earliest_blocks_to_disk(make_offloader, gpu_host, data):
    model, x = data
    want = train(None, model, x, 3)
    limit = 5 * MIB  # 2 MiB per block: a bit more than two blocks
    off = offloader_with_fake_cuda(make_offloader, FakeCuda(), host_bytes=limit)
    got = train(off, model, x, 3)
    for (g, _, _), (w, _, _) in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    for step, (_, st, recs) in enumerate(got, 1):
        assert 0 < st["host_tier_peak_bytes"] <= limit and st["ssd_tier_bytes"] > 0
        tiers = [("h" if r["host_bytes"] else "") + ("s" if r["ssd_bytes"] else "") for r in recs]
        tiers = [t for t in tiers if t]  # groups that offloaded something
        if step == 1:  # nothing measured yet: host first, the disk for what does not fit
            assert tiers[0] == "h" and tiers[-1] == "s", tiers
        else:  # the leading blocks go to the disk, the last ones (needed first) stay in RAM
            assert st["host_tier_spill_groups"] > 0
            assert tiers[0] == "s" and tiers[-1] == "h", tiers
            first_host = tiers.index("h")
            assert all(t == "s" for t in tiers[:first_host]), tiers
            assert all(t == "h" for t in tiers[first_host:]), tiers
            spilled = [r["group"] for r in recs if r["ssd_bytes"]]
            assert max(spilled) < st["host_tier_spill_groups"]


def test_two_offloaders_share_the_node_budget(make_offloader, gpu_host, data, spill_dir):
    model, x = data
    want = train(None, model, x, 1)
    limit = 12 * MIB  # rank 0 alone takes the 8 MiB it saves; rank 1 gets what is left
    offs = [
        offloader_with_fake_cuda(make_offloader, FakeCuda(), host_bytes=limit, rank=r)
        for r in (0, 1)
    ]
    for off in offs:
        off.io.tier.host.chunk = MIB
    # rank 0 steps and holds its bytes (its graph lives); rank 1 then finds the node short
    model.zero_grad()
    with offs[0].step(model):
        loss0 = model(x)
        offs[0].synchronize()
    held = offs[0].io.tier.host.used
    assert 0 < held <= limit
    got = train(offs[1], model, x, 1)
    assert 0 < got[0][1]["host_tier_peak_bytes"] <= limit - held
    assert got[0][1]["ssd_tier_bytes"] > 0  # what the node could not hold went to disk
    assert all(torch.equal(a, b) for a, b in zip(got[0][0], want[0][0]))
    model.zero_grad()
    loss0.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), want[0][0]))


def test_offloader_refuses_a_budget_the_node_cannot_spare(make_offloader, monkeypatch, tmp_path):
    monkeypatch.setattr(offloader_mod, "cuda_present", lambda: True)
    monkeypatch.setattr(
        hosttier_mod, "memory_room", write_proc(tmp_path, 4 << 20, cgroup=(3 << 30, 1 << 30))
    )
    with pytest.raises(ConfigError, match=r"TBA_HOST_BYTES \(argument\) = 3.0 GiB .*2.0 GiB"):
        make_offloader(host_bytes="3GiB")
    assert not list((tmp_path / "spill").glob("*-rank*"))  # its spill directory is gone


def test_cpu_only_run_has_no_tier_and_says_so_once(make_offloader, data, caplog, monkeypatch):
    monkeypatch.setattr(hosttier_mod, "_said", set())  # once per process: this test's process
    model, x = data
    caplog.set_level(logging.DEBUG, "tba")
    off = make_offloader()  # TBA_HOST_BYTES left at its default: no warning
    st = train(off, model, x, 1)[0][1]
    assert st["host_tier"] == "off" and "no CUDA device" in st["host_tier_reason"]
    assert st["host_tier_bytes"] == 0 and st["ssd_tier_bytes"] >= st["bytes_offloaded"] > 0
    assert off.io.tier is None and off.backend.__class__.__name__ != "TieredBackend"
    assert not [r for r in caplog.records if "host tier" in r.getMessage() and r.levelno >= 30]
    for _ in range(2):
        make_offloader(host_bytes="8GiB")
    warned = [r for r in caplog.records if "host tier is off" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


def test_cpu_tensors_skip_the_tier_on_a_cuda_host(make_offloader, gpu_host, data):
    """A CUDA host training on the CPU: those tensors are in RAM already, they go to disk."""
    model, x = data
    off = make_offloader(host_bytes="64MiB")  # the CPU adapter, no fake CUDA
    st = train(off, model, x, 1)[0][1]
    assert st["host_tier"] == "on" and st["host_tier_bytes"] == 0 and st["ssd_tier_bytes"] > 0


def test_the_trace_and_metrics_name_each_tier(make_offloader, gpu_host, data, tmp_path):
    import json

    model, x = data
    trace = tmp_path / "trace.jsonl"
    off = offloader_with_fake_cuda(make_offloader, FakeCuda(), host_bytes=5 * MIB, trace=str(trace))
    train(off, model, x, 3)
    off.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [d for d in lines if "host_tier_bytes" in json.dumps(d)]
    assert len(steps) >= 2
    text = trace.read_text()
    assert '"ssd_tier_bytes"' in text and '"host_bytes"' in text and '"ssd_bytes"' in text
    from tba.metrics.defs import METRICS

    assert "tba_host_tier_bytes_total" in METRICS and "tba_ssd_tier_bytes_total" in METRICS


def test_auto_decides_when_every_byte_went_to_the_host_tier(make_offloader, gpu_host, data):
    """With the host tier holding every offloaded byte the disk measures nothing: the
    controllers take the tier's rates instead (NOTE [Copy timing] in tba/datapath/offloader.py),
    so auto decides. It once never did on an H200, offloading everything, step after step."""
    model, x = data
    want = train(None, model, x, 4)
    off = offloader_with_fake_cuda(make_offloader, FakeCuda(), host_bytes="64MiB", policy="auto")
    got = train(off, model, x, 4)
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g[0], w[0]))
    first, last = got[0][1], got[-1][1]
    assert first["ssd_tier_bytes"] == 0 and first["host_tier_bytes"] > 0  # all offloaded
    assert off.backend.usage()["writes"] == 0  # the disk saw nothing, in any step
    assert last["policy_decision"].get("actions"), last["policy_decision"]


@pytest.mark.parametrize("checksum", ["auto", "xxh3"])
def test_device_bytes_are_copied_straight_into_the_tier(make_offloader, gpu_host, data, checksum):
    """NOTE [Host capture]: the device copy lands in the tier's own buffer, with no staging and
    no copy on the tier's thread after it; with the tier's checksums on (a named algorithm)
    the bytes go through staging and the tier's thread, which hashes them. Bit-exact either
    way, over copies that run only when something waits for them."""
    model, x = data
    want = train(None, model, x, 2)
    off = offloader_with_fake_cuda(
        make_offloader, FakeCuda(), host_bytes="64MiB", checksum=checksum
    )
    got = train(off, model, x, 2)
    for (g, st, _), (w, _, _) in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
        assert st["host_tier_bytes"] > 0 and st["ssd_tier_bytes"] == 0
    staging = off.io.device(torch.device("cpu"))[1]
    usage = off.backend.usage()
    if checksum == "auto":
        assert usage["host_tier_writes"] == 0, usage  # no copy after the device's
        # single: no staging at all; coalesce: only batches of tensors under 1 MiB (none here)
        assert staging.peak == 0, staging.peak
    else:
        assert usage["host_tier_writes"] > 0 and staging.peak > 0


def test_a_source_modified_before_its_copy_into_the_tier_raises_like_stock(
    make_offloader, gpu_host
):
    """NOTE [Host capture]: the copy into the tier runs late (the fake's copies run when waited
    for), so an in-place change before it is caught by the version check, as stock autograd
    catches it: never the changed bytes as a gradient."""
    off = offloader_with_fake_cuda(make_offloader, FakeCuda(), host_bytes="64MiB")
    a = torch.randn(NUMEL, requires_grad=True)
    with off.step():
        h = a * 2
        y = torch.sin(h)  # saves h: 1 MiB, offloaded into the tier
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    del y, h  # the graph that failed still held its saved tensor, as stock's does
    assert off.stats()["host_tier_bytes_in_use"] == 0


def test_a_tensor_wanted_while_it_is_copied_into_the_tier_is_read_from_its_buffer(
    make_offloader, gpu_host, data
):
    """Backward at once after the forward, the copies still queued: what the read-ahead wants
    before its copy completed is read from the tier's buffer itself, never copied into a read
    buffer of its own (NOTE [Host capture])."""
    model, x = data
    want = train(None, model, x, 1)[0][0]
    off = offloader_with_fake_cuda(make_offloader, FakeCuda(), host_bytes="64MiB")
    adapter = off.io.device(torch.device("cpu"))[0]
    made = []
    real = adapter.host_buffer
    adapter.host_buffer = lambda n, a: made.append(n) or real(n, a)
    for _ in range(2):
        model.zero_grad()
        with off.step(model):
            loss = model(x)
        loss.backward()  # no synchronize: the last blocks are wanted while being copied
        off.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(grads(model), want))
    assert off.stats()["host_tier_bytes"] > 0
    assert made == []
