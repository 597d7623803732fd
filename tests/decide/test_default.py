"""The default that never costs (NOTE [Slowdown bound], NOTE [No absorbing state] in
tba/decide/adaptive.py): adaptive keep fed measured figures directly, no wall clock.

Each step is "run" by the simulator itself at the true rates of the scenario: the K the
controller chose gives the step's stalls, and the step reports the write and read rates only
when it moved bytes, as the offloader does."""

from __future__ import annotations

import pytest

import tba
from tba.decide.adaptive import FIRST_K, PROBE_SHARE, KeepController, MeasuredGroup, simulate_keep
from tba.decide.cadence import Cadence

from .._core import FakeClock

MB = 10**6
MIB = 1 << 20
N = 16


def kept_from(k: int) -> int:
    return N - k


class Machine:
    """A model of N equal blocks on a disk: what a step with keep-last K measures."""

    def __init__(self, fwd, bwd, nbytes, write_bps, read_bps, staging=(256 * MIB, False)):
        self.fwd, self.bwd, self.nbytes = fwd, bwd, nbytes
        self.write_bps, self.read_bps = write_bps, read_bps
        self.staging = staging

    def records(self, k: int) -> list[dict]:
        groups = [MeasuredGroup(self.fwd, self.bwd, self.nbytes) for _ in range(N)]
        got = simulate_keep(
            groups, kept_from(k), self.write_bps, self.read_bps, 128 << 20, k, self.staging
        )
        first = kept_from(k)
        moved = sum(1 for i in range(N) if i < first)
        return [
            {
                "fwd_seconds": self.fwd,
                "bwd_seconds": self.bwd,
                "offloaded_bytes": self.nbytes if i < first else 0,
                "keepable_bytes": 0 if i < first else self.nbytes,
                "kept_bytes": 0 if i < first else self.nbytes,
                "stall_seconds": got.stall_seconds / moved if i < first else 0.0,
            }
            for i in range(N)
        ]

    def step(self, ctl: KeepController, index: int) -> dict:
        recs = self.records(ctl.k)
        moved = any(r["offloaded_bytes"] for r in recs)
        w, r = (self.write_bps, self.read_bps) if moved else (None, None)
        ctl.observe(index, recs, w, r, kept_from, N, largest_read=16 * MIB if moved else 0)
        return {"k": ctl.k, "seconds": sum(x["fwd_seconds"] + x["bwd_seconds"] for x in recs)}


def controller(**kw) -> KeepController:
    kw.setdefault("staging", (256 * MIB, False))
    return KeepController("auto", 128 << 20, cadence=Cadence(FakeClock()), **kw)


def run(machine, ctl, steps, start=1):
    return [machine.step(ctl, i)["k"] for i in range(start, start + steps)]


# The H200 case of the issue: 0.85 B Llama, 7.77 GB saved per 75 ms step, a 2 GB/s disk whose
# reads came back at 0.82 GB/s.
H200 = dict(fwd=0.025 / N, bwd=0.050 / N, nbytes=int(7.77e9 / N))


def test_slow_disk_fast_compute_converges_to_keep_all_within_the_bound():
    m = Machine(**H200, write_bps=2e9, read_bps=0.82e9)
    ctl = controller()
    assert ctl.k == FIRST_K
    ks = run(m, ctl, 5)
    assert ks == [N] * 5  # keep-all is reachable: the first decision goes there
    d = ctl.decision
    assert "keeps every block" in d["reason"]
    assert d["predicted_step_seconds"] <= 1.05 * d["compute_seconds"]
    # every smaller K is predicted over the bound: nothing else would have been free
    assert all(s > 1.05 * d["compute_seconds"] for k, s in d["candidates"].items() if k < N)


def test_fast_disk_offloads():
    m = Machine(fwd=0.1, bwd=0.2, nbytes=100 * MB, write_bps=20e9, read_bps=20e9)
    ctl = controller()
    ks = run(m, ctl, 4)
    assert ks[-1] < N // 2  # most blocks offloaded
    d = ctl.decision
    assert d["predicted_step_seconds"] <= 1.05 * d["compute_seconds"]
    assert "within TBA_MAX_SLOWDOWN=1.05" in d["reason"]


