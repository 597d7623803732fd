"""One clock (tba/host/clock.py): every timer a step reports reads the clock the Offloader was
given. The fake clock here moves a whole second per reading, so a duration measured with it is
a whole number, and one that read any other clock (perf_counter, monotonic) is not."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import tba
from tba.datapath.capture.staging import StagingPool
from tba.testing import GPT, GPTConfig, random_batch, warm_cpu_math


class Seconds:
    """Each reading is one second after the last, from an arbitrary start."""

    def __init__(self, start: float = 1e6) -> None:
        self.now = start
        self.readings = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += 1.0
            self.readings += 1
            return self.now


def timers(value, path=""):
    """(path, seconds) of every measured duration in a stats() dict or a trace record;
    predictions are the simulator's, not measurements."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from timers(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from timers(v, f"{path}[{i}]")
    elif "seconds" in path.rsplit(".", 1)[-1] and "predicted" not in path:
        yield path, value


def whole(seconds: float) -> bool:
    return float(seconds).is_integer()


def run(tmp_path, clock, policy: str, **cfg):
    warm_cpu_math()
    gpt = GPTConfig(layers=2, hidden=64, heads=4, seq=32)
    torch.manual_seed(0)
    model = GPT(gpt)
    x, y = random_batch(gpt, 4)
    trace = tmp_path / f"{policy}.jsonl"
    config = tba.Config(
        environ={},
        spill_dir=str(tmp_path / "spill"),
        backend="posix",
        keep_last=0,
        min_offload_bytes=1,
        coalesce_bytes=0,
        policy=policy,
        trace=str(trace),
        **cfg,
    )
    with tba.Offloader(config, clock=clock) as off:
        stats = []
        for _ in range(3):
            with off.step(model):
                loss = model(x, y)
            loss.backward()
            off.synchronize()
            stats.append(off.stats())
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return stats, [r for r in records if r["type"] == "group"]


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_a_fake_clock_drives_every_timer(tmp_path, policy):
    clock = Seconds()
    stats, groups = run(tmp_path, clock, policy)
    assert clock.readings > 0
    measured = [t for s in stats for t in timers(s)] + [t for g in groups for t in timers(g)]
    assert measured and all(whole(v) for _, v in measured), [t for t in measured if not whole(t[1])]
    # Every kind of timer was moved by it, not merely left at zero.
    last = stats[-1]
    assert last["forward_seconds"] > 0
    # A stall happens only when backward outruns a read, which this test leaves to the machine:
    # when one does, it is a whole number above; test_unpack's gated read makes one happen.
    for key in ("fwd_seconds", "bwd_seconds", "pack_seconds", "unpack_seconds"):
        assert any(g[key] > 0 for g in groups), key
    if policy == "recompute":
        assert any(g["recompute_seconds"] > 0 for g in groups)
    else:
        assert any(g["write_seconds"] > 0 for g in groups)
        assert any(g["read_seconds"] > 0 for g in groups)
    if policy == "auto":
        assert last["policy_decision"]["decision_seconds"] > 0


def test_the_staging_deadline_is_on_the_same_clock():
    """TBA_STAGING_FULL=wait's deadline: once the clock is past it, no wait starts (the old
    deadline read time.monotonic and would have waited the full timeout for real)."""
    clock = Seconds()
    pool = StagingPool(torch.empty(1 << 20, dtype=torch.uint8), 4096)
    waits = []
    pool.wait_freed = lambda seen, timeout: waits.append(timeout) or False
    lock = threading.RLock()
    with lock:
        got, waited = pool.wait_for(lambda: None, pool.frees, 0.5, lock, clock)
    assert (got, waited, waits) == (None, 0.0, [])
    with lock:
        got, waited = pool.wait_for(lambda: None, pool.frees, 2.5, lock, clock)
    assert got is None and waits == [1.5] and waited == 1.0


# -- the device clock (NOTE [Device clock] in tba/host/clock.py) ---------------------------------
# The fake CUDA's device clock moves only as queued work runs (tests/_fake_cuda.py): each mark on
# the consumer stream stands for KERNEL_MS of kernels queued before it. Its figures are thus
# multiples of KERNEL_MS, below a second, while the host clock (Seconds) moves whole seconds.

KERNEL_MS = 0.25
CPU = torch.device("cpu")


def on_device_clock(x: float) -> bool:
    ticks = x / (KERNEL_MS / 1000)
    return x < 1.0 and abs(ticks - round(ticks)) < 1e-6


