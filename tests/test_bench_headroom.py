"""benchmarks/bench_headroom.py's verdict for auto: a trial that ran under the cap but went over
the budget it was given is no fit (its max batch is one where auto kept its bound)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "bench_headroom", ROOT / "benchmarks" / "bench_headroom.py"
)
headroom = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(headroom)
MIB = 1 << 20


def trial(mode, budget, peaks):
    return {
        "mode": mode,
        "budget": None if budget is None else {"budget_bytes": budget * MIB},
        "child": {"tba_steps": [{"peak_with_recompute_bytes": p * MIB} for p in peaks]},
    }


def test_auto_over_its_budget_in_any_step_is_no_fit():
    # the 2026-12-04 run: at 44 auto's peak was 183 MiB in every step against 160 MiB
    assert headroom.over_budget(trial("auto", 160, [183, 183, 183])) == (
        "over its budget in step 1: tba peak 183 MiB > 160 MiB"
    )
    assert "step 3" in headroom.over_budget(trial("auto", 189, [174, 174, 190]))
    assert headroom.over_budget(trial("auto", 189, [174, 174, 174])) == ""


def test_other_modes_and_trials_without_a_budget_are_not_judged_by_one():
    assert headroom.over_budget(trial("tba", 100, [300])) == ""
    assert headroom.over_budget(trial("auto", None, [300])) == ""