def test_the_bound_is_the_users():
    # the same slow-ish disk: a looser bound frees more memory, a bound of 1 keeps more
    m = Machine(fwd=0.01, bwd=0.02, nbytes=100 * MB, write_bps=3e9, read_bps=1.5e9)
    loose = run(m, controller(max_slowdown=2.0), 3)[-1]
    tight = run(m, controller(max_slowdown=1.0), 3)[-1]
    assert loose < tight


def test_after_keep_all_a_faster_disk_is_found_by_a_probe():
    slow = Machine(**H200, write_bps=2e9, read_bps=0.82e9)
    ctl = controller(every=5)
    assert run(slow, ctl, 3) == [N] * 3
    fast = Machine(**H200, write_bps=400e9, read_bps=400e9)  # the disk got fast
    ks = run(fast, ctl, 400, start=4)
    probe = ks.index(N - 1)  # one step offloads the first block to measure the disk ...
    assert ks[:probe] == [N] * probe
    assert max(ks[probe + 1 :]) < N - 1  # ... and the next steps offload on what it measured
    assert ctl.decision["write_bps"] == 400e9


def test_probes_cost_at_most_their_share_of_compute():
    slow = Machine(**H200, write_bps=2e9, read_bps=0.82e9)
    ctl = controller(every=5)
    steps = 4000
    ks = run(slow, ctl, steps)
    assert max(ks[:1]) == N and ks.count(N - 1) >= 2  # it keeps probing, never parks
    probe = slow.records(N - 1)
    extra = sum(x["stall_seconds"] for x in probe)
    compute = steps * sum(x["fwd_seconds"] + x["bwd_seconds"] for x in probe)
    assert ks.count(N - 1) * extra <= PROBE_SHARE * compute * 1.01
    assert ks.count(N - 1) * extra > 0


def test_after_keep_all_a_change_in_compute_re_decides():
    # a disk that cannot keep up with a short step keeps up with one a hundred times as long
    m = Machine(**H200, write_bps=2e9, read_bps=0.82e9)
    ctl = controller(every=10**6)  # no probes: only the change in compute can act
    assert run(m, ctl, 3) == [N] * 3
    slower = dict(H200, fwd=100 * H200["fwd"], bwd=100 * H200["bwd"])  # e.g. a longer sequence
    longer = Machine(**slower, write_bps=2e9, read_bps=0.82e9)
    ks = run(longer, ctl, 2, start=4)
    assert ks[0] < N  # offloads again at once, on the bandwidth it last measured
    assert ks[1] == ks[0]  # and stays there: the prediction held


def test_after_offloading_a_measured_slowdown_leads_back():
    # the prediction says offloading is free, but each step that offloads measures a stall the
    # model does not know of (a disk busy with something else): the controller goes back
    fast = Machine(fwd=0.1, bwd=0.2, nbytes=100 * MB, write_bps=20e9, read_bps=20e9)
    ctl = controller()
    run(fast, ctl, 2)
    assert ctl.k < N // 2
    seen = []
    for step in range(3, 3 + N + 2):
        recs = fast.records(ctl.k)
        moved = [r for r in recs if r["offloaded_bytes"]]
        for r in moved:
            r["stall_seconds"] = 1.0 / len(moved)  # 1 s on a 4.8 s step: 1.21x
        ctl.observe(step, recs, 20e9 if moved else None, 20e9 if moved else None, kept_from, N)
        seen.append(ctl.k)
    assert seen[-1] == N  # back to keeping everything
    assert all(b >= a for a, b in zip(seen, seen[1:]))  # always up, never round again
    assert len(set(seen)) <= 3  # the missed seconds per byte move it in few steps


def test_with_a_budget_the_budget_is_met():
    saved = N * H200["nbytes"]
    for budget, want in ((saved + 1, N), (0.35, None)):
        # a budget makes a full staging wait (TBA_STAGING_FULL's default under one)
        m = Machine(**H200, write_bps=2e9, read_bps=0.82e9, staging=(256 * MIB, True))
        ctl = controller(budget=budget, staging=(256 * MIB, True))
        assert ctl.k == 0  # a budget: no block kept on step 1
        for step in range(1, 4):
            recs = m.records(ctl.k)
            ctl.observe(
                step, recs, 2e9, 0.82e9, kept_from, N, largest_read=16 * MIB, saved_bytes=saved
            )
        d = ctl.decision
        allowed = budget if isinstance(budget, int) else int(budget * saved)
        assert d["allowed_bytes"] == allowed
        assert d["predicted_peak_bytes"] <= allowed
        if want is not None:  # a budget that holds everything: the least time is keep-all
            assert ctl.k == want
        else:  # the fastest K that fits: the next K up is over the budget
            assert ctl.k < N and d["candidate_peaks"][ctl.k + 1] > allowed