def device_run(tmp_path, policy, steps, between=None, **cfg):
    """``steps`` steps of a tiny GPT under ``policy``, timed by a fake device; ``between(i,
    fake, clock, seen)`` after step i's backward (the device catches up there unless it
    returns False). Returns the
    Offloader's records as the controllers got them, the fake, the clock and the gradients."""
    from tba.datapath import offloader as offloader_mod
    from tba.datapath.capture.device import DeviceClock

    from .._fake_cuda import FakeCuda

    warm_cpu_math()
    gpt = GPTConfig(layers=3, hidden=64, heads=4, seq=32)
    torch.manual_seed(0)
    model = GPT(gpt)
    x, y = random_batch(gpt, 4)
    fake = FakeCuda(kernel_ms=KERNEL_MS)
    clock = DeviceClock(CPU, cuda=fake)
    config = tba.Config(
        environ={},
        spill_dir=str(tmp_path / "spill"),
        backend="posix",
        min_offload_bytes=1,
        policy=policy,
        **cfg,
    )
    seen = {"adapt": [], "policy": []}
    real_adapt = offloader_mod.adapt

    def adapt(keeper, depth, index, records, *a, **kw):
        seen["adapt"].append((index, records))
        return real_adapt(keeper, depth, index, records, *a, **kw)

    grads = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offloader_mod, "adapt", adapt)
        with tba.Offloader(config, clock=Seconds()) as off:
            off.io.timelines[CPU] = clock  # the model's device: timed by the fake's events
            real_observe = off.policy.observe

            def observe(index, records, *a, **kw):
                seen["policy"].append((index, records))
                return real_observe(index, records, *a, **kw)

            off.policy.observe = observe
            for i in range(steps):
                model.zero_grad(set_to_none=True)
                with off.step(model):
                    loss = model(x, y)
                loss.backward()
                off.synchronize()
                grads.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
                if between is None or between(i, fake, clock, seen) is not False:
                    fake.catch_up()
            seen["stats"] = off.stats()
    return seen, fake, clock, grads


@pytest.mark.parametrize("policy", ["auto", "recompute"])
def test_the_controllers_get_the_device_figures(tmp_path, policy):
    seen, fake, _, _ = device_run(tmp_path, policy, 4)
    assert [i for i, _ in seen["policy"]] == [1, 2, 3, 4] == [i for i, _ in seen["adapt"]]
    timed = 0
    for _, records in seen["policy"] + seen["adapt"]:
        for r in records:
            for key in ("fwd_seconds", "bwd_seconds", "recompute_seconds"):
                assert on_device_clock(r[key]), (key, r)
                timed += r[key] > 0
    assert timed  # not merely left at zero
    if policy == "recompute":
        assert any(r["recompute_seconds"] > 0 for _, rs in seen["policy"] for r in rs)
    st = seen["stats"]
    assert on_device_clock(st["forward_seconds"]) and st["forward_seconds"] > 0
    if policy == "auto":
        # its prediction is of device seconds too (whole seconds per block on the host clock)
        assert st["policy_decision"]["predicted_step_seconds"] < 1.0
    # host durations (the hooks' own time) stay on the host clock: whole seconds
    assert all(whole(r["pack_seconds"]) for _, rs in seen["policy"] for r in rs)
    assert fake.elapsed_reads > 0


def test_no_host_wait_in_a_step_and_a_step_is_seen_once_its_marks_passed(tmp_path):
    """The device lags: step 1's marks have not passed when step 2 starts, so the controllers
    do not see it then (an early read would raise in the fake); once the device caught up, the
    next step's start shows them steps 1 and 2, in order. No host wait on a timing event or a
    stream happens in any step, nor at close (its marks had passed)."""
    syncs_at, observed_at = [], []

    def between(i, fake, clock, seen):
        syncs_at.append(list(fake.syncs))
        observed_at.append([j for j, _ in seen["policy"]])
        return i >= 1  # the device stays behind after step 1, catches up after step 2

    seen, fake, _, _ = device_run(tmp_path, "auto", 3, between=between)
    assert syncs_at == [[], [], []] and fake.syncs == []
    # after step 1: nothing; after step 2 (step 1 still pending at its start): nothing; step
    # 3's start saw 1 and 2; closing saw 3
    assert observed_at == [[], [], [1, 2]]
    assert [i for i, _ in seen["policy"]] == [1, 2, 3]


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_the_marks_are_reused_from_step_to_step(tmp_path, policy):
    """A fixed policy, so every step marks the same points (auto may change its choice on the
    host's timing, and a step with a recomputed block more marks one more pair)."""
    made = []
    device_run(tmp_path, policy, 6, between=lambda i, fake, clock, seen: made.append(clock.made))
    assert made[0] > 0 and made[2:] == [made[2]] * 4, made  # steady: no event made per step


def test_the_device_clock_changes_no_result(tmp_path):
    _, _, _, on_device = device_run(tmp_path / "d", "auto", 3)
    warm_cpu_math()
    gpt = GPTConfig(layers=3, hidden=64, heads=4, seq=32)
    torch.manual_seed(0)
    model = GPT(gpt)
    x, y = random_batch(gpt, 4)
    config = tba.Config(
        environ={},
        spill_dir=str(tmp_path / "h"),
        backend="posix",
        min_offload_bytes=1,
        policy="auto",
    )
    with tba.Offloader(config, clock=Seconds()) as off:
        for i in range(3):
            model.zero_grad(set_to_none=True)
            with off.step(model):
                loss = model(x, y)
            loss.backward()
            off.synchronize()
            got = [loss.detach(), *(p.grad for p in model.parameters())]
            assert all(map(torch.equal, got, on_device[i])), i


