"""On a real GPU (``gpu`` marker: skipped without CUDA; run by benchmarks/gpu/check.sh):
device-side prefetch on real streams with copies made late on purpose, a bf16 transformer's
gradients bit-identical with and without tba, and SIGKILL during CUDA writes leaving nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tba
from tba.datapath.capture.device import CudaAdapter
from tba.testing import GPT, GPTConfig, random_batch

from .datapath.test_offloader import _spill_bytes_held

pytestmark = pytest.mark.gpu

CFG = GPTConfig(vocab=512, seq=256, hidden=256, heads=4, layers=4)


def grads(model, off, x, y):
    model.zero_grad(set_to_none=True)
    if off is None:
        loss = model(x, y)
    else:
        with off.step(model):
            loss = model(x, y)
            off.synchronize()  # written before backward: every offloaded tensor comes from disk
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


def same(a, b):
    return torch.equal(a[0], b[0]) and all(map(torch.equal, a[1], b[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transformer_gradients_bit_identical(make_offloader, dtype):
    torch.manual_seed(0)
    model = GPT(CFG).cuda().to(dtype)
    x, y = (t.cuda() for t in random_batch(CFG, 4, seed=1))
    want = grads(model, None, x, y)
    off = make_offloader(keep_last=0, staging_bytes="64MiB", prefetch_bytes="32MiB")
    for _ in range(2):  # the second step reuses staging, read buffers and extents
        assert same(grads(model, off, x, y), want)
    st = off.stats()
    assert st["bytes_reloaded"] > 0 and st["sync_loads"] == 0
    assert st["uploads_ahead"] > 0


def test_device_prefetch_on_real_streams_with_late_copies(make_offloader, monkeypatch):
    """Every H2D copy is delayed on the side stream (a GPU sleep queued before it): the
    consumer must wait on each copy's event, or backward reads unfinished bytes."""
    real_upload = CudaAdapter.upload

    def late_upload(self, host, device):
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time ahead of the copy
        return real_upload(self, host, device)

    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    x, y = (t.cuda() for t in random_batch(CFG, 4, seed=2))
    want = grads(model, None, x, y)
    monkeypatch.setattr(CudaAdapter, "upload", late_upload)
    off = make_offloader(keep_last=0, device_prefetch_bytes="256MiB")
    assert same(grads(model, off, x, y), want)
    st = off.stats()
    assert st["uploads_ahead"] > 0 and st["uploads_at_unpack"] == 0
    off0 = make_offloader(keep_last=0, device_prefetch_bytes=0)
    assert same(grads(model, off0, x, y), want)
    assert off0.stats()["uploads_ahead"] == 0 and off0.stats()["uploads_at_unpack"] > 0


def test_staging_wait_on_cuda_holds_the_cap(make_offloader):
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    x, y = (t.cuda() for t in random_batch(CFG, 8, seed=3))
    want = grads(model, None, x, y)
    # the largest saved tensor (fc1's output, 8 x 256 x 1024 fp32) is 8 MiB: two fit
    off = make_offloader(
        keep_last=0, staging_bytes="16MiB", staging_full="wait", max_write_bps="100MB/s"
    )
    assert same(grads(model, off, x, y), want)
    st = off.stats()
    assert "staging_full" not in st["kept_reasons"] and st["pack_stall_seconds"] > 0


KILLED = textwrap.dedent(
    """
    import sys, torch, tba
    off = tba.Offloader(tba.Config(spill_dir=sys.argv[1], min_offload_bytes=1,
                                   min_free_bytes=0, slab_bytes="64MiB", max_write_bps="4MB/s",
                                   host_bytes=0, environ={}))  # the disk, not the host tier
    xs = [torch.randn(1 << 20, device="cuda", requires_grad=True) for _ in range(16)]
    with off.step():
        loss = sum((x.exp() * x).sum() for x in xs)
        torch.cuda.synchronize()
        print("READY", flush=True)  # writes capped at 4 MB/s: most still in flight
        sys.stdin.read()
    """
)


def test_sigkill_during_cuda_writes_leaves_nothing(spill_dir, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, str(script), spill_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().startswith("READY")
        held = _spill_bytes_held(proc.pid, spill_dir)
        assert held >= 16 << 20
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    assert [os.path.join(r, f) for r, _, fs in os.walk(spill_dir) for f in fs] == []
    off = tba.Offloader(tba.Config(spill_dir=spill_dir, min_free_bytes=0, environ={}))
    assert os.listdir(spill_dir) == [os.path.basename(off.backend.spill_path)]
    off.close()
