"""Smoke runs of examples/, as a user would launch them, with tiny sizes: each must train and
offload something."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from ._frameworks import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TINY = ["--seq", "32", "--hidden", "32", "--layers", "2"]


def summaries_in(stdout: str) -> list[dict]:
    """The JSON summary each process prints last (torchrun's ranks share one stdout, so search
    anywhere in it rather than line by line)."""
    decoder = json.JSONDecoder()
    return [
        decoder.raw_decode(stdout, m.start())[0] for m in re.finditer(r'\{"(rank|losses)"', stdout)
    ]


def run(argv: list[str], tmp_path, env: dict | None = None) -> list[dict]:
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TBA_")},
        "PYTHONPATH": ROOT,
        "MASTER_PORT": str(free_port()),
        "HF_HUB_OFFLINE": "1",
        "TBA_SPILL_DIR": str(tmp_path / "spill"),
        "TBA_MIN_OFFLOAD_BYTES": "1",  # tiny sizes: offload every size
        "TBA_KEEP_LAST": "0",  # and keep no block resident, so that everything is read back
        **(env or {}),
    }
    proc = subprocess.run(
        argv, cwd=str(tmp_path), env=full_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = summaries_in(proc.stdout)
    assert summaries, proc.stdout[-3000:]
    for s in summaries:
        assert s["offload"] and s["bytes_offloaded"] > 0, s
        assert s["losses"] and all(math.isfinite(x) for x in s["losses"]), s
    return summaries


def example(name: str) -> str:
    return os.path.join(EXAMPLES, name)


def test_plain_loop(tmp_path):
    run([sys.executable, example("plain_loop.py"), "--steps", "2", "--batch", "2", *TINY], tmp_path)


def test_deepspeed(tmp_path):
    from tba.integrations.deepspeed import resolve_config

    with open(example("ds_config.json")) as f:
        ds_config = json.load(f)
    resolve_config(ds_config)  # the shipped config is valid as it stands
    ds_config["activation_offload"].update(min_offload_bytes=1, keep_last=0)  # as in run()
    cfg_path = tmp_path / "ds_config.json"
    cfg_path.write_text(json.dumps(ds_config))
    argv = [sys.executable, example("deepspeed_train.py"), "--deepspeed_config", str(cfg_path)]
    argv += ["--nvme-path", str(tmp_path / "nvme"), "--steps", "4", *TINY]
    (s,) = run(argv, tmp_path)
    assert s["spill_path"].startswith(str(tmp_path / "nvme" / "activation_offload" / "rank0"))
    assert s["io_depth"] == ds_config["aio"]["queue_depth"]


def test_megatron(tmp_path):
    argv = [sys.executable, example("megatron_gpt.py"), "--tba-activation-offload"]
    argv += ["--tba-spill-dir", str(tmp_path / "mg"), "--tba-keep-last", "0"]
    argv += ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32"]
    argv += ["--micro-batch-size", "2", "--train-iters", "2"]
    (s,) = run(argv, tmp_path)
    assert s["spill_path"].startswith(str(tmp_path / "mg")) and s["keep_last"] == 0


def test_hf_trainer(tmp_path):
    run([sys.executable, example("hf_trainer.py"), "--steps", "2", "--batch", "2", *TINY], tmp_path)


def test_accelerate_loop(tmp_path):
    argv = [sys.executable, example("accelerate_loop.py"), "--steps", "2", "--batch", "2", *TINY]
    (s,) = run(argv, tmp_path)
    assert s["steps"] == 2  # one tba step per forward


def test_trl_sft_lora(tmp_path):
    argv = [sys.executable, example("trl_sft_lora.py"), "--steps", "1", "--batch", "2"]
    run([*argv, "--hidden", "32", "--layers", "2"], tmp_path)


def test_torchrun(tmp_path):
    argv = [example("torchrun.sh"), "--steps", "2", "--batch", "2", *TINY]
    out = run(argv, tmp_path, env={"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert sorted(s["rank"] for s in out) == [0, 1], out
    assert out[0]["spill_path"] != out[1]["spill_path"]


def test_relay_llama(tmp_path):
    argv = [sys.executable, example("relay_llama.py"), "--steps", "2", "--batch", "4", *TINY]
    (s,) = run(argv, tmp_path)
    assert s["eps"] == "ssd" and s["stash"] == "ssd"
    assert s["weight_bytes_moved"] == 2 * s["param_bytes"]  # each layer's weights, twice a step
