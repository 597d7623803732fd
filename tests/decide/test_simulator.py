"""The one simulator (NOTE [Simulator] in tba/decide/simulator/engine.py): its rules, and that the
runtime's adaptive keep and `tba plan` predict the same step for the same measured groups."""

from __future__ import annotations

import json

import pytest

from tba import plan as P
from tba.datapath.blocks.groups import GroupTracker
from tba.decide import adaptive
from tba.decide.simulator import (
    PIECE,
    Engine,
    Saved,
    Setup,
    Span,
    kept_from,
    measured_pieces,
    pieces,
)

MiB = 1 << 20


# -- the rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_blocks", [1, 3, 6])
def test_the_keep_rule_over_the_runtimes_numbering(n_blocks):
    # With a model, tba numbers groups 0 (before the first block), 2i+1 (block i), 2i+2 (after):
    # keep-last k keeps from block n-k on, every block once k reaches n
    tracker = GroupTracker(keep_last=0, group_bytes=MiB)
    tracker.n_blocks = n_blocks
    groups = 2 * n_blocks + 1
    blocks = [i % 2 == 1 for i in range(groups)]
    assert tracker.kept_from(0, groups) == kept_from(blocks, 0) == groups
    for k in range(1, n_blocks + 3):
        want = 2 * max(0, n_blocks - k) + 1
        assert kept_from(blocks, k) == tracker.kept_from(k, groups) == want
    # Without one, every group is a pack-order window, and a block for K
    tracker.n_blocks = 0
    for k in range(9):
        assert (
            kept_from([True] * 6, k) == tracker.kept_from(k, 6) == (6 if k == 0 else max(0, 6 - k))
        )


def test_pieces_keep_every_byte_and_cover_the_group_in_order():
    got = pieces(3 * PIECE + 5, "g.")
    assert len(got) == 4 and sum(p.nbytes for p in got) == 3 * PIECE + 5
    assert max(p.nbytes for p in got) <= PIECE
    assert [p.pack_at for p in got] == [0.125, 0.375, 0.625, 0.875]  # mid-slice, forward
    assert [p.use_at for p in got] == [0.75, 0.5, 0.25, 0.0]  # backward reaches slice j
    assert [p.free_at for p in got] == [1.0, 0.75, 0.5, 0.25]  # ... and leaves it
    assert pieces(0) == [] and len(pieces(1)) == 1


def test_a_tensor_held_past_its_use_holds_its_read_ahead_budget():
    # "b" is packed last, so read first and needed first; a window of one tensor, 0.1 s reads
    reads = 16 * MiB / 0.1
    a = Saved("a", 16 * MiB, 0.2, 0.55)
    at_use = [a, Saved("b", 16 * MiB, 0.8, 0.0)]
    held = [a, Saved("b", 16 * MiB, 0.8, 0.0, free_at=0.5)]
    setup = Setup(read_bps=reads, prefetch_bytes=16 * MiB)
    one = Engine(setup).step([Span(1.0, 1.0, at_use)], 1)
    two = Engine(setup).step([Span(1.0, 1.0, held)], 1)
    # "b" is read from the end of forward (1.0 s): backward waits 0.1 s for it either way
    # released at its use, "b" lets "a" be read at 1.1 s, well before its use at 1.65 s
    assert one.stall_seconds == pytest.approx(0.1) and one.sync_loads == 0
    # held to 1.6 s, "b" keeps "a" waiting: read 1.6-1.7 s, 0.05 s after backward needs it
    assert two.stall_seconds == pytest.approx(0.15) and two.sync_loads == 0
    assert one.bytes_read == two.bytes_read == 32 * MiB


def test_unbounded_staging_never_keeps_for_lack_of_it():
    slow = Setup(write_bps=1.0, read_bps=1.0)  # no write ever completes
    r = Engine(slow).step([Span(1.0, 1.0, pieces(100 * PIECE))], 1)
    assert r.staging_full_bytes == 0 and r.bytes_written == 100 * PIECE
    assert r.stall_seconds == 0 and r.served_from_staging == 100 * PIECE


