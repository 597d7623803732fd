"""Adaptive keep (NOTE [Adaptive keep]) and the JSON-lines trace (TBA_TRACE)."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

import tba
from tba.decide.adaptive import (
    DEPTH_SAFETY,
    FIRST_K,
    KeepController,
    MeasuredGroup,
    adapt,
    simulate_keep,
)
from tba.decide.block_policy import PolicyController
from tba.decide.budget import ROOM_STEPS, widest_window
from tba.decide.cadence import Cadence
from tba.decide.readahead import FLOOR_AGE, DepthController
from tba.testing import GPT, GPTConfig, random_batch

from .._core import FakeClock

MIB = 1 << 20

MB = 10**6


def blocks(n, fwd=0.1, bwd=0.2, nbytes=100 * MB):
    return [MeasuredGroup(fwd, bwd, nbytes) for _ in range(n)]


def test_infinite_bandwidth_never_stalls():
    g = blocks(6)
    p = simulate_keep(g, kept_from=6, write_bps=1e15, read_bps=1e15, prefetch=1 << 30, k=0)
    assert p.stall_seconds == pytest.approx(0, abs=1e-6)
    assert p.step_seconds == pytest.approx(sum(x.fwd + x.bwd for x in g))
    assert p.kept_bytes == 0


def test_keeping_everything_needs_no_disk():
    g = blocks(6)
    p = simulate_keep(g, kept_from=0, write_bps=1.0, read_bps=1.0, prefetch=1 << 20, k=6)
    assert p.stall_seconds == 0 and p.kept_bytes == 6 * 100 * MB


def test_slow_reads_stall_by_the_missing_time():
    # Groups of 10 MB (one piece each) read at 10 MB/s: 1 s per group; backward computes 0.02 s.
    g = blocks(3, fwd=0.1, bwd=0.02, nbytes=10 * MB)
    p = simulate_keep(g, kept_from=3, write_bps=1e15, read_bps=10 * MB, prefetch=1 << 40, k=0)
    # The reader runs back to back from the end of forward (0.3 s): the last read lands at 3.3 s.
    assert p.step_seconds == pytest.approx(0.3 + 3.0 + 0.02, rel=1e-6)
    assert p.stall_seconds == pytest.approx(1.0 + 0.98 + 0.98, rel=1e-6)


def test_writes_still_running_are_served_from_staging():
    g = blocks(3)
    p = simulate_keep(g, kept_from=3, write_bps=1 * MB, read_bps=1e15, prefetch=1 << 40, k=0)
    assert p.staged_groups > 0 and p.stall_seconds == 0


def test_prefetch_budget_delays_reads():
    # Reads are twice as fast as backward needs, so a roomy budget reads everything ahead; a
    # budget of one piece serialises each read behind the consumption of the previous one.
    g = blocks(6, fwd=0.1, bwd=0.2, nbytes=10 * MB)
    roomy = simulate_keep(g, 6, 1e15, 100 * MB, prefetch=1 << 40, k=0)
    tight = simulate_keep(g, 6, 1e15, 100 * MB, prefetch=10 * MB, k=0)
    assert roomy.stall_seconds == pytest.approx(0.1, rel=1e-6)  # only the first read is exposed
    assert tight.stall_seconds == pytest.approx(6 * 0.1, rel=1e-6)


def test_more_bandwidth_is_never_slower_and_more_keep_never_stalls_more():
    g = [MeasuredGroup(0.1 * (i % 3 + 1), 0.25, (i + 1) * 30 * MB) for i in range(8)]
    for k in range(9):
        first = 8 - k
        slow = simulate_keep(g, first, 150 * MB, 150 * MB, 64 << 20, k)
        fast = simulate_keep(g, first, 600 * MB, 600 * MB, 64 << 20, k)
        assert fast.step_seconds <= slow.step_seconds + 1e-9
    stalls = [
        simulate_keep(g, 8 - k, 150 * MB, 150 * MB, 64 << 20, k).stall_seconds for k in range(9)
    ]
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
    ctl = KeepController("auto", prefetch_bytes=128 << 20, cadence=Cadence(FakeClock()))
    assert ctl.k == FIRST_K == 0 and ctl.decision["mode"] == "auto"
    recs = records(6, 0.1, 0.2, 100 * MB)
    ctl.observe(1, recs, 1e12, 1e12, lambda k: 6 - k, 6)
    assert ctl.k == 0  # a fast disk: nothing needs to stay
    with caplog.at_level(logging.INFO, logger="tba"):  # K moves: it says so
        ctl.observe(2, recs, 100 * MB, 100 * MB, lambda k: 6 - k, 6)  # bandwidth drifted
    assert ctl.k >= 3
    assert ctl.decision["predicted_stall_seconds"] <= 0.01 * 1.8
    assert any("keep_last=auto chose K=" in r.getMessage() for r in caplog.records)


def test_controller_waits_between_decisions_unless_something_changes():
    ctl = KeepController("auto", prefetch_bytes=128 << 20, every=5, cadence=Cadence(FakeClock()))
    recs = records(6, 0.1, 0.2, 100 * MB)
    ctl.observe(1, recs, 1e12, 1e12, lambda k: 6 - k, 6)
    decided = dict(ctl.decision)
    ctl.observe(2, recs, 1.1e12, 1.1e12, lambda k: 6 - k, 6)  # within 25%: no new decision
    assert ctl.decision == decided
    ctl.observe(3, records(6, 0.1, 0.2, 100 * MB, stall=0.1), 1e12, 1e12, lambda k: 6 - k, 6)
    assert ctl.decision["step"] == 3  # a stalled step re-decides


class SlowClock:
    """A clock on which every decision (from one reading to the next) takes ``cost`` seconds."""

    def __init__(self, cost):
        self.now, self.cost = 0.0, cost

    def __call__(self):
        self.now += self.cost
        return self.now


def test_decisions_are_paced_to_a_percent_of_compute():
    """NOTE [Decision cost]: a decision of 0.09 s is followed by none until 9 s of compute have
    run (5 steps of 1.8 s), even though every step stalls (3% of it: over STALL_SHARE, within
    the slowdown bound, whose overruns are not paced); then the next one runs."""
    ctl = KeepController("auto", prefetch_bytes=128 << 20, cadence=Cadence(SlowClock(0.09)))
    stalled = records(6, 0.1, 0.2, 100 * MB, stall=0.01)
    ctl.observe(1, stalled, 1e12, 1e12, lambda k: 6 - k, 6)
    assert ctl.decision["step"] == 1
    assert ctl.decision["decision_seconds"] == pytest.approx(0.09)
    for step in range(2, 6):  # 1.8 s of compute each: 7.2 s by step 5
        ctl.observe(step, stalled, 1e12, 1e12, lambda k: 6 - k, 6)
        assert ctl.decision["step"] == 1
    ctl.observe(6, stalled, 1e12, 1e12, lambda k: 6 - k, 6)
    assert ctl.decision["step"] == 6


def test_a_step_over_the_budget_is_not_paced():
    ctl = KeepController(
        "auto", prefetch_bytes=128 << 20, budget=300 * MB, cadence=Cadence(SlowClock(10.0))
    )
    recs = records(6, 0.1, 0.2, 100 * MB)
    ctl.observe(1, recs, 1e12, 1e12, lambda k: 6 - k, 6, saved_bytes=600 * MB, peak_bytes=0)
    ctl.observe(2, recs, 1e12, 1e12, lambda k: 6 - k, 6, saved_bytes=600 * MB, peak_bytes=10**9)
    assert ctl.decision["step"] == 2  # 10 s decisions owe 1000 s, but memory comes first


def test_the_chooser_is_paced_too():
    from .test_chooser import records as policy_records

    ctl = PolicyController("auto", None, cadence=Cadence(SlowClock(1.0)))
    budget = lambda saved: int(0.35 * saved)  # noqa: E731
    ctl.observe(1, policy_records(["offload"] * 6), 20e6, 20e6, budget, 128 * MIB)
    assert ctl.decision["step"] == 1 and ctl.decision["decision_seconds"] == pytest.approx(1.0)
    ran = ctl.decision["actions"]
    ctl.observe(2, policy_records(ran, stall=0.5), 2e9, 2e9, budget, 128 * MIB)
    assert ctl.decision["step"] == 1  # drift and stall, but 100 s of compute are owed


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


@pytest.mark.parametrize(
    "settings, first",
    [({}, 0), ({"policy": "auto"}, 0), ({"memory_budget": 0.5}, 0), ({"keep_last": 2}, 2)],
)
def test_first_step_keeps_no_block(make_offloader, settings, first):
    """Adaptive keep's step 1 keeps no block, with a budget (TBA_MEMORY_BUDGET, or auto's default
    share) or without: step 1 is where a memory cap is met first (FIRST_K). A fixed
    TBA_KEEP_LAST keeps what it says from step 1."""
    off = make_offloader(**{"keep_last": "auto", **settings})
    train(off, steps=1)
    st = off.stats()
    assert st["keep_last"] == first or st["keep_decision"]["step"] == 1  # before any decision
    assert st["group_policy"].count("keep") == first


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
    assert d.depth == int(8 * MIB * (2 + DEPTH_SAFETY * 0.1))
    assert d.decision["cap"] == 128 * MIB and d.decision["step"] == 2


def test_depth_is_the_cap_when_the_disk_is_slower_than_backward():
    d = DepthController(cap=64 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 300 * MIB)], read_bps=200 * MIB, largest_read=8 * MIB)
    assert d.depth == 64 * MIB and "slower" in d.decision["reason"]


def test_depth_never_exceeds_the_cap_and_covers_two_reads():
    d = DepthController(cap=4 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 10 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == 4 * MIB  # the cap wins, as the user asked (reads then go one at a time)
    d = DepthController(cap=64 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 1 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert 16 * MIB <= d.depth < 17 * MIB  # one entry consumed while the next is read


def test_a_stall_raises_a_floor_that_stays():
    d = DepthController(cap=128 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    small = d.depth
    d.observe(3, [_rec(0.5, 1.0, 100 * MIB, stall=0.2)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == 2 * small and "stalled" in d.decision["reason"]
    d.observe(4, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == 2 * small  # the floor holds without new stalls


def test_a_raise_then_a_cut_in_one_step_is_one_log_line(caplog):
    # A stall raises the window, then a budget cuts it back in the same step: the user sees
    # one INFO line for the net change, naming both causes, and none when the net change is
    # within DRIFT of what the last line said.
    d = DepthController(cap=128 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    d.report(2)
    small = d.depth
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tba"):
        d.observe(
            3, [_rec(0.5, 1.0, 100 * MIB, stall=0.2)], read_bps=1000 * MIB, largest_read=8 * MIB
        )
        assert d.depth == 2 * small
        d.limit(3, small + small // 2, "cut to what TBA_MEMORY_BUDGET leaves")
        d.report(3)
    lines = [r.getMessage() for r in caplog.records if "read-ahead window" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"{small} -> {small + small // 2} bytes after step 3" in lines[0]
    assert "raised after a step stalled, then cut to what TBA_MEMORY_BUDGET leaves" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tba"):
        d.observe(
            4, [_rec(0.5, 1.0, 100 * MIB, stall=0.2)], read_bps=1000 * MIB, largest_read=8 * MIB
        )
        d.limit(4, small + small // 2, "cut to what TBA_MEMORY_BUDGET leaves")
        d.report(4)  # raised and cut back to the same window: nothing to say
    assert not [r for r in caplog.records if "read-ahead window" in r.getMessage()]


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


# -- keep-all is no trap (NOTE [No absorbing state]) and TBA_MEMORY_BUDGET (NOTE [Memory budget])
LLAMA_BLOCK, LLAMA_HEAD = 123 * MB, 262 * MB  # a 6-layer HF Llama, hidden 768, batch 4, seq 512


def llama_records(k, stall=0.0):
    """Group records of that Llama with keep-last ``k``: 13 groups (odd ones are the blocks),
    the last one the head with its log-softmax output; ``stall`` spread over offloaded blocks."""
    first = 2 * (6 - k) + 1 if k else 13
    moved = sum(1 for g in range(1, 13, 2) if g < first)
    out = []
    for g in range(13):
        fwd, bwd, n = (1.2, 2.4, LLAMA_BLOCK) if g % 2 else (0.01, 0.02, 0)
        if g == 12:
            fwd, bwd, n = 0.5, 0.8, LLAMA_HEAD
        kept = g >= first
        out.append(
            {
                "fwd_seconds": fwd,
                "bwd_seconds": bwd,
                "offloaded_bytes": 0 if kept else n,
                "keepable_bytes": n if kept else 0,
                "kept_bytes": (n if kept else 0) + 2 * MIB,
                "stall_seconds": stall / moved if g % 2 and not kept and moved else 0.0,
            }
        )
    return out


def llama_kept_from(k):
    return 2 * (6 - k) + 1 if k else 13


def drive(keeper, depth, steps, slow_step=2, saved=LLAMA_HEAD + 6 * LLAMA_BLOCK):
    """The offloader's loop over the controllers: a step moves bytes only when some block is
    offloaded; during ``slow_step`` the disk is slow and backward stalls, then it recovers."""
    ks = []
    for step in range(1, steps + 1):
        recs = llama_records(keeper.k, stall=1.0 if step == slow_step else 0.0)
        moved = any(r["offloaded_bytes"] for r in recs)
        bw = (60 * MB, 30 * MB) if step == slow_step else (900 * MB, 500 * MB)
        w, r = bw if moved else (None, None)
        adapt(
            keeper,
            depth,
            step,
            recs,
            w,
            r,
            llama_kept_from,
            6,
            largest_read=16 * MIB if moved else 0,
            saved_bytes=saved,
            peak_bytes=0,
        )
        ks.append(keeper.k)
    return ks


def test_a_stall_does_not_park_adaptive_keep_in_keep_all():
    # Once: the stalled step made K=6, which moves no bytes and measures nothing, so the stale
    # slow bandwidth kept K=6 (no memory saved) for as long as nothing else changed. Now a
    # probe measures the disk again (NOTE [No absorbing state]).
    ks = drive(
        KeepController("auto", 128 << 20, every=5, cadence=Cadence(FakeClock())),
        DepthController(128 << 20),
        steps=30,
    )
    assert ks[0] == 0  # a fast disk: everything offloaded
    assert ks[1] > 0  # the slow, stalled step made it keep more ...
    assert ks[-1] == 0  # ... and it returns to offloading once the disk has recovered
    assert ks.index(0, 2) < 20


def test_auto_can_keep_every_block():
    ctl = KeepController("auto", prefetch_bytes=128 << 20)
    ctl.observe(1, records(6, 0.1, 0.2, 100 * MB), 50 * MB, 50 * MB, lambda k: 6 - k, 6)
    assert ctl.k == 5  # the first block's writes and reads hide behind the step
    assert set(ctl.decision["candidates"]) == set(range(7))
    one = KeepController("auto", prefetch_bytes=128 << 20)
    one.observe(1, records(1, 0.1, 0.2, 100 * MB), 1e12, 1 * MB, lambda k: 1 - k, 1)
    assert one.k == 1  # a single group on a slow-reading disk: kept whole, nothing else is free
    assert "keeps every block" in one.decision["reason"]


def test_a_stall_floor_ages_away():
    d = DepthController(cap=128 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    small = d.depth
    d.observe(3, [_rec(0.5, 1.0, 100 * MIB, stall=0.2)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == 2 * small
    for step in range(4, 4 + 2 * FLOOR_AGE + 1):
        d.observe(step, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    assert d.depth == small


def test_default_window_scales_with_the_steps_saved_bytes():
    d = DepthController(cap=128 * MIB, scaled=True)
    assert d.first(40 * MIB, None) == 5 * MIB  # an eighth of a small step, not 128 MiB
    assert d.decision["cap"] == 5 * MIB
    d.observe(2, [_rec(0.5, 1.0, 40 * MIB)], read_bps=1000 * MIB, largest_read=4 * MIB)
    assert 8 * MIB <= d.depth <= 9 * MIB  # two largest reads still fit: the cap grows to them
    big = DepthController(cap=128 * MIB, scaled=True)
    assert big.first(10 << 30, None) == 128 * MIB
    assert DepthController(cap=128 * MIB, scaled=True).first(10 << 30, 20 * MIB) == 20 * MIB
    fixed = DepthController(cap=128 * MIB)  # TBA_PREFETCH_BYTES set: the cap stands
    assert fixed.first(40 * MIB, None) == 128 * MIB


def test_a_stall_raises_a_default_window_to_two_largest_reads_past_its_cap():
    """NOTE [Memory budget]: a window of one largest read cannot read a large tensor while the
    smaller ones in front of it are used (W1 at batch 32 stalled 0.6 s a step at 128 MiB). A
    stall may raise the default cap to two largest reads; without one the cap stands."""
    big = dict(saved_bytes=3 << 30)
    d = DepthController(cap=128 * MIB, scaled=True)
    d.observe(2, [_rec(0.5, 1.0, 3 << 30)], 1000 * MIB, 128 * MIB, **big)
    assert d.depth == 128 * MIB  # no stall: the default cap
    d.observe(3, [_rec(0.5, 1.0, 3 << 30, stall=0.2)], 1000 * MIB, 128 * MIB, **big)
    assert d.depth == 256 * MIB and d.decision["reason"] == "raised after a step stalled"
    d.observe(4, [_rec(0.5, 1.0, 3 << 30, stall=0.2)], 1000 * MIB, 128 * MIB, **big)
    assert d.depth == 256 * MIB  # two largest reads, no more
    fixed = DepthController(cap=128 * MIB)  # TBA_PREFETCH_BYTES set: the cap stands
    fixed.observe(3, [_rec(0.5, 1.0, 3 << 30, stall=0.2)], 1000 * MIB, 128 * MIB, **big)
    assert fixed.depth == 128 * MIB


def test_the_widest_window_adds_nothing_past_the_limit():
    """NOTE [Window past the budget]: a peak set elsewhere (staging, 300 MiB) until the window
    passes 200 MiB; the widest window within that peak, in a bounded number of replays."""
    asked = []

    class P:
        def __init__(self, win):
            asked.append(win)
            self.peak_bytes = max(300 * MIB, 100 * MIB + win)

    narrow = P(128 * MIB)
    room, got = widest_window(narrow.peak_bytes, 128 * MIB, 512 * MIB, narrow, P)
    assert 128 * MIB < room <= 200 * MIB and got.peak_bytes <= narrow.peak_bytes
    assert 200 * MIB - room <= (512 - 128) * MIB >> ROOM_STEPS  # as close as the bisections go
    assert len(asked) <= ROOM_STEPS + 3
    assert widest_window(400 * MIB, 128 * MIB, 256 * MIB, narrow, P)[0] == 256 * MIB
    assert widest_window(10 * MIB, 128 * MIB, 128 * MIB, narrow, P) == (128 * MIB, narrow)


def test_budget_cuts_the_window_but_never_below_one_read():
    d = DepthController(cap=128 * MIB)
    d.observe(2, [_rec(0.5, 1.0, 100 * MIB)], read_bps=1000 * MIB, largest_read=8 * MIB)
    d.limit(2, None)
    assert d.depth > 16 * MIB
    d.limit(2, 12 * MIB)
    assert d.depth == 12 * MIB and "TBA_MEMORY_BUDGET" in d.decision["reason"]
    d.limit(2, 1 * MIB)
    assert d.depth == 8 * MIB


LLAMA_SAVED = LLAMA_HEAD + 6 * LLAMA_BLOCK + 13 * 2 * MIB


def decide(budget, bps):
    ctl = KeepController("auto", 128 << 20, budget=budget)
    kw = dict(largest_read=16 * MIB, saved_bytes=LLAMA_SAVED)
    ctl.observe(1, llama_records(1), bps, bps, llama_kept_from, 6, **kw)
    return ctl


def test_budget_cuts_the_window_to_the_room_it_leaves():
    free, bound = decide(None, 300 * MB), decide(0.2, 300 * MB)
    assert free.k == bound.k == 0 and free.room is None
    dec = bound.decision
    assert dec["allowed_bytes"] == int(0.2 * LLAMA_SAVED)
    assert dec["predicted_peak_bytes"] <= dec["allowed_bytes"]
    assert "within TBA_MEMORY_BUDGET" in dec["reason"]
    assert 16 * MIB < bound.room < 128 << 20  # cut, yet more than one read
    assert dec["candidate_peaks"][0] == dec["predicted_peak_bytes"]
    assert all(dec["candidate_peaks"][k] > dec["allowed_bytes"] for k in range(1, 7))


def test_a_budget_no_k_meets_takes_the_smallest_peak_and_says_so():
    free, bound = decide(None, 30 * MB), decide(0.35, 30 * MB)
    assert free.k >= 2  # a slow disk: unbounded, it keeps blocks
    dec = bound.decision
    assert "no K meets TBA_MEMORY_BUDGET" in dec["reason"]
    peaks = dec["candidate_peaks"]
    assert bound.k < free.k and peaks[bound.k] == min(peaks[k] for k in range(6))
    # NOTE [Window past the budget]: that peak is not the window's, so the window is not cut
    assert bound.room == 128 << 20 and dec["window_room_bytes"] == bound.room


def test_a_step_over_budget_re_decides_with_a_margin():
    saved = LLAMA_SAVED
    ctl = KeepController("auto", 128 << 20, budget=0.5, every=100)
    kw = dict(largest_read=16 * MIB, saved_bytes=saved)
    ctl.observe(1, llama_records(1), 900 * MB, 500 * MB, llama_kept_from, 6, **kw)
    first = dict(ctl.decision)
    ctl.observe(2, llama_records(ctl.k), 900 * MB, 500 * MB, llama_kept_from, 6, **kw)
    assert ctl.decision == first  # nothing changed: no new decision
    over = int(0.5 * saved) + 50 * MB
    recs = llama_records(ctl.k)
    ctl.observe(3, recs, 900 * MB, 500 * MB, llama_kept_from, 6, peak_bytes=over, **kw)
    assert ctl.decision["step"] == 3
    assert ctl.margin == over - first["predicted_peak_bytes"] > 0
    assert ctl.decision["predicted_peak_bytes"] <= int(0.5 * saved) - ctl.margin


def test_offloader_reports_its_budget(make_offloader):
    off = make_offloader(memory_budget=0.5, keep_last="auto")
    train(off, steps=3)
    st = off.stats()
    dec = st["budget_decision"]
    assert dec["budget"] == 0.5 and dec["describe"] == "0.5 of saved_bytes"
    assert dec["allowed_bytes"] == int(0.5 * st["saved_bytes"])
    assert dec["window_bytes"] == off.prefetcher.budget == st["prefetch_decision"]["depth"]
    assert dec["keep_last"] == st["keep_last"] < CFG.layers
    assert isinstance(dec["met"], bool)
    none = make_offloader()
    train(none, steps=1)
    assert none.stats()["budget_decision"]["allowed_bytes"] is None
    assert none.stats()["budget_decision"]["met"] is None


def test_pieces_are_no_larger_than_the_largest_read():
    """Blocks of 28 MB read as 8 MiB tensors through a 19.5 MB window: two reads fit, so a
    fast disk hides every read. Cut into 14 MB pieces the window would hold one, and the
    prediction would stall on every block (it chose K=5 of 6 on a small GPT)."""
    recs = records(6, 0.2, 0.4, 28 * MB)
    cut = KeepController("auto", prefetch_bytes=19_500_000)
    cut.observe(1, recs, 400 * MB, 440 * MB, lambda k: 6 - k, 6, largest_read=8 * MIB)
    dec = cut.decision
    assert cut.k == 0 and dec["predicted_stall_seconds"] <= 0.01 * dec["compute_seconds"]
    whole = KeepController("auto", prefetch_bytes=19_500_000)
    whole.observe(1, recs, 400 * MB, 440 * MB, lambda k: 6 - k, 6)  # nothing said: PIECE
    assert whole.decision["candidates"][0] > cut.decision["candidates"][0]


class _Pause(torch.autograd.Function):
    """Identity whose backward takes ``seconds``: a block's own backward time, known."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class _SharingBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x, table):
        x = _Pause.apply(self.a(x), 0.05)  # between this block's first and last unpack
        return self.b(x) * table  # saves `table`, the same tensor in every block


