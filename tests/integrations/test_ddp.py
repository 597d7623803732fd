"""torchrun, 2 processes, gloo, DDP: exact against no offload, one spill directory per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tba.storage.spilldir import dir_name_pattern

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(script: str, *args: str, nproc: int = 2, env: dict | None = None, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", script, *args]
    full_env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def test_two_ranks_exact_and_separate(tmp_path):
    spill = tmp_path / "spill"
    worker = os.path.join(ROOT, "tests", "integrations", "ddp_worker.py")
    proc = torchrun(worker, str(tmp_path), str(spill))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    pattern = dir_name_pattern()
    for r, out in enumerate(got):
        assert out["rank"] == r and out["config_rank"] == r  # TBA_RANK falls back to $RANK
        assert out["losses"] == out["ref_losses"], f"rank {r}: losses differ from no offload"
        assert out["grads_equal"] and out["params_equal"]
        # backward took them back from disk, or from staging (the read-ahead wanted them while
        # their writes still ran: which one depends on the host's load)
        assert out["bytes_offloaded"] > 0 and out["bytes_reloaded"] + out["forwarded"] > 0
        own = out["spill_dir"]
        m = pattern.match(os.path.basename(own))
        assert m and m.group("rank") == str(r) and os.path.dirname(own) == str(spill)
        # every spill file this rank holds open lies in its own directory
        assert out["open_files"] and all(f.startswith(own + "/") for f in out["open_files"])
        # both ranks' directories existed side by side while training
        assert sorted(os.path.basename(o["spill_dir"]) for o in got) == [
            d for d in out["dirs_seen"] if pattern.match(d)
        ]
        assert not [d for d in out["dirs_after_close"] if pattern.match(d)]
    assert got[0]["spill_dir"] != got[1]["spill_dir"]
    assert got[0]["losses"] != got[1]["losses"]  # different data per rank: a real all-reduce


@pytest.mark.slow
def test_two_ranks_exact_under_block_policies(tmp_path):
    """DDP over 2 ranks (dropout on, its own data per rank) with tba.integrations.wrap under
    Config(policy=recompute / auto) and a forced mixed assignment, one torchrun for the three:
    losses, gradients and weights bit-identical to DDP without tba on each rank, and the blocks
    ran as each policy says (_frameworks.policy_problems)."""
    worker = os.path.join(ROOT, "tests", "integrations", "ddp_worker.py")
    names = ["recompute", "auto", "mixed"]
    proc = torchrun(worker, str(tmp_path), str(tmp_path / "spill"), *names)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in names:
        got = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
        for r, out in enumerate(got):
            where = f"{name}, rank {r}"
            assert out["losses"] == out["ref_losses"] and len(out["losses"]) == 3, where
            assert out["grads_equal"] and out["params_equal"], where
            assert out["problems"] == [], where
        assert got[0]["losses"] != got[1]["losses"]  # different data per rank
