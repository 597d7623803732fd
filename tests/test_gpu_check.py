"""The GPU check: what it says before it starts (benchmarks/gpu/check.sh), and its summary
(benchmarks/gpu/summarize.py): pytest's output read back, whole or cut short by the check's
time limit."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

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


RELAY = {
    "device": "NVIDIA H200",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "dry": False,
    "model": {"layers": 6, "hidden": 512, "seq": 512},
    "micro_batches": 4,
    "micro_batch": 8,
    "warmup": 2,
    "rounds": 10,
    "cpu_threads": 16,
    "modes": {
        "plain": {
            "step_seconds": 0.05,
            "step_ratio": 1.0,
            "step_ratio_paired": 1.0,
            "max_memory_allocated": 1000 << 20,
            "memory_ratio": 1.0,
        },
        "recompute": {
            "step_seconds": 0.08,
            "step_ratio": 1.6,
            "step_ratio_paired": 1.55,
            "max_memory_allocated": 250 << 20,
            "memory_ratio": 0.25,
            "fetch_wait_seconds": 0.001,
            "update_wait_seconds": 0.02,
            "update_seconds": 0.03,
        },
    },
    "depths": {
        "plain": {"4": 700 << 20, "16": 2800 << 20, "spread": 3.0},
        "relay, ssd stash": {"4": 200 << 20, "16": 202 << 20, "spread": 0.01},
    },
    "seconds": 41.5,
}


def test_the_summary_has_the_relay_benchmark(tmp_path, monkeypatch, capsys):
    import json

    (tmp_path / "steps.jsonl").write_text(
        '{"step": "relay_bench", "rc": 0, "seconds": 42, "timed_out": false}\n'
    )
    (tmp_path / "relay_bench.json").write_text(json.dumps(RELAY))
    monkeypatch.setattr("sys.argv", ["summarize.py", str(tmp_path), "0", "42"])
    assert summarize.main() == 0
    text = (tmp_path / "summary.txt").read_text()
    assert "relay_bench     ok" in text
    assert "bench_relay_gpu:\n  NVIDIA H200, torch 2.11.0+cu130 (CUDA 13.0), 16 CPU threads" in text
    assert "  recompute" in text and "1.60" in text and "250.0" in text
    assert "relay, ssd stash: 4: 200.0, 16: 202.0 (max/min - 1 = 1.0%)" in text
    assert json.loads((tmp_path / "check.json").read_text())["relay_bench"]["rounds"] == 10


def test_the_summary_has_the_overhead_tables(tmp_path, monkeypatch):
    import json

    (tmp_path / "steps.jsonl").write_text(
        '{"step": "overhead", "rc": 0, "seconds": 90, "timed_out": false}\n'
    )
    table = "launch: 16 blocks\nmode  step ms  vs none\nnone  10.00  1.000\n\nkeep  11.00  1.100\n"
    (tmp_path / "overhead.txt").write_text(table)
    monkeypatch.setattr("sys.argv", ["summarize.py", str(tmp_path), "0", "90"])
    assert summarize.main() == 0
    text = (tmp_path / "summary.txt").read_text()
    assert "overhead        ok" in text
    assert "bench_overhead:\n  launch: 16 blocks\n  mode  step ms  vs none\n  none  10.00" in text
    assert "  keep  11.00  1.100" in text
    assert json.loads((tmp_path / "check.json").read_text())["overhead"] == table


def _check(tmp_path, python, *args):
    env = {**os.environ, "PYTHON": str(python), "OUT_DIR": str(tmp_path / "out")}
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_python_without_torch_is_named_before_anything_runs(tmp_path):
    bare = tmp_path / "python-without-site"  # this interpreter, without its site-packages
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare.chmod(0o755)
    got = _check(tmp_path, bare)
    assert got.returncode == 2, got.stdout + got.stderr
    assert f"gpu-check: {bare} (Python" in got.stderr and "has no torch" in got.stderr
    assert "No module named 'torch'" in got.stderr
    assert "make gpu-check PYTHON=/path/to/python" in got.stderr
    assert not (tmp_path / "out").exists()  # no step ran


def test_a_missing_interpreter_is_named(tmp_path):
    got = _check(tmp_path, tmp_path / "nowhere" / "python3")
    assert got.returncode == 2 and "is not an executable on this machine" in got.stderr


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this machine has a CUDA device"
)
def test_torch_without_cuda_is_named(tmp_path):
    got = _check(tmp_path, sys.executable)
    assert got.returncode == 2, got.stdout + got.stderr
    assert "but sees no CUDA device" in got.stderr and "PYTHON=" in got.stderr
