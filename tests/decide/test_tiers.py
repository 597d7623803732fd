"""Tiers in the decision: the spill order (NOTE [Tier order] in tba/decide/tiers.py) and the
simulator's host tier (NOTE [Simulator], the Tiers rule), checked against timelines worked out
by hand."""

from __future__ import annotations

import math

import pytest

from tba.decide.chooser import Cost, choose, predict
from tba.decide.simulator import Engine, Saved, Setup, Span
from tba.decide.tiers import HEADROOM, spill_groups


# -- the spill order ---------------------------------------------------------------------------
def test_everything_that_fits_stays_in_the_host_tier():
    assert spill_groups([(0, 100), (1, 100), (2, 100)], 1000) == 0
    assert spill_groups([], 0) == 0


def test_the_leading_groups_go_to_disk_until_the_rest_fits():
    # room = 256 - 256/32 = 248: groups 2 and 1 (200) fit, group 0 would make 300
    assert spill_groups([(0, 100), (1, 100), (2, 100)], 256) == 1
    # room = 150 - 4 = 146: only group 2 fits
    assert spill_groups([(2, 100), (0, 100), (1, 100)], 150) == 2
    # nothing fits: every group to disk
    assert spill_groups([(0, 100), (1, 100)], 50) == 2


def test_groups_that_offload_nothing_do_not_move_the_boundary():
    # group 3 (the head, kept) offloads nothing; group 1 was recomputed
    assert spill_groups([(0, 100), (1, 0), (2, 100), (3, 0)], 256) == 0
    assert spill_groups([(0, 100), (1, 0), (2, 100), (3, 0)], 150) == 1
    assert HEADROOM == 1 / 32


# -- the simulator's host tier -----------------------------------------------------------------
def three(nbytes=100):
    """Three groups of 1 s forward and 1 s backward, each saving one tensor at mid-group that
    backward uses at mid-group."""
    return [Span(1.0, 1.0, [Saved(f"g{i}", nbytes, 0.5, 0.5, False)]) for i in range(3)]


def run(setup, actions=("offload",) * 3):
    engine = Engine(setup)
    res = engine.step(three(), 3, actions=list(actions))
    return res


def test_a_tensor_bound_for_the_tier_takes_no_staging():
    """NOTE [Host capture]: the device copy lands in the tier, so a staging of 150 B, which lets
    one 100 B transfer (10 s at 10 B/s) at a time through to the disk, holds back none of the
    tier's, whose copies are as slow."""
    disk = run(Setup(write_bps=10, read_bps=50, staging_bytes=150))
    assert disk.bytes_written < 300  # staging full while the disk writes: some kept
    slow = {"write_bps": 10, "read_bps": 50, "staging_bytes": 150, "host_bps": 10}
    tier = run(Setup(**slow, host_bytes=1000))
    assert tier.host_bytes_written == tier.bytes_written == 300 and tier.spill_groups == 0


def test_without_a_tier_every_byte_goes_to_disk():
    res = run(Setup(write_bps=100, read_bps=50))
    assert res.host_bytes_written == 0 and res.ssd_bytes_written == res.bytes_written == 300
    assert res.spill_groups == 0 and res.peak_host_tier_bytes == 0


def test_the_earliest_group_goes_to_disk_and_backward_does_not_wait():
    """host_bytes 256: group 0 to disk (spill_groups 1), groups 1 and 2 to the host tier.
    Forward: group 0's write 0.5 -> 1.5 (100 B at 100 B/s); the host copies are instant.
    Backward from t=3: groups 2 and 1 come from the host at once, group 0's read 3 -> 5
    (50 B/s), needed at 5.5: no stall, the step is 3 + 3 = 6 s."""
    res = run(Setup(write_bps=100, read_bps=50, host_bytes=256))
    assert res.spill_groups == 1
    assert res.ssd_bytes_written == 100 and res.host_bytes_written == 200
    assert res.peak_host_tier_bytes == 200
    assert res.step_seconds == pytest.approx(6.0) and res.stall_seconds == 0.0
    assert res.bytes_read == 300  # both tiers


