"""TBA_POLICY=auto without a budget (NOTE [Slowdown under auto] in tba/decide/block_policy.py):
the lowest predicted peak within TBA_MAX_SLOWDOWN, every action offered, and no absorbing
state. Controllers are fed measured figures directly."""

from __future__ import annotations

from tba.decide.block_policy import PolicyController
from tba.decide.cadence import Cadence
from tba.decide.chooser import WRITES, predict

from .._core import FakeClock
from .test_chooser import records

MiB = 1 << 20
NO_BUDGET = lambda saved: None  # noqa: E731


def controller(slowdown=1.05, every=5):
    return PolicyController(
        "auto", None, every=every, cadence=Cadence(FakeClock()), max_slowdown=slowdown
    )


def test_fast_disk_frees_memory_within_the_bound():
    ctl = controller()
    ctl.observe(1, records(["offload"] * 6), 20e9, 20e9, NO_BUDGET, 128 * MiB)
    d = ctl.decision
    assert "lowest predicted peak within TBA_MAX_SLOWDOWN=1.05" in d["reason"]
    assert d["predicted_step_seconds"] <= 1.05 * d["predicted_keep_all_seconds"]
    gs, _ = ctl._costs(records(["offload"] * 6))
    keep = predict(gs, ["keep"] * 6, 20e9, 20e9, 128 * MiB)
    assert d["predicted_peak_bytes"] < keep.peak_bytes / 2  # most of it freed
    assert any(a in WRITES for a in d["actions"])


def test_slow_disk_keeps_everything_and_a_looser_bound_recomputes():
    tight = controller()
    tight.observe(1, records(["offload"] * 6), 20e6, 20e6, NO_BUDGET, 128 * MiB)
    assert tight.decision["actions"] == ["keep"] * 6  # nothing else within 5%
    loose = controller(slowdown=1.5)
    loose.observe(1, records(["offload"] * 6), 20e6, 20e6, NO_BUDGET, 128 * MiB)
    acts = loose.decision["actions"]
    assert "recompute" in acts or "selective" in acts  # every action is offered
    assert loose.decision["predicted_peak_bytes"] < tight.decision["predicted_peak_bytes"]


def test_keep_all_is_probed_and_a_faster_disk_is_used():
    ctl = controller(every=5)
    ctl.observe(1, records(["offload"] * 6), 20e6, 20e6, NO_BUDGET, 128 * MiB)
    assert ctl.decision["actions"] == ["keep"] * 6
    probe = None
    for step in range(2, 400):
        ran = [ctl.assignment()[i] for i in range(6)]
        moved = any(a in WRITES for a in ran)
        bw = 20e9 if moved else None  # the disk is fast now; only a step that writes sees it
        ctl.observe(step, records(ran), bw, bw, NO_BUDGET, 128 * MiB)
        if moved and probe is None:
            probe = step
            assert ran == ["offload"] + ["keep"] * 5  # the probe: the first block written
        if probe is not None and step > probe:
            break
    assert probe is not None and probe >= 6
    assert any(a in WRITES for a in ctl.decision["actions"])  # offloads on what it measured


def test_a_measured_overrun_goes_back():
    ctl = controller(every=1000)
    ctl.observe(1, records(["offload"] * 6), 20e9, 20e9, NO_BUDGET, 128 * MiB)
    seen = []
    for step in range(2, 12):
        ran = [ctl.assignment()[i] for i in range(6)]
        writes = sum(a in WRITES for a in ran)
        # what the model does not know: each written block costs backward 0.3 s of stall
        ctl.observe(step, records(ran, stall=0.3 * writes / 13), 20e9, 20e9, NO_BUDGET, 128 * MiB)
        seen.append(ran)
    assert seen[-1] == ["keep"] * 6 or not any(a in WRITES for a in seen[-1])
    assert len(ctl.too_slow) >= 1