class _SharingModel(torch.nn.Module):
    """Every block saves one tensor computed before the blocks, as a rotary table is."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("pos", torch.arange(64.0))
        self.layers = torch.nn.ModuleList(_SharingBlock() for _ in range(n))

    def forward(self, x):
        table = torch.cos(self.pos)
        for layer in self.layers:
            x = layer(x, table)
        return x.sum()


@pytest.mark.parametrize("min_offload", [1, 1 << 30], ids=["offloaded", "kept"])
def test_a_tensor_every_block_saves_times_each_block_by_its_own_backward(
    make_offloader, min_offload
):
    # NOTE [Backward timing]: timed by the block that saved it first, the shared table made
    # the first block's backward look like the whole backward and the second's like none.
    off = make_offloader(min_offload_bytes=min_offload, keep_last=0)
    model = _SharingModel(4)
    x = torch.randn(32, 64)
    for _ in range(2):
        with off.step(model):
            loss = model(x)
        loss.backward()
    off.synchronize()
    st = off.stats()
    assert st["dedup_hits"] >= 3  # the table, saved again by blocks 2 to 4
    recs = off._last.group_records()
    bwd = [r["bwd_seconds"] for r in recs if r["tensors"] > 0][:4]  # the 4 blocks, in order
    assert len(bwd) == 4 and all(0.04 <= b < 5 for b in bwd), bwd


HEAD_CFG = GPTConfig(vocab=512, seq=64, hidden=64, heads=4, layers=4)


def _head_trace(make_offloader, path, **kw):
    off = make_offloader(trace=str(path), **kw)
    torch.manual_seed(0)
    model = GPT(HEAD_CFG)
    x, y = random_batch(HEAD_CFG, 4)
    for _ in range(4):
        with off.step(model):
            loss = model(x, y)
        loss.backward()
    off.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    head = 2 * HEAD_CFG.layers  # groups: lead, then block i at 2i+1 and what follows it at 2i+2
    return {
        s["step"]: (
            [g for g in lines if g["type"] == "group" and g["step"] == s["step"]][head],
            s,
        )
        for s in lines
        if s["type"] == "step"
    }


def test_adaptive_keep_keeps_the_head_at_every_k(make_offloader, tmp_path):
    """NOTE [Head under adaptive keep]: what the forward packs after the last block (here the
    final LayerNorm, the LM head's input and the cross-entropy's log-softmax) is kept under
    TBA_KEEP_LAST=auto whatever K is, K=0 included, except in step 1 under a budget; an explicit
    keep_last=0 writes it."""
    auto = _head_trace(make_offloader, tmp_path / "auto.jsonl", keep_last="auto", memory_budget=0.3)
    k0 = [st for head, st in auto.values() if st["keep_last"] == 0]
    assert k0, "the budget should leave adaptive keep at K=0 in some step"
    for head, st in auto.values():
        if st["step"] == 1:  # under a budget step 1 offloads the head too (nothing measured)
            assert not head["kept"] and head["tensors"] > 0 and head["kept_bytes"] == 0
            continue
        assert head["kept"] and head["offloaded_bytes"] == 0, (st["step"], head)
    free = _head_trace(make_offloader, tmp_path / "free.jsonl", keep_last="auto")
    assert all(head["kept"] for head, _ in free.values())  # without a budget, step 1 too
    fixed = _head_trace(make_offloader, tmp_path / "fixed.jsonl", keep_last=0)
    for head, _ in fixed.values():
        # offloaded: nothing of it kept (whether its write ran before backward took the bytes
        # back from staging depends on the I/O thread's timing, so offloaded_bytes may be 0)
        assert not head["kept"] and head["tensors"] > 0 and head["kept_bytes"] == 0


def test_adaptive_keeps_simulation_keeps_the_head_at_k0():
    """kept_from, which adaptive keep's simulation uses, says the same as the run: the head
    (group 2n) is resident at K=0 under adaptive keep, and not with a fixed K=0."""
    from tba.datapath.blocks.groups import GroupTracker

    g = GroupTracker(keep_last=0, group_bytes=1 << 20)
    g.n_blocks = 6
    assert g.kept_from(0, 13) == 13 and g.kept_from(1, 13) == 11
    g.adaptive = True
    assert g.kept_from(0, 13) == 13  # not a single stack: what follows may be a second one
    g.one_stack = True
    assert g.kept_from(0, 13) == 12 and g.kept_from(1, 13) == 11
    g.n_blocks = 0  # pack-order windows (blocks lost in a compiled region): no head
    assert g.kept_from(0, 5) == 5
    g.n_blocks = 6
    g.assignment = {0: "recompute"}  # auto has chosen: the head follows the last block again
    assert g.kept_from(0, 13) == 13


def test_only_a_models_single_stack_has_a_head():
    """one_stack: a decoder-only LM's blocks are its only stack of repeated modules, so what
    runs after them is a head; an encoder-decoder's second stack (the blocks found are the
    encoder's) is not a head, and it is not kept (NOTE [Head under adaptive keep])."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    from tba.datapath.blocks.groups import detect_blocks, one_stack

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    models = {
        "gpt": (GPT(CFG), True),
        "llama": (LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, **small)), True),
        "mixtral": (
            MixtralForCausalLM(MixtralConfig(num_hidden_layers=3, num_local_experts=4, **small)),
            True,
        ),
        "t5": (
            T5ForConditionalGeneration(
                T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
            ),
            False,
        ),
        "bart": (
            BartForConditionalGeneration(
                BartConfig(
                    vocab_size=64,
                    d_model=32,
                    encoder_layers=2,
                    decoder_layers=2,
                    encoder_attention_heads=4,
                    decoder_attention_heads=4,
                    encoder_ffn_dim=64,
                    decoder_ffn_dim=64,
                )
            ),
            False,
        ),
    }
    for name, (model, single) in models.items():
        assert one_stack(model, detect_blocks(model)) is single, name