def test_copies_are_timed_by_the_device_without_a_wait():
    """NOTE [Copy timing]: each copy's seconds come from its start and end events, read once the
    copy is known done; nothing waits for them."""
    from tba.datapath.capture.device import CudaAdapter

    from .._fake_cuda import FakeCuda

    fake = FakeCuda(copy_ms=2.0)
    adapter = CudaAdapter(
        CPU, cuda=fake, copy=fake.copy, pin=False, record_stream=fake.record_stream
    )
    src, dst = torch.ones(1024), torch.zeros(1024)
    ticket = adapter.capture(dst, src)
    assert not ticket.done() and adapter.take_copies() == []  # not run: not read
    fake.catch_up()
    assert ticket.done()
    assert adapter.take_copies() == [(True, 4096, 0.002)]
    host = torch.ones(512, dtype=torch.uint8)
    up = adapter.upload(host, CPU)
    adapter.hand_out(up)
    fake.catch_up()
    adapter._prune()
    assert adapter.take_copies() == [(False, 512, 0.002)]
    assert fake.syncs == []
    # the start events serve again: a second capture makes none
    before = len(fake.events)
    adapter.capture(torch.zeros(8), torch.ones(8))
    assert len(fake.events) == before


@pytest.mark.gpu
def test_on_a_gpu_a_block_is_timed_by_the_kernels_it_ran(tmp_path):
    """A block whose forward queues a long GPU sleep: on the device clock its forward takes
    about the sleep, though the host queued it in microseconds; the trace says ``device``.
    Step 1 is not judged: the device idles while the host loads kernels and pins staging
    (seen on an H200: a plain block's forward read 55 ms there), and the device clock counts
    that idle time, as it should."""
    gpt = GPTConfig(vocab=512, seq=128, hidden=128, heads=4, layers=3)
    torch.manual_seed(0)
    model = GPT(gpt).cuda()
    x, y = (t.cuda() for t in random_batch(gpt, 2))
    model(x, y).backward()  # the kernels loaded before any step is timed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    sleep_s = start.elapsed_time(end) / 1000
    model.blocks[1].register_forward_hook(lambda *a: torch.cuda._sleep(50_000_000))
    trace = tmp_path / "t.jsonl"
    config = tba.Config(
        environ={}, spill_dir=str(tmp_path / "spill"), policy="auto", trace=str(trace)
    )
    with tba.Offloader(config) as off:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with off.step(model):
                loss = model(x, y)
            loss.backward()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert steps and all(r["clock"] == "device" for r in steps)
    judged = [r for r in records if r["type"] == "group" and r["step"] > 1]
    assert {r["group"] for r in judged} >= {3}, judged
    for r in judged:
        if r["group"] == 3:  # block 1
            assert r["fwd_seconds"] >= 0.8 * sleep_s, (r["fwd_seconds"], sleep_s)
        else:
            assert r["fwd_seconds"] < 0.5 * sleep_s, r


def test_the_copies_bound_the_bandwidth_the_controllers_get(make_offloader, monkeypatch):
    """NOTE [Copy timing]: with each device copy taking a (fake) device second, the write
    bandwidth adaptive keep is given is the copies' (bytes per device second), not the disk's,
    which is faster by far."""
    from tba.datapath import offloader as offloader_mod

    from .._fake_cuda import FakeCuda
    from .test_device import offloader_with_fake_cuda

    got = []
    real_adapt = offloader_mod.adapt

    def adapt(keeper, depth, index, records, w, r, *a, **kw):
        got.append(w)
        return real_adapt(keeper, depth, index, records, w, r, *a, **kw)

    monkeypatch.setattr(offloader_mod, "adapt", adapt)
    fake = FakeCuda(copy_ms=1000.0)
    off = offloader_with_fake_cuda(make_offloader, fake, keep_last=0)
    w = torch.randn(1 << 16, requires_grad=True)
    x = torch.randn(1 << 16)
    for _ in range(3):
        with off.step():
            loss = (x.exp() * w).sum()  # saves exp(x), 256 KiB
        # written before backward runs: a capture still copying when backward has used the
        # tensor is dropped unwritten, and a step without a write measures no bandwidth
        off.synchronize()
        loss.backward()
        off.synchronize()
    st = off.stats()
    assert st["bytes_offloaded"] == 1 << 18  # the last step's tensor was written
    assert 0 < st["d2h_bps"] <= (1 << 18) * 1.001  # at most one 256 KiB copy per device second
    assert got and all(g == pytest.approx(st["d2h_bps"]) for g in got)  # each step's copies
