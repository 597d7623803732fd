"""Adaptive keep (NOTE [Adaptive keep]) and the JSON-lines trace (TBA_TRACE)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import tba
from tba.adaptive import DEPTH_SAFETY, DepthController, Group, KeepController, simulate
from tba.testing import GPT, GPTConfig, random_batch

MIB = 1 << 20

MB = 10**6


def blocks(n, fwd=0.1, bwd=0.2, nbytes=100 * MB):
    return [Group(fwd, bwd, nbytes) for _ in range(n)]


def test_infinite_bandwidth_never_stalls():
    g = blocks(6)
    p = simulate(g, kept_from=6, write_bps=1e15, read_bps=1e15, prefetch=1 << 30, k=0)
    assert p.stall_seconds == pytest.approx(0, abs=1e-6)
    assert p.step_seconds == pytest.approx(sum(x.fwd + x.bwd for x in g))
    assert p.kept_bytes == 0


def test_keeping_everything_needs_no_disk():
    g = blocks(6)
    p = simulate(g, kept_from=0, write_bps=1.0, read_bps=1.0, prefetch=1 << 20, k=6)
    assert p.stall_seconds == 0 and p.kept_bytes == 6 * 100 * MB


def test_slow_reads_stall_by_the_missing_time():
    # Groups of 10 MB (one piece each) read at 10 MB/s: 1 s per group; backward computes 0.02 s.
    g = blocks(3, fwd=0.1, bwd=0.02, nbytes=10 * MB)
    p = simulate(g, kept_from=3, write_bps=1e15, read_bps=10 * MB, prefetch=1 << 40, k=0)
    # The reader runs back to back from the end of forward (0.3 s): the last read lands at 3.3 s.
    assert p.step_seconds == pytest.approx(0.3 + 3.0 + 0.02, rel=1e-6)
    assert p.stall_seconds == pytest.approx(1.0 + 0.98 + 0.98, rel=1e-6)


def test_writes_still_running_are_served_from_staging():
    g = blocks(3)
    p = simulate(g, kept_from=3, write_bps=1 * MB, read_bps=1e15, prefetch=1 << 40, k=0)
    assert p.staged_groups > 0 and p.stall_seconds == 0


def test_prefetch_budget_delays_reads():
    # Reads are twice as fast as backward needs, so a roomy budget reads everything ahead; a
    # budget of one piece serialises each read behind the consumption of the previous one.
    g = blocks(6, fwd=0.1, bwd=0.2, nbytes=10 * MB)
    roomy = simulate(g, 6, 1e15, 100 * MB, prefetch=1 << 40, k=0)
    tight = simulate(g, 6, 1e15, 100 * MB, prefetch=10 * MB, k=0)
    assert roomy.stall_seconds == pytest.approx(0.1, rel=1e-6)  # only the first read is exposed
    assert tight.stall_seconds == pytest.approx(6 * 0.1, rel=1e-6)


def test_more_bandwidth_is_never_slower_and_more_keep_never_stalls_more():
    g = [Group(0.1 * (i % 3 + 1), 0.25, (i + 1) * 30 * MB) for i in range(8)]
    for k in range(9):
        first = 8 - k
        slow = simulate(g, first, 150 * MB, 150 * MB, 64 << 20, k)
        fast = simulate(g, first, 600 * MB, 600 * MB, 64 << 20, k)
        assert fast.step_seconds <= slow.step_seconds + 1e-9
    stalls = [simulate(g, 8 - k, 150 * MB, 150 * MB, 64 << 20, k).stall_seconds for k in range(9)]
    assert all(b <= a + 1e-9 for a, b in zip(stalls, stalls[1:]))


def records(n, fwd, bwd, nbytes, stall=0.0):
    return [
        {
            "fwd_seconds": fwd,
            "bwd_seconds": bwd,
            "offloaded_bytes": nbytes,
            "keepable_bytes": 0,
            "stall_seconds": stall,
        }
        for _ in range(n)
    ]


def test_controller_keeps_more_when_the_disk_is_slow(caplog):
    ctl = KeepController("auto", prefetch_bytes=128 << 20)
    assert ctl.k == 1 and ctl.decision["mode"] == "auto"
    recs = records(6, 0.1, 0.2, 100 * MB)
    with caplog.at_level(logging.INFO, logger="tba"):
        ctl.observe(1, recs, 1e12, 1e12, lambda k: 6 - k, 6)
    assert ctl.k == 0  # a fast disk: nothing needs to stay
    ctl.observe(2, recs, 100 * MB, 100 * MB, lambda k: 6 - k, 6)  # bandwidth drifted
    assert ctl.k >= 3
    assert ctl.decision["predicted_stall_seconds"] <= 0.01 * 1.8
    assert any("keep_last=auto chose K=" in r.getMessage() for r in caplog.records)


def test_controller_waits_between_decisions_unless_something_changes():
    ctl = KeepController("auto", prefetch_bytes=128 << 20, every=5)
    recs = records(6, 0.1, 0.2, 100 * MB)
    ctl.observe(1, recs, 1e12, 1e12, lambda k: 6 - k, 6)
    decided = dict(ctl.decision)
    ctl.observe(2, recs, 1.1e12, 1.1e12, lambda k: 6 - k, 6)  # within 25%: no new decision
    assert ctl.decision == decided
    ctl.observe(3, records(6, 0.1, 0.2, 100 * MB, stall=0.1), 1e12, 1e12, lambda k: 6 - k, 6)
    assert ctl.decision["step"] == 3  # a stalled step re-decides


def test_a_fixed_number_is_never_changed():
    ctl = KeepController(3, prefetch_bytes=1 << 20)
    ctl.observe(1, records(6, 0.1, 0.2, 100 * MB), 1.0, 1.0, lambda k: 6 - k, 6)
    assert ctl.k == 3 and ctl.decision["mode"] == "fixed"


CFG = GPTConfig(vocab=64, seq=64, hidden=64, heads=4, layers=4)


def train(off, steps=3):
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = random_batch(CFG, 4)
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with off.step(model):
            loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
    return losses


def test_auto_keep_in_the_offloader_decides_after_step_one(make_offloader):
    off = make_offloader(keep_last="auto")
    train(off, steps=3)
    st = off.stats()
    assert st["keep_decision"]["mode"] == "auto"
    # Decided once step 1's backward had run (and again after step 2 if its bandwidth moved).
    assert st["keep_decision"]["step"] in (1, 2)
    assert st["keep_last"] == st["keep_decision"]["k"]
    assert set(st["keep_decision"]["candidates"]) == set(range(CFG.layers + 1))


def test_trace_records_every_group_and_step(make_offloader, tmp_path):
    path = tmp_path / "trace.jsonl"
    off = make_offloader(trace=str(path), keep_last=1)
    losses = train(off, steps=3)
    off.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "meta" and lines[0]["version"] == 1
    assert lines[0]["config"]["keep_last"] == 1
    steps = [x for x in lines if x["type"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]  # the last one written at close()
    groups = [x for x in lines if x["type"] == "group" and x["step"] == 2]
    assert [g["group"] for g in groups] == list(range(2 * CFG.layers + 1))
    blocks_ = groups[1::2]
    assert all(g["fwd_seconds"] > 0 and g["bwd_seconds"] > 0 for g in blocks_)
    assert blocks_[-1]["kept"] and not blocks_[0]["kept"]
    assert sum(g["offloaded_bytes"] for g in groups) == steps[1]["bytes_offloaded"]
    assert steps[1]["write_bps"] > 0 and steps[1]["read_bps"] > 0
    assert steps[1]["step_seconds"] >= steps[1]["forward_seconds"] > 0
    assert len(losses) == 3


def test_unwritable_trace_is_a_config_error(make_offloader, tmp_path):
    with pytest.raises(tba.ConfigError, match="TBA_TRACE=.* cannot be opened"):
        make_offloader(trace=str(tmp_path / "no" / "such" / "dir" / "t.jsonl"))


def _rec(fwd, bwd, offloaded, stall=0.0):
    return {
        "fwd_seconds": fwd,
        "bwd_seconds": bwd,
        "offloaded_bytes": offloaded,
        "stall_seconds": stall,
    }


def test_depth_is_the_largest_read_plus_what_backward_eats_while_it_is_read():
    d = DepthController(cap=128 * MIB)
    # backward consumes 100 MiB/s, the disk reads 1000 MiB/s, the largest read is 8 MiB
    d.observe(2, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == int(8 * MIB * (1 + DEPTH_SAFETY * 0.1))
    assert d.decision["cap"] == 128 * MIB and d.decision["step"] == 2


def test_depth_is_the_cap_when_the_disk_is_slower_than_backward():
    d = DepthController(cap=64 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 300 * MIB)], read_bps=200 * MIB, largest_read=8 * MIB)
    assert d.depth == 64 * MIB and "slower" in d.decision["reason"]


def test_depth_never_exceeds_the_cap_and_covers_one_read():
    d = DepthController(cap=4 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 10 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == 4 * MIB  # the cap wins, as the user asked (reads then go one at a time)
    d = DepthController(cap=64 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 1 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert 8 * MIB <= d.depth < 9 * MIB


def test_a_stall_raises_a_floor_that_stays():
    d = DepthController(cap=128 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    small = d.depth
    d.observe(3, [_rec(0.5, 1.0, 100 * MIB, stall=0.2)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == 2 * small and "stalled" in d.decision["reason"]
    d.observe(4, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == 2 * small  # the floor holds without new stalls


def test_nothing_measured_changes_nothing():
    d = DepthController(cap=32 * MIB)
    d.observe(2, [], read_bps=None, largest_read=0)
    d.observe(3, [_rec(0.5, 1.0, MIB)], read_bps=None, largest_read=MIB)
    assert d.depth == 32 * MIB and d.decision["reason"].startswith("first step")


def test_offloader_sizes_its_window_from_measurements(make_offloader):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    x = torch.randn(2048, 256)  # 2 MiB per saved activation, 16 MiB per step
    off = make_offloader(prefetch_bytes="64MiB", group_bytes="2MiB", coalesce_bytes=0)
    want = None
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with off.step():
            loss = model(x).square().mean()
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        want = want or got
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    dec = off.stats()["prefetch_decision"]
    assert dec["cap"] == 64 * MIB
    assert dec["largest_read"] >= 2 * MIB
    assert dec["largest_read"] <= dec["depth"] <= 64 * MIB
    assert off.prefetcher.budget == dec["depth"]