@pytest.mark.parametrize("waits", [False, True])
def test_a_full_staging_keeps_or_waits(waits):
    """Two groups of 1 s, one 16 MiB piece each (packed at 0.5 s and 1.5 s), 16 MiB of
    staging: the second piece needs the first one's write to have landed."""
    two = [Span(1.0, 1.0, pieces(PIECE)), Span(1.0, 1.0, pieces(PIECE))]

    def run(write_bps):
        su = Setup(write_bps=write_bps, read_bps=1e12, staging_bytes=PIECE, staging_waits=waits)
        return Engine(su).step(two, 2)

    r = run(PIECE)  # the first write lands at 1.5 s, just in time: nothing kept, no wait
    assert r.staging_full_bytes == 0 and r.bytes_written == 2 * PIECE
    assert r.forward_seconds == pytest.approx(2.0)
    r = run(PIECE / 4)  # it lands at 4.5 s
    if waits:  # the second pack waits 3 s for it
        assert r.staging_full_bytes == 0 and r.bytes_written == 2 * PIECE
        assert r.forward_seconds == pytest.approx(5.0)
    else:  # kept resident; the forward goes on
        assert r.staging_full_bytes == PIECE and r.bytes_written == PIECE
        assert r.forward_seconds == pytest.approx(2.0)


