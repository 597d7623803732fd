"""SIGKILL mid-write: a training process killed while its writes are in flight (capped at
4 MB/s, so most are still queued or in the kernel). The slabs have no name, so the kernel
frees their blocks with the process; what is left is its empty per-process directory, which
the next Offloader's sweep removes. Measured on the loop filesystem: free blocks and inodes
back to the count before the process started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from .util import sweep

CHILD = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, sys.argv[2])
    import tba
    from tests.faults.util import config, loss_of, make_batch, make_model

    model = make_model()
    off = tba.Offloader(config(sys.argv[1], max_write_bps="4MB/s", coalesce_bytes=0))
    with off.step(model):
        loss = loss_of(model, make_batch(1))  # 8 saved tensors of 1 MiB: 2 s of writes
        usage = off.backend.usage()
        print("READY", json.dumps(usage), flush=True)
        time.sleep(60)
    """
)


def held_by(pid: int, root: str) -> int:
    """Bytes allocated to the files ``pid`` holds open under ``root`` (nameless or not)."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(root + "/"):
                held += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except FileNotFoundError:
            continue
    return held


@pytest.mark.slow
def test_sigkill_mid_write_leaves_no_bytes(loop_ext4, tmp_path):
    fs = loop_ext4
    baseline = fs.baseline()
    script = tmp_path / "killed.py"
    script.write_text(CHILD)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, str(script), fs.root, repo],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), line + proc.stderr.read()
        usage = json.loads(line.split(" ", 1)[1])
        assert usage["slab_bytes"] > 0 and usage["bytes_written"] < 8 << 20, usage  # mid-write
        held = held_by(proc.pid, fs.root)
        assert held >= usage["slab_bytes"], (held, usage)  # preallocated: on the disk now
        assert fs.counts()[0] < baseline[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (left,) = fs.files_under_root()  # the empty per-process directory, and nothing in it
    assert left.endswith(f"-{proc.pid}-rank0"), left
    sweep(fs.root)
    fs.assert_no_bytes_left(baseline)