def test_bounded_staging_is_modelled():
    # 20 blocks of 100 MB written at 1 GB/s while the forward takes 0.2 s: a 256 MiB staging
    # is full after a few blocks. Kept when full (the default), the rest stays resident and is
    # neither written nor read; waiting, the forward waits for the disk.
    g = [MeasuredGroup(0.01, 0.02, 100 * MB) for _ in range(20)]
    free = simulate_keep(g, 20, 1e9, 1e9, 128 << 20, 0)
    keep = simulate_keep(g, 20, 1e9, 1e9, 128 << 20, 0, (256 * MIB, False))
    wait = simulate_keep(g, 20, 1e9, 1e9, 128 << 20, 0, (256 * MIB, True))
    assert keep.kept_bytes == 0 and free.stall_seconds > keep.stall_seconds
    assert wait.step_seconds > 1.5  # 2 GB at 1 GB/s: the forward waits for the writes
    assert free.step_seconds < wait.step_seconds


def test_max_slowdown_setting(monkeypatch):
    assert tba.Config().max_slowdown == 1.05
    assert tba.Config(max_slowdown="1.2x").max_slowdown == 1.2
    monkeypatch.setenv("TBA_MAX_SLOWDOWN", "1.1")
    assert tba.Config().max_slowdown == 1.1
    with pytest.raises(tba.ConfigError, match=r"TBA_MAX_SLOWDOWN='0.9' is invalid.*at least 1"):
        monkeypatch.setenv("TBA_MAX_SLOWDOWN", "0.9")
        tba.Config()
    with pytest.raises(tba.ConfigError, match=r"max_slowdown='fast' is invalid"):
        monkeypatch.delenv("TBA_MAX_SLOWDOWN")
        tba.Config(max_slowdown="fast")


def test_a_budget_out_of_reach_does_not_let_the_window_grow():
    """NOTE [No growth past the budget]: no K fits, every step stalls and wants a wider window;
    the window the budget leaves never grows past the one in force."""
    m = Machine(fwd=0.1, bwd=0.2, nbytes=100 * MB, write_bps=50e6, read_bps=50e6)
    ctl = controller(budget=20 * MB, staging=(256 * MIB, True))
    rooms = []
    for step in range(1, 7):
        ctl.prefetch = (16 << 20) * 2**step  # what DepthController wants after each stall
        recs = m.records(ctl.k)
        for r in recs:
            r["stall_seconds"] = 0.1
        ctl.observe(
            step, recs, 50e6, 50e6, kept_from, N, largest_read=16 * MIB, saved_bytes=N * 100 * MB
        )
        assert ctl.decision["reason"].startswith("no K meets")
        rooms.append(ctl.room)
    assert all(b <= a for a, b in zip(rooms, rooms[1:]))


def _stalled_steps(ctl, machine, extra):
    """Runs steps with ``extra[i]`` seconds of unmodelled stall on step i's offloaded blocks
    (as test_after_offloading_a_measured_slowdown_leads_back); the K each ran with."""
    ks = []
    for step, add in enumerate(extra, start=3):
        ks.append(ctl.k)
        recs = machine.records(ctl.k)
        moved = [r for r in recs if r["offloaded_bytes"]]
        for r in moved:
            r["stall_seconds"] = add / len(moved)
        w = 20e9 if moved else None
        ctl.observe(step, recs, w, w, kept_from, N)
    return ks


def test_one_slow_step_alone_does_not_move_k():
    """A noisy host: one step 1.21x, the rest on time. K stays; two in a row at the same K move
    it (NOTE [Slowdown bound])."""
    fast = Machine(fwd=0.1, bwd=0.2, nbytes=100 * MB, write_bps=20e9, read_bps=20e9)
    ctl = controller()
    run(fast, ctl, 2)
    k = ctl.k
    assert k < N // 2
    ks = _stalled_steps(ctl, fast, [0.0, 1.0, 0.0, 0.0, 0.0])
    assert set(ks) == {k} and ctl.k == k  # the outlier moved nothing
    ks = _stalled_steps(ctl, fast, [1.0, 1.0, 0.0])
    assert ks[:2] == [k, k] and ctl.k > k  # two in a row did