def test_the_budgets_staging_limit_waits_and_lets_a_large_tensor_go_alone():
    """NOTE [Staging within the budget], as the run applies it: under ``staging_limit`` a pack
    waits while the bytes in flight would pass the limit, and a tensor larger than the limit
    goes alone once nothing else is in flight (never kept for it). Two groups of 1 s, one
    piece each (packed at 0.5 s and 1.5 s), writes of 4 s each, a 256 MiB arena."""
    two = [Span(1.0, 1.0, pieces(PIECE)), Span(1.0, 1.0, pieces(PIECE))]

    def run(limit):
        su = Setup(
            write_bps=PIECE / 4,
            read_bps=1e12,
            staging_bytes=256 * MiB,
            staging_waits=True,
            staging_limit=limit,
        )
        return Engine(su).step(two, 2)

    free = run(None)  # the arena holds both: no wait
    assert free.forward_seconds == pytest.approx(2.0)
    assert free.staging_full_bytes == 0 and free.bytes_written == 2 * PIECE
    for limit in (PIECE, PIECE // 2):  # one piece in flight at most; half a piece: alone
        r = run(limit)
        assert r.staging_full_bytes == 0 and r.bytes_written == 2 * PIECE  # none kept
        assert r.forward_seconds == pytest.approx(5.0)  # the second pack waits 3 s


def test_layout_keeps_every_byte_in_pack_order():
    MiB = 1 << 20
    sizes = [8 * MiB, 1000, 2000, 24 * MiB, 3000, 32 * MiB]
    got = measured_pieces(sum(sizes), sizes, "g")
    # runs of small ones merge into one; order and bytes stay
    assert [s.nbytes for s in got] == [8 * MiB, 3000, 24 * MiB, 3000, 32 * MiB]
    assert [s.pack_at for s in got] == sorted(s.pack_at for s in got)
    assert [s.use_at for s in got] == sorted((s.use_at for s in got), reverse=True)
    # measured in another step: scaled to the group's bytes, the shape kept
    half = measured_pieces(sum(sizes) // 2, sizes)
    assert sum(s.nbytes for s in half) == sum(sizes) // 2
    assert half[-1].nbytes == pytest.approx(16 * MiB, abs=4)
    assert measured_pieces(10 * PIECE, []) == pieces(10 * PIECE)  # unknown: pieces


def test_the_simulator_takes_the_measured_layout():
    """NOTE [Measured layout]: a block of four 8 MiB saves, then one of 96 MiB, 0.15 s of
    forward, writes at 50 MB/s (8 MiB in 0.17 s), a 128 MiB window. When the forward ends
    (0.25 s) only the first save has landed: the plan (last packed first) budgets the 96 MiB
    one and the next three as still being written, and reads the first, 8 MiB. As uniform
    pieces (9 of 14.2 MiB, 0.3 s to write each) nothing has landed and nothing is read."""
    MiB = 1 << 20
    sizes = [8 * MiB] * 4 + [96 * MiB]
    su = Setup(write_bps=50e6, read_bps=50e6, prefetch_bytes=128 * MiB)
    spans = [Span(0.15, 0.3, measured_pieces(sum(sizes), sizes)), Span(0.1, 1.0, [])]
    assert Engine(su).step(spans, 2).bytes_read == 8 * MiB
    spans[0] = Span(0.15, 0.3, pieces(sum(sizes)))
    assert Engine(su).step(spans, 2).bytes_read == 0


# -- the runtime and the planner agree -----------------------------------------------------------
def _trace(path, rows, write_bps, read_bps, prefetch):
    """A TBA_TRACE file of two identical steps with these (fwd, bwd, offloaded) groups."""
    config = {"prefetch_bytes": prefetch, "staging_bytes": 1 << 40, "min_offload_bytes": MiB}
    lines: list[dict] = [{"type": "meta", "version": 1, "config": config}]
    for step in (1, 2):
        for g, (fwd, bwd, nbytes) in enumerate(rows):
            lines.append(
                {"type": "group", "step": step, "group": g, "kept": False, "tensors": 1,
                 "packed_bytes": nbytes, "offloaded_bytes": nbytes, "kept_bytes": 0,
                 "keepable_bytes": 0, "fwd_seconds": fwd, "bwd_seconds": bwd,
                 "stall_seconds": 0.0}
            )  # fmt: skip
        lines.append({"type": "step", "step": step, "write_bps": write_bps, "read_bps": read_bps})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _records(rows):
    return [
        {"fwd_seconds": f, "bwd_seconds": b, "offloaded_bytes": n, "keepable_bytes": 0,
         "stall_seconds": 0.0}
        for f, b, n in rows
    ]  # fmt: skip


# Groups of whole 16 MiB pieces (so tba plan's 4 KiB extent rounding changes nothing) and a
# window of one piece (so the window tba plan sizes within the cap is the cap, as the runtime's).
ROWS = [(0.1, 0.2, 32 * MiB), (0.3, 0.5, 48 * MiB), (0.1, 0.3, 16 * MiB), (0.2, 0.2, 64 * MiB)]
ROWS += [(0.05, 0.1, 16 * MiB), (0.2, 0.4, 32 * MiB)]


@pytest.mark.parametrize(
    "write_bps, read_bps", [(50e6, 50e6), (150e6, 400e6), (1e9, 100e6), (4e9, 4e9)]
)
def test_runtime_and_planner_predict_the_same_step_for_each_k(tmp_path, write_bps, read_bps):
    window = PIECE
    path = _trace(tmp_path / "t.jsonl", ROWS, write_bps, read_bps, window)
    w, info = P.read_trace(path)
    hw = P.Hardware(info.write_bps, info.read_bps, device="cpu")
    knobs = P.Knobs(prefetch_bytes=window, staging_bytes=1 << 40, min_offload_bytes=MiB)
    groups = [adaptive.MeasuredGroup(f, b, n) for f, b, n in ROWS]
    n = len(ROWS)
    ctl = adaptive.KeepController("auto", prefetch_bytes=window)
    ctl.observe(1, _records(ROWS), write_bps, read_bps, lambda k: n - k, n)
    for k in range(n + 1):
        planned = P.simulate(w, hw, knobs, k, steps=1)
        runtime = adaptive.simulate_keep(groups, n - k, write_bps, read_bps, window, k)
        assert runtime.step_seconds == pytest.approx(planned.step_seconds, rel=1e-12)
        assert runtime.stall_seconds == pytest.approx(planned.stall_seconds, rel=1e-12, abs=1e-12)
        assert ctl.decision["candidates"][k] == round(planned.step_seconds, 4)
