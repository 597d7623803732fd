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
    assert "relay_bench       ok" in text
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
    assert "overhead          ok" in text
    assert "bench_overhead:\n  launch: 16 blocks\n  mode  step ms  vs none\n  none  10.00" in text
    assert "  keep  11.00  1.100" in text
    assert json.loads((tmp_path / "check.json").read_text())["overhead"] == table


def test_a_step_with_no_time_left_is_listed_as_not_run(tmp_path, monkeypatch):
    (tmp_path / "steps.jsonl").write_text(
        '{"step": "bench", "rc": 0, "seconds": 80, "timed_out": false}\n'
        '{"step": "cpu_suite", "rc": 0, "seconds": 0, "timed_out": false, "skipped": true}\n'
    )
    monkeypatch.setattr("sys.argv", ["summarize.py", str(tmp_path), "0", "530"])
    assert summarize.main() == 0  # what did run passed
    text = (tmp_path / "summary.txt").read_text()
    assert "  bench             ok" in text and "  cpu_suite         not run" in text
    assert "too little of BUDGET_S was left to start the step" in text


def test_the_budget_bounds_every_step(tmp_path):
    """With less budget than a step needs, no step starts (none runs unbounded, as `timeout 0`
    would) and the check still writes its summary."""
    env_budget = {"BUDGET_S": "12"}
    got = _check(tmp_path, sys.executable, "--dry", env=env_budget)
    assert got.returncode == 0, got.stdout + got.stderr
    text = (tmp_path / "out" / "summary.txt").read_text()
    steps = [ln.split() for ln in text.splitlines()[1:] if ln.startswith("  ") and " s" in ln]
    assert steps and all(s[1:3] == ["not", "run"] for s in steps[:-1]), text
    assert not (tmp_path / "out" / "gpu_tests.txt").exists()


def test_the_gpu_steps_run_most_telling_first():
    """The order a short budget relies on: the GPU tests, the main table and the overhead
    table before the kvikio steps, the long sequence, the relay and the CPU suite."""
    import re

    text = (ROOT / "benchmarks" / "gpu" / "check.sh").read_text()
    gpu_part = text[text.index("    run install ") :]
    order = re.findall(r"^\s+run (\w+) ", gpu_part, re.M)
    assert order[:4] == ["install", "kvikio_install", "torchtune_install", "gpu_tests"]
    assert order[4:7] == ["bench", "overhead", "kvikio_mode"]
    assert order[-1] == "cpu_suite"
    assert re.search(r"BUDGET_S=\$\{BUDGET_S:-(\d+)\}", text)[1] == "540"


def _check(tmp_path, python, *args, env=None):
    env = {**os.environ, "PYTHON": str(python), "OUT_DIR": str(tmp_path / "out"), **(env or {})}
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


GIB = 1 << 30


def _bench_out(seq, **steps):
    """A bench_gpu result: step seconds per mode (override with ``steps``), activation peaks
    in GiB, auto's predictions; torchtune not run."""
    step = {
        "none": 0.110,
        "checkpoint": 0.150,
        "save_on_cpu": 0.300,
        "tba": 0.113,
        "auto@0.5": 0.118,
        "auto@0.35": 0.140,
        "recompute": 0.148,
        "selective": 0.135,
        **steps,
    }
    peak = {
        "none": 20,
        "checkpoint": 3,
        "save_on_cpu": 4,
        "tba": 3.5,
        "auto@0.5": 10,
        "auto@0.35": 7,
        "recompute": 3,
        "selective": 6,
    }
    modes = {}
    for m, t in step.items():
        modes[m] = {
            "step_seconds": t,
            "step_ratio": t / step["none"],
            "activation_peak": int(peak[m] * GIB),
            "bit_exact": True,
        }
    modes["auto@0.5"].update(predicted_step_seconds=0.125, prediction_error=0.125 / 0.118 - 1)
    modes["auto@0.35"].update(predicted_step_seconds=0.2, prediction_error=0.2 / 0.14 - 1)
    modes["torchtune"] = {"not_run": "torchtune not importable (ModuleNotFoundError: x)"}
    out = {
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "dry": False,
        "backend": "native",
        "model": {
            "params": 850_000_000,
            "layers": 16,
            "hidden": 2048,
            "seq": seq,
            "batch": 1,
            "dtype": "bfloat16",
        },
        "budget_base": {"activation_peak": 20 * GIB, "from": "none"},
        "warmup": 3,
        "steps": 5,
        "exactness": {"deterministic_control": True},
        "modes": modes,
    }
    bench = _load("bench_gpu")
    out["acceptance"] = bench.acceptance(out)
    return out


