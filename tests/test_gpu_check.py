"""The GPU check's summary (benchmarks/gpu/summarize.py): pytest's output read back, whole or
cut short by the check's time limit."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "gpu_summarize", ROOT / "benchmarks" / "gpu" / "summarize.py"
)
summarize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize)

WHOLE = """\
suite/a.py::test_x PASSED                                                  [  3%]
suite/b.py::test_y[erf] FAILED                                             [  4%]
=========================== short test summary info ============================
FAILED suite/b.py::test_y[erf] - AssertionError
SKIPPED [2] suite/c.py:3: needs a CUDA device
============= 1 failed, 1 passed, 2 skipped in 3.10s =============
"""

QUIET = "..s\n14 skipped, 1593 deselected in 6.21s\n"

# xdist workers with -v, killed by the time limit before pytest's summary
CUT = """\
[gw1] [  3%] PASSED suite/a.py::test_x
[gw0] [  4%] FAILED suite/b.py::test_y[erf]
[gw2] [  5%] SKIPPED suite/c.py::test_z
[gw2] [  6%] ERROR suite/d.py::test_w
"""


def test_a_whole_run_is_read_from_its_summary():
    got = summarize.pytest_result(WHOLE)
    assert got["complete"] and got["counts"] == {"failed": 1, "passed": 1, "skipped": 2}
    assert got["failed"] == ["suite/b.py::test_y[erf]"]
    assert got["skips"] == [{"n": 2, "where": "suite/c.py:3", "why": "needs a CUDA device"}]
    assert summarize.pytest_result(QUIET)["counts"] == {"skipped": 14}


def test_a_run_cut_short_is_counted_from_its_verbose_lines():
    got = summarize.pytest_result(CUT)
    assert not got["complete"]
    assert got["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert got["failed"] == ["suite/b.py::test_y[erf]", "suite/d.py::test_w"]


def _load(name):
    spec = importlib.util.spec_from_file_location(
        f"gpu_{name}", ROOT / "benchmarks" / "gpu" / f"{name}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmark_names_what_auto_decided_and_predicted():
    bench = _load("bench_gpu")
    st = {
        "policy": "auto",
        "keep_last": 14,
        "policy_decision": {
            "actions": ["keep"] * 4 + ["recompute"] * 12,
            "predicted_step_seconds": 0.4307,
            "decision_seconds": 0.27,
        },
    }
    assert bench.decided(st) == (
        "4 keep, 0 offload, 12 recompute (predicted step 0.431 s, decided in 0.27 s)"
    )
    assert bench.decided({"policy": "offload", "keep_last": 3}) == "offload, keep_last 3"
