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