def test_the_targets_are_judged_from_the_figures():
    got = {t["target"]: t for t in _bench_out(4096)["acceptance"]}
    bench = _load("bench_gpu")
    assert list(got) == list(bench.TARGETS)
    ok = {k: v["ok"] for k, v in got.items()}
    t = bench.TARGETS
    assert ok[t[0]] is True  # 1.027x none, 3.5 GiB < save_on_cpu's 4
    assert ok[t[1]] is True and got[t[1]]["detail"] == "0.987x checkpoint"
    assert ok[t[2]] is True and ok[t[3]] is True  # 1.073x none; 0.933x checkpoint
    # tba at 3.5 GiB (<= 4) and recompute at 3 run faster than save_on_cpu; the fastest named
    assert ok[t[4]] is True and got[t[4]]["detail"] == "tba: 0.377x save_on_cpu's step"
    assert ok[t[5]] is None and "torchtune not importable" in got[t[5]]["detail"]
    assert ok[t[6]] is True and "(+6%)" in got[t[6]]["detail"]
    assert ok[t[7]] is False and "predicted 0.200 s, measured 0.140 s (+43%)" in got[t[7]]["detail"]


def test_a_target_missed_fails():
    got = _bench_out(4096, tba=0.120, recompute=0.151, **{"auto@0.35": 0.16})["acceptance"]
    bench = _load("bench_gpu")
    by = {t["target"]: t["ok"] for t in got}
    assert by[bench.TARGETS[0]] is False  # 1.09x none
    assert by[bench.TARGETS[1]] is False  # 1.007x checkpoint
    assert by[bench.TARGETS[3]] is False  # slower than checkpoint


def test_the_summary_has_one_table_of_the_targets(tmp_path, monkeypatch):
    import json

    (tmp_path / "steps.jsonl").write_text(
        '{"step": "bench", "rc": 0, "seconds": 90, "timed_out": false}\n'
        '{"step": "bench_long", "rc": 0, "seconds": 100, "timed_out": false}\n'
    )
    (tmp_path / "bench.json").write_text(json.dumps(_bench_out(4096)))
    (tmp_path / "bench_long.json").write_text(json.dumps(_bench_out(16384, tba=0.2)))
    monkeypatch.setattr("sys.argv", ["summarize.py", str(tmp_path), "0", "190"])
    assert summarize.main() == 0
    text = (tmp_path / "summary.txt").read_text()
    assert "bench_gpu (seq 4096):" in text and "bench_gpu (seq 16384):" in text
    assert text.count("targets (issue 40)") == 1  # one table, a column per run
    assert "targets (issue 40): seq 4096 | seq 16384" in text
    table = text[text.index("targets (issue 40)") :]
    assert "      seq 4096: pass 1.027x none; peak 3.50 vs 4.00 GiB" in table
    assert "      seq 16384: FAIL 1.818x none; peak 3.50 vs 4.00 GiB" in table
    assert "  torchtune   not run: torchtune not importable" in text


def test_torchtune_that_does_not_import_is_a_reason_not_a_stand_in(monkeypatch):
    bench = _load("bench_gpu")
    monkeypatch.setitem(sys.modules, "torchtune", None)  # import torchtune raises
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    mode = bench.torchtune_mode()
    assert mode.ctx is None and mode.off is None
    assert mode.not_run.startswith("torchtune not importable (")


def test_the_dry_run_runs_every_mode(tmp_path, capsys):
    """On the CPU: every peer and tba mode runs on the tiny model and is exact, save_on_cpu
    says it could not pin, and torchtune (not installed here, or needing CUDA) says why not."""
    import json

    bench = _load("bench_gpu")
    bench.main(["--dry", "--json", str(tmp_path / "b.json")])
    out = json.loads((tmp_path / "b.json").read_text())
    assert list(out["modes"]) == list(bench.MODES)
    assert out["bit_exact"] is True
    ran = {m: r for m, r in out["modes"].items() if "not_run" not in r}
    assert set(ran) >= set(bench.MODES) - {"torchtune"}
    assert all(r["bit_exact"] is True for r in ran.values())
    assert out["modes"]["save_on_cpu"]["note"] == "pin_memory=False: pinning needs CUDA"
    tt = out["modes"]["torchtune"]
    assert "torchtune" in ran or tt["not_run"].startswith("torchtune ")
    assert "prediction_error" in out["modes"]["auto@0.35"]
    assert [t["target"] for t in out["acceptance"]] == list(bench.TARGETS)
    assert "targets (issue 40) (dry run" in capsys.readouterr().out


def test_the_benchmark_says_which_tier_a_steps_bytes_took():
    spec = importlib.util.spec_from_file_location(
        "bench_gpu", ROOT / "benchmarks" / "gpu" / "bench_gpu.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    st = {"policy": "offload", "keep_last": 2, "host_tier": "on"}
    st.update(host_tier_bytes=420 << 20, ssd_tier_bytes=44 << 20)
    assert bench.decided(st) == "offload, keep_last 2; host tier 420 / ssd 44 MiB"
    assert bench.decided({**st, "host_tier": "off"}) == "offload, keep_last 2"