def test_the_last_group_on_disk_waits_where_the_first_would_not():
    """Forced the other way round (group 2 on disk, groups 0 and 1 in the host tier), behind
    a kept 5 s group so that every write has finished when backward starts at t=8: group 2's
    read 8 -> 10 (50 B/s) is needed at 8.5, a 1.5 s stall (the step 12.5 s). Group 0 on disk
    (the Tiers rule's choice) is needed at 10.5, after its read: no stall, 11 s."""
    groups = [*three(), Span(5.0, 0.0, [])]
    setup = Setup(write_bps=100, read_bps=50, host_bytes=256)
    wrong = Engine(setup).step(groups, 4, actions=["host", "host", "ssd", "keep"])
    assert wrong.ssd_bytes_written == 100 and wrong.host_bytes_written == 200
    assert wrong.stall_seconds == pytest.approx(1.5) and wrong.step_seconds == pytest.approx(12.5)
    right = Engine(setup).step(groups, 4, actions=["offload"] * 3 + ["keep"])
    assert right.spill_groups == 1 and right.stall_seconds == 0.0
    assert right.step_seconds == pytest.approx(11.0)


def test_host_tier_bandwidth_is_modelled():
    """A fourth group, kept, saves nothing and computes 5 s forward, so every copy into the
    tier has finished when backward starts at t=8. host_bps 50 B/s: copies in 1.5 -> 3.5 and
    3.5 -> 5.5; at t=8 the plan reads group 2 from the host 8 -> 10, group 1 10 -> 12 (one
    queue) and group 0 from disk 8 -> 10. Group 2 is used at 8.5 and waits 1.5 s (done at
    10.5), group 1 at 11 and waits 1 s (done at 12.5), group 0 at 13, read long since: the step
    is 13.5 s with 2.5 s of stall. An instant host tier: 8 + 3 = 11 s, no stall."""
    groups = [*three(), Span(5.0, 0.0, [])]
    acts = ["offload"] * 3 + ["keep"]
    slow = Engine(Setup(write_bps=100, read_bps=50, host_bytes=256, host_bps=50))
    res = slow.step(groups, 4, actions=acts)
    assert res.spill_groups == 1 and res.host_bytes_written == 200
    assert res.stall_seconds == pytest.approx(2.5) and res.step_seconds == pytest.approx(13.5)
    fast = Engine(Setup(write_bps=100, read_bps=50, host_bytes=256))
    res = fast.step(groups, 4, actions=acts)
    assert res.stall_seconds == 0.0 and res.step_seconds == pytest.approx(11.0)


def test_a_small_tier_spills_more_and_forced_tiers_are_kept():
    res = run(Setup(write_bps=100, read_bps=50, host_bytes=150))
    assert res.spill_groups == 2 and res.ssd_bytes_written == 200 and res.host_bytes_written == 100
    assert run(Setup(host_bytes=1000), ("ssd",) * 3).host_bytes_written == 0
    forced = run(Setup(host_bytes=256), ("host",) * 3)  # the third finds the tier full
    assert forced.host_bytes_written == 200 and forced.ssd_bytes_written == 100


def test_the_tier_is_empty_again_after_the_step():
    engine = Engine(Setup(write_bps=100, read_bps=50, host_bytes=256))
    for _ in range(3):
        res = engine.step(three(), 3, actions=["offload"] * 3)
        assert res.spill_groups == 1 and res.host_bytes_written == 200
    assert engine.host_used == 0


# -- the chooser knows the tier ----------------------------------------------------------------
def costs():
    return [Cost(1.0, 2.0, 400 << 20, input_bytes=1 << 20) for _ in range(4)]


def test_a_host_tier_makes_offload_cheaper_where_the_disk_is_slow():
    groups = costs()
    disk = predict(groups, ("offload",) * 4, 100e6, 100e6, 128 << 20)
    tiered = predict(
        groups, ("offload",) * 4, 100e6, 100e6, 128 << 20, host_bytes=2 << 30, host_bps=50e9
    )
    assert tiered.step_seconds < disk.step_seconds
    assert tiered.step_seconds == pytest.approx(12.0, rel=1e-3)  # 4 x (1 + 2): nothing waits


def test_choose_passes_the_tier_to_every_replay():
    groups = costs()
    budget = 600 << 20
    plain = choose(groups, 100e6, 100e6, budget, exhaustive_blocks=4)
    tiered = choose(
        groups, 100e6, 100e6, budget, exhaustive_blocks=4, host_bytes=2 << 30, host_bps=math.inf
    )
    assert tiered.best.step_seconds <= plain.best.step_seconds
    assert tiered.best.actions.count("offload") >= plain.best.actions.count("offload")
