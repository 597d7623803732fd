"""NOTE [Device prefetch]: read-backs are copied to the device ahead of their unpack, in the
plan's order, within TBA_DEVICE_PREFETCH_BYTES; the unpack makes the consumer wait on the copy.

The "device" is the CPU behind the CUDA adapter over the fake CUDA of tests/_fake_cuda.py: each
H2D copy runs only when something waits for its event, and the consumer stream is eager (the
test's CPU kernels use an unpacked tensor at once). So an unpack that returned the buffer
without making the consumer wait hands autograd zeros, and the gradients differ.
"""

from __future__ import annotations

import pytest
import torch

import tba.datapath.capture.device as device_mod

from .._fake_cuda import FakeCuda
from .test_device import offloader_with_fake_cuda

N = 4
NUMEL = 1 << 18  # 1 MiB of float32: one stand-alone entry each, coalescing or not


def run(off, xs):
    """Saves exp(x) for each x (gone once the forward ends); returns w's gradient."""
    w = torch.ones(NUMEL, requires_grad=True)
    if off is None:
        loss = sum((x.exp() * w).sum() for x in xs)
    else:
        with off.step():
            loss = sum((x.exp() * w).sum() for x in xs)
            off.synchronize()  # written before the forward ends: backward reads from disk
        off.synchronize()  # the prefetched reads landed
    loss.backward()
    return w.grad


@pytest.fixture
def xs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(NUMEL, generator=g) for _ in range(N)]


def traced(make_offloader, **kw):
    """An offloader over the fake CUDA whose log also says, per entry, when its upload was
    issued and when its unpack asked for its bytes."""
    fake = FakeCuda()
    off = offloader_with_fake_cuda(make_offloader, fake, **kw)
    adapter = off.io.device(torch.device("cpu"))[0]
    real_upload, real_bytes = adapter.upload, off.reader._bytes_for

    def upload(host, device):
        fake.log.append(("upload", host.data_ptr(), off.prefetcher.device.inflight))
        return real_upload(host, device)

    def bytes_for(e):
        fake.log.append(("unpack", None if e.host is None else e.host.data_ptr()))
        return real_bytes(e)

    adapter.upload = upload
    off.reader._bytes_for = bytes_for
    return off, fake


def test_h2d_copies_are_issued_before_their_unpack_and_gradients_are_exact(make_offloader, xs):
    want = run(None, xs)
    off, fake = traced(make_offloader, device_prefetch_bytes="64MiB")
    assert torch.equal(run(off, xs), want)
    st = off.stats()
    assert st["bytes_reloaded"] == N * NUMEL * 4 and st["forwarded"] == 0
    assert st["uploads_ahead"] == N and st["uploads_at_unpack"] == 0
    uploads = [e[1] for e in fake.log if e[0] == "upload"]
    unpacks = [e[1] for e in fake.log if e[0] == "unpack"]
    assert len(uploads) == N and uploads == unpacks  # in the plan's (backward's) order
    first_unpack = next(i for i, e in enumerate(fake.log) if e[0] == "unpack")
    assert all(
        fake.log.index(("upload", p, i)) < first_unpack
        for p, i in ((e[1], e[2]) for e in fake.log if e[0] == "upload")
    )
    # each unpack made the consumer stream wait on its copy's event, issued on the side stream
    copies = [ev for ev in fake.events if ev.stream is not None and ev.stream.name == "side0"]
    waited = {e[2] for e in fake.log if e[0] == "wait_event" and e[1] == "default"}
    assert sum(ev.id in waited for ev in copies) == N


def test_without_the_window_each_copy_waits_for_its_unpack(make_offloader, xs):
    want = run(None, xs)
    off, fake = traced(make_offloader, device_prefetch_bytes=0)
    assert torch.equal(run(off, xs), want)
    st = off.stats()
    assert st["uploads_ahead"] == 0 and st["uploads_at_unpack"] == N
    kinds = [e[0] for e in fake.log if e[0] in ("upload", "unpack")]
    assert kinds == ["unpack", "upload"] * N


def test_the_window_holds_one_entry_at_a_time_when_small(make_offloader, xs):
    want = run(None, xs)
    off, fake = traced(make_offloader, device_prefetch_bytes=1)  # always one entry
    assert torch.equal(run(off, xs), want)
    ups = [e for e in fake.log if e[0] == "upload"]
    assert len(ups) == N and all(inflight == 0 for _, _, inflight in ups)
    assert off.stats()["uploads_ahead"] == N
    kinds = [e[0] for e in fake.log if e[0] in ("upload", "unpack")]
    assert kinds == ["upload"] + ["unpack", "upload"] * (N - 1) + ["unpack"]
    assert off.prefetcher.device.inflight == 0  # every use gave its bytes back


def test_a_hand_out_without_the_consumer_wait_gives_stale_bytes(make_offloader, xs, monkeypatch):
    """The check above has teeth: the same run with the consumer's wait removed is wrong."""
    want = run(None, xs)

    def no_wait(self, got):
        return got.buf

    monkeypatch.setattr(device_mod.CudaAdapter, "hand_out", no_wait)
    off, _ = traced(make_offloader, device_prefetch_bytes="64MiB")
    assert not torch.equal(run(off, xs), want)
