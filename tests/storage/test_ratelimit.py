"""Bandwidth caps (TBA_MAX_WRITE_BPS / TBA_MAX_READ_BPS, ``set_rate``): NOTE [Rate caps].

The TokenBucket is checked against a fake clock; the backends (posix, buffered, the native
engine in io_uring and threads modes) against the real clock, with streams of about half a
second per direction: the achieved rate must stay within 10% of the cap, callers must never
wait, and caps must come and go at run time. The memory backend records caps and ignores them;
the kvikio backend (on the fake kvikio) shares the posix machinery.
"""

from __future__ import annotations

import errno
import gc
import random
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
from storage_util import empty

import tba.storage.kvikio as kv_mod
from tba.storage import open_backend
from tba.storage.native import NativeBackend, engine_status
from tba.storage.ratelimit import (
    CATCH_UP,
    MIN_BURST,
    TokenBucket,
    check_rate,
    default_burst,
    describe_caps,
    format_rate,
)

STATUS = engine_status()
KIB, MIB, MB = 1 << 10, 1 << 20, 10**6
# Every backend whose I/O a cap holds: "native" is io_uring, "threads" the engine's pool mode.
MODES = [
    "posix",
    "buffered",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not STATUS["io_uring"], reason=f"needs io_uring: {STATUS['io_uring_reason']}"
        ),
    ),
    pytest.param(
        "threads",
        marks=pytest.mark.skipif(not STATUS["built"], reason=f"{STATUS['build_error']}"),
    ),
]


class FakeClock:
    """A monotonic clock the test moves; moving it wakes the bucket's sleepers."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.bucket: TokenBucket | None = None

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        if self.bucket is not None:
            self.bucket.wake()


def fake_bucket(rate: int | None, burst: int | None = None) -> tuple[TokenBucket, FakeClock]:
    clock = FakeClock()
    bucket = TokenBucket(rate, burst, clock=clock)
    clock.bucket = bucket
    return bucket, clock


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# -- TokenBucket, on a fake clock ------------------------------------------------------------
def test_helpers():
    assert default_burst(100 * MB) == 2 * MB  # 20 ms of the rate
    assert default_burst(10 * MB) == MIN_BURST == MIB  # at least 1 MiB
    assert format_rate(300 * MB) == "300 MB/s" and format_rate(1 << 30) == "1.074 GB/s"
    assert format_rate(64_000) == "64 kB/s" and format_rate(512) == "512 B/s"
    assert describe_caps({"write": None, "read": None}) == ""
    assert describe_caps({"write": (300 * MB, 6 * MB), "read": (MB, MIB)}) == (
        "write capped at 300 MB/s (burst 5.7 MiB), read capped at 1 MB/s (burst 1.0 MiB)"
    )
    assert check_rate(None) is None and check_rate(0) is None and check_rate(5) == 5
    for bad in (-1, 1.5, "300MB", True):
        with pytest.raises(ValueError, match="bytes per second"):
            check_rate(bad)


def test_no_cap_never_waits():
    bucket, clock = fake_bucket(None)
    assert bucket.rate is None and bucket.burst is None
    assert bucket.try_acquire(1 << 40) == 0.0 and bucket.acquire(1 << 40) == 0.0
    assert bucket.throttled_seconds == 0.0 and bucket.waiting == 0


def test_rate_and_burst():
    bucket, clock = fake_bucket(1000, burst=4000)
    assert (bucket.rate, bucket.burst) == (1000, 4000)
    assert bucket.try_acquire(4000) == 0.0  # a new cap starts with a full bucket
    assert bucket.try_acquire(1000) == pytest.approx(1.0)
    clock.advance(0.5)
    assert bucket.try_acquire(1000) == pytest.approx(0.5)
    clock.advance(0.5)
    assert bucket.try_acquire(1000) == 0.0
    assert bucket.throttled_seconds == pytest.approx(1.0)  # held from the first refusal
    clock.advance(100)  # an idle spell fills the bucket up to the burst, no further
    assert bucket.try_acquire(4000) == 0.0
    assert bucket.try_acquire(1) > 0


def test_a_long_op_pays_before_it_goes_and_leaves_no_debt():
    bucket, clock = fake_bucket(1000, burst=1000)
    # 5000 bytes never fit a 1000-byte bucket: while the op waits, the bucket fills to 5000.
    assert bucket.try_acquire(5000) == pytest.approx(4.0)
    clock.advance(3.9)
    assert bucket.try_acquire(5000) == pytest.approx(0.1)
    clock.advance(0.1)
    assert bucket.try_acquire(5000) == 0.0
    # Paid in full before it went: the next op waits for its own bytes only.
    assert bucket.try_acquire(1000) == pytest.approx(1.0)
    clock.advance(1.0)
    assert bucket.try_acquire(1000) == 0.0
    assert bucket.throttled_seconds == pytest.approx(5.0)
    # Once the long op has gone the ceiling is the burst again.
    clock.advance(60)
    assert bucket.try_acquire(1000) == 0.0 and bucket.try_acquire(1) > 0


def test_bytes_started_stay_within_the_bucket_bound():
    """Over any window of T seconds at most max(burst, longest op) + rate * T bytes start, and
    a backlogged stream runs at the rate."""
    rng = random.Random(7)
    rate, burst = 10_000, 4_000
    bucket, clock = fake_bucket(rate, burst)
    sizes = [rng.choice([100, 1_000, 3_000, 12_000]) for _ in range(400)]
    started: list[tuple[float, int]] = []
    for n in sizes:
        while bucket.try_acquire(n) > 0:
            clock.advance(rng.uniform(0.0001, 0.003))
        started.append((clock.now, n))
    times = [t for t, _ in started]
    sent = [0]
    for _, n in started:
        sent.append(sent[-1] + n)
    # From the start (a full bucket): at most burst + rate * t. Any window: the longest op may
    # stretch the ceiling, and up to CATCH_UP of the rate makes up for late checks.
    t0 = times[0]
    for t, total in zip(times, sent[1:]):
        assert total <= burst + rate * (t - t0) + 1
    slack = max(burst, max(sizes)) + rate * CATCH_UP + 1
    for i in range(len(started)):
        for j in range(i, len(started), 7):
            assert sent[j + 1] - sent[i] <= slack + rate * (times[j] - times[i])
    elapsed = times[-1] - times[0]
    assert sent[-1] / elapsed == pytest.approx(rate, rel=0.1)


def test_set_rate_at_run_time():
    bucket, clock = fake_bucket(1000, burst=1000)
    assert bucket.try_acquire(1000) == 0.0
    assert bucket.try_acquire(1000) == pytest.approx(1.0)
    bucket.set_rate(4000)  # faster: the op already waiting is re-timed
    assert bucket.burst == MIN_BURST
    assert bucket.try_acquire(1000) == pytest.approx(0.25)
    bucket.set_rate(None)  # no cap: goes at once, and its wait is counted
    assert bucket.try_acquire(1000) == 0.0 and bucket.rate is None
    clock.advance(5)
    assert bucket.throttled_seconds == pytest.approx(0.0)
    bucket.set_rate(1000, burst=3000)  # a new cap starts full again
    assert bucket.try_acquire(3000) == 0.0 and bucket.try_acquire(1) > 0
    for bad in (0, -5, 1.0):
        with pytest.raises(ValueError, match="burst"):
            bucket.set_rate(1000, burst=bad)


def test_concurrent_acquires_are_admitted_in_turn():
    bucket, clock = fake_bucket(1000, burst=2000)
    admitted: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        bucket.acquire(1000)
        with lock:
            admitted.append(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(admitted) == 2 and bucket.waiting == 6)  # the full bucket
    for step in range(1, 7):
        time.sleep(0.02)
        assert len(admitted) == 1 + step  # nothing more goes while the clock stands still
        clock.advance(1.0)  # one op's worth of tokens
        assert wait_until(lambda s=step: len(admitted) == 2 + s)
    for t in threads:
        t.join(5)
    assert len(set(admitted)) == 8 and bucket.waiting == 0
    assert bucket.throttled_seconds == pytest.approx(6.0)


def test_many_threads_on_the_real_clock_get_the_rate():
    rate = 20 * MB
    bucket = TokenBucket(rate)  # burst: 1 MiB
    per_thread, n, nthreads = 40, 32 * KIB, 6
    total = per_thread * n * nthreads

    def work() -> None:
        for _ in range(per_thread):
            bucket.acquire(n)

    t0 = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    elapsed = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads)
    # The first MiB (the full bucket) goes at once, the rest at the rate: never faster, whatever
    # the load. How much slower a busy host makes it is the host's, so the upper bound is loose
    # (about 0.33 s of pacing here; it ran at 1.1x idle).
    paced = (total - MIB) / rate
    assert paced <= elapsed < 4 * paced + 1.0
    # Only the head of the line waiting for tokens counts, never more than the wall time. The
    # hand-off from an admitted op to the next head is not a wait for tokens and goes uncounted:
    # a few hundred microseconds per op when idle, up to a fifth of the run on a loaded CI
    # machine (0.28 of 0.35 s was seen there); tokens that accrue during a slow hand-off shorten
    # the next wait, so a loaded host counts less, not more.
    throttled = bucket.throttled_seconds
    assert 0.3 * paced <= throttled <= elapsed


@pytest.mark.parametrize("release", ["drain", "uncap"])
def test_drain_and_removing_the_cap_release_waiters(release):
    bucket, clock = fake_bucket(1000, burst=1000)
    done = threading.Event()
    t = threading.Thread(target=lambda: (bucket.acquire(10**9), done.set()))
    t.start()
    assert wait_until(lambda: bucket.waiting == 1)
    assert not done.wait(0.05)
    if release == "drain":
        bucket.drain()
        assert bucket.acquire(10**9) == 0.0  # and stays lifted
    else:
        bucket.set_rate(None)
    assert done.wait(2)
    t.join(2)
    assert bucket.waiting == 0


# -- backends ----------------------------------------------------------------------------------
@pytest.fixture
def open_capped(make_cfg):
    """open(mode, **cfg): a backend of that mode with 64 MiB slabs; all closed at teardown."""
    made = []

    def make(mode: str, **changes):
        changes.setdefault("slab_bytes", "64MiB")
        changes.setdefault("io_depth", 16)
        if mode in ("native", "threads"):
            cfg = make_cfg(**changes)
            b = NativeBackend(cfg, _setup_errno=errno.EPERM if mode == "threads" else None)
            assert b.kind == ("io_uring" if mode == "native" else "threads")
        else:
            b = open_backend(make_cfg(backend=mode, **changes))
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def quick_filled(nbytes: int) -> memoryview:
    """Like storage_util.filled (aligned, random), three times faster: for tens of MiB."""
    mv = empty(nbytes)
    np.frombuffer(mv, dtype=np.uint8)[:] = np.random.default_rng().integers(
        0, 256, nbytes, dtype=np.uint8
    )
    return mv


def extents(backend, count: int, size: int):
    return [backend.allocate(size) for _ in range(count)]


def stream(backend, op: str, exts, buf: memoryview) -> list[Future]:
    size = exts[0].length
    call = backend.write if op == "write" else backend.read
    return [call(e, buf[i * size : (i + 1) * size]) for i, e in enumerate(exts)]


def finished_at(futures: list[Future]) -> list[float]:
    """Fills with the time the last of ``futures`` completes."""
    left, at, lock = [len(futures)], [], threading.Lock()

    def one(_f: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                at.append(time.monotonic())

    for f in futures:
        f.add_done_callback(one)
    return at


def mixed_stream(b, to_write, to_read, data: memoryview, back: memoryview):
    """Write ``data`` to ``to_write`` and read ``to_read`` into ``back`` at once; returns each
    stream's rate (bytes over the time from its first submission to its last completion), the
    time the submissions took, and the usage before and after."""
    total = len(data)
    before = b.usage()
    gc.collect()  # a full collection with torch loaded stalls every thread for ~100 ms
    t0 = time.monotonic()
    writes = stream(b, "write", to_write, data)
    t1 = time.monotonic()
    reads = stream(b, "read", to_read, back)
    submitted = time.monotonic() - t0
    write_end, read_end = finished_at(writes), finished_at(reads)
    for f in writes + reads:
        f.result()
    assert wait_until(lambda: write_end and read_end)
    rates = {"write": total / (write_end[0] - t0), "read": total / (read_end[0] - t1)}
    return rates, submitted, before, b.usage()


@pytest.mark.parametrize("size", [64 * KIB, MIB, 16 * MIB], ids=["64KiB", "1MiB", "16MiB"])
@pytest.mark.parametrize("mode", MODES)
def test_achieved_rate_is_the_cap(open_capped, mode, size):
    """32 MiB written and 32 MiB read at the same time, each direction capped at 64 MB/s."""
    cap, total = 64 * MB, 32 * MIB
    b = open_capped(mode, max_write_bps=cap, max_read_bps=cap)
    assert "write capped at 64 MB/s (burst 1.2 MiB), read capped at 64 MB/s" in b.reason
    count = total // size
    to_read, to_write = extents(b, count, size), extents(b, count, size)
    data, fresh, back = quick_filled(total), quick_filled(total), empty(total)
    # Uncapped first pass: the filesystem converts fresh (unwritten) blocks on their first write,
    # with stalls of tens of ms that no cap can make up for; measure the cap, not that.
    b.set_rate("write", None)
    for f in stream(b, "write", to_read, data) + stream(b, "write", to_write, data):
        f.result()
    b.set_rate("write", cap)
    for attempt in (1, 2):
        achieved, submitted, before, after = mixed_stream(b, to_write, to_read, fresh, back)
        ratios = {op: round(rate / cap, 3) for op, rate in achieved.items()}
        print(f"{mode} {size >> 10} KiB, attempt {attempt}: {ratios}")
        # Never faster than the cap (the first burst is 4% of the stream) ...
        assert max(ratios.values()) < 1.1, ratios
        # ... and, unless something stalled this process for more than the 100 ms a backlog
        # may make up (this 2-core test host is shared), not slower either: one more try.
        if min(ratios.values()) > 0.9:
            break
    assert min(ratios.values()) > 0.9, ratios
    assert submitted < 0.25  # the callers never waited for tokens (1 s of capped I/O)
    for op in ("write", "read"):
        throttled = after[f"throttle_seconds_{op}"] - before[f"throttle_seconds_{op}"]
        assert 0.6 * total / cap < throttled < 1.2 * total / cap, (op, throttled)
    assert back == data
    b.set_rate("read", None)
    for f in stream(b, "read", to_write, back):
        f.result()
    assert back == fresh  # the bytes written under the cap are the right ones


@pytest.mark.parametrize("mode", MODES)
def test_callers_never_wait_and_lifting_the_cap_releases_the_queue(open_capped, mode):
    b = open_capped(mode, max_write_bps=4 * MB, io_threads=2, io_depth=4)
    exts = extents(b, 32, MIB)
    data = quick_filled(32 * MIB)
    t0 = time.monotonic()
    futs = stream(b, "write", exts, data)  # 8 s of writes at the cap
    assert time.monotonic() - t0 < 0.1
    time.sleep(0.2)
    assert sum(f.done() for f in futs) <= 2  # the 1 MiB burst, and 4 MB/s
    assert b.usage()["throttle_seconds_write"] > 0.1
    t1 = time.monotonic()
    b.set_rate("write", None)
    assert "capped" not in b.reason and b.caps == {"write": None, "read": None}
    for f in futs:
        f.result(timeout=5)
    assert time.monotonic() - t1 < 1.5
    throttled = b.usage()["throttle_seconds_write"]
    time.sleep(0.05)
    assert b.usage()["throttle_seconds_write"] == throttled  # no op waits any more
    back = empty(32 * MIB)
    for f in stream(b, "read", exts, back):
        f.result()
    assert back == data


@pytest.mark.parametrize("mode", MODES)
def test_no_cap_means_no_throttling(open_capped, mode):
    b = open_capped(mode)
    assert "capped" not in b.reason and b.caps == {"write": None, "read": None}
    exts = extents(b, 16, MIB)
    data, back = quick_filled(16 * MIB), empty(16 * MIB)
    for f in stream(b, "write", exts, data):
        f.result()
    for f in stream(b, "read", exts, back):
        f.result()
    assert back == data
    u = b.usage()
    assert u["throttle_seconds_write"] == 0.0 and u["throttle_seconds_read"] == 0.0
    if mode in ("native", "threads"):
        info = b.engine_info()
        assert info["rate_write"] == info["rate_read"] == info["burst_write"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_set_rate_at_run_time_retimes_waiting_ops(open_capped, mode):
    b = open_capped(mode)
    exts = extents(b, 16, MIB)
    data = quick_filled(16 * MIB)
    b.set_rate("write", 20 * MB)  # would take 0.79 s
    assert "write capped at 20 MB/s (burst 1.0 MiB)" in b.reason
    assert b.caps == {"write": 20 * MB, "read": None}
    t0 = time.monotonic()
    futs = stream(b, "write", exts, data)
    time.sleep(0.2)
    assert not all(f.done() for f in futs)
    b.set_rate("write", 200 * MB)  # the rest (about 12 MB) goes in about 0.06 s
    assert "write capped at 200 MB/s (burst 3.8 MiB)" in b.reason
    for f in futs:
        f.result(timeout=5)
    elapsed = time.monotonic() - t0
    assert 0.22 < elapsed < 0.6
    # A long op at a low rate with a tiny burst: paid before it goes, never deadlocked.
    b.set_rate("write", 64 * MB, burst=64 * KIB)
    big, payload = b.allocate(8 * MIB), quick_filled(8 * MIB)
    t0 = time.monotonic()
    b.write(big, payload).result(timeout=5)
    assert 0.98 * (8 * MIB - 64 * KIB) / (64 * MB) < time.monotonic() - t0 < 0.4


@pytest.mark.parametrize("mode", MODES)
def test_close_with_ops_waiting_for_tokens_completes_them(open_capped, mode):
    b = open_capped(mode, io_threads=2, io_depth=4)
    exts = extents(b, 24, MIB)
    data = quick_filled(24 * MIB)
    for f in stream(b, "write", exts[:12], data):
        f.result()
    b.set_rate("write", 4 * MB)
    b.set_rate("read", 4 * MB)
    back = empty(12 * MIB)
    writes = stream(b, "write", exts[12:], data)
    reads = stream(b, "read", exts[:12], back)
    time.sleep(0.1)
    assert not all(f.done() for f in writes + reads)  # 6 s of work at the caps
    t0 = time.monotonic()
    b.close()
    assert time.monotonic() - t0 < 2.0  # close lifts the caps rather than wait them out
    assert all(f.done() and f.exception() is None for f in writes + reads)
    assert back == data[: 12 * MIB]
    u = b.usage()
    assert u["writes"] == 24 and u["reads"] == 12
    assert u["throttle_seconds_write"] > 0 and u["throttle_seconds_read"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_a_held_op_is_released_by_time_alone(open_capped, mode):
    """One op and nothing else in flight: no completion comes to wake the engine's reaper."""
    b = open_capped(mode, max_read_bps=8 * MB)
    ext = b.allocate(2 * MIB)
    b.write(ext, quick_filled(2 * MIB)).result()
    back = empty(2 * MIB)
    t0 = time.monotonic()
    b.read(ext, back).result(timeout=5)
    expected = (2 * MIB - MIB) / (8 * MB)  # 1 MiB more than the full bucket holds
    assert 0.97 * expected < time.monotonic() - t0 < expected + 0.15


@pytest.mark.skipif(not STATUS["io_uring"], reason=f"needs io_uring: {STATUS['io_uring_reason']}")
def test_a_head_paid_for_between_two_clock_readings_is_still_submitted(open_capped):
    """The hang fixed in hold_due (native/tba_engine.c), made to happen on demand. submit()
    reads the clock twice: sq_refill refuses the head for want of tokens, then hold_due asks
    when the reaper must come back for it. Tokens that accrue between the two readings (a
    preempted thread, for real; here each reading of the engine's clock jumps 4 s ahead) leave
    the head paid for with nothing in flight and no completion to come. hold_due once skipped
    it as "waiting for a ring slot": the reaper slept with no timer and the read never ended."""
    b = open_capped("native", max_read_bps=8 * MB)
    ext = b.allocate(2 * MIB)
    data = quick_filled(2 * MIB)
    b.write(ext, data).result(timeout=5)
    b.set_rate("read", 8 * MB, burst=64 * KIB)  # a full bucket cannot pay for the head
    time.sleep(0.1)  # the reaper is back asleep: nothing in flight, no timer
    b.inject("read", "clock", count=100, jump_ns=4 * 10**9)  # 32 MB of tokens a reading
    back = empty(2 * MIB)
    b.read(ext, back).result(timeout=5)  # TimeoutError before the fix
    assert bytes(back) == bytes(data)
    assert b.usage()["throttle_seconds_read"] > 0  # the first reading did refuse the head


@pytest.mark.parametrize("mode", MODES)
def test_set_rate_rejects_nonsense(open_capped, mode):
    b = open_capped(mode)
    with pytest.raises(ValueError, match="'write' or 'read'"):
        b.set_rate("erase", MB)
    with pytest.raises(ValueError, match="bytes per second"):
        b.set_rate("write", -1)
    with pytest.raises(ValueError, match="burst"):
        b.set_rate("write", MB, burst=0)
    b.close()
    with pytest.raises(ValueError, match="closed"):
        b.set_rate("write", MB)


@pytest.mark.parametrize("mode", MODES)
def test_a_capped_direction_does_not_hold_back_the_other(open_capped, mode):
    """Ops waiting for write tokens sit in the write queue (the engine's, or the pacer's): they
    hold no I/O thread or ring slot, so an uncapped read goes straight past them."""
    b = open_capped(mode, max_write_bps=4 * MB, io_threads=2, io_depth=2)
    exts = extents(b, 9, MIB)
    data = quick_filled(9 * MIB)
    b.set_rate("write", None)
    b.write(exts[8], data[8 * MIB :]).result()
    b.set_rate("write", 4 * MB)
    writes = stream(b, "write", exts[:8], data)  # 1.8 s at the cap
    if mode in ("native", "threads"):
        info = b.engine_info()
        assert (info["rate_write"], info["burst_write"], info["rate_read"]) == (4 * MB, MIB, 0)
        assert wait_until(lambda: b.engine_info()["queued_write"] >= 6)
        assert b._engine.call("tba_engine_set_rate", 7, MB, 0) == -errno.EINVAL
    else:
        assert wait_until(lambda: len(b._pacers["write"]) >= 6)
    back = empty(MIB)
    t0 = time.monotonic()
    b.read(exts[8], back).result(timeout=5)
    assert time.monotonic() - t0 < 0.3 and back == data[8 * MIB :]
    assert not all(f.done() for f in writes)
    b.close()
    assert all(f.exception() is None for f in writes)


def test_memory_backend_records_caps_and_ignores_them(make_cfg):
    b = open_backend(make_cfg(backend="memory", max_write_bps="300MB/s"))
    assert "write cap of 300 MB/s ignored (no disk I/O)" in b.reason
    assert b.reason.startswith("TBA_BACKEND=memory: ")
    b.set_rate("read", MB)
    assert "write cap of 300 MB/s and read cap of 1 MB/s ignored" in b.reason
    assert b.caps == {"write": 300 * MB, "read": MB}
    ext = b.allocate(16 * MIB)
    t0 = time.monotonic()
    b.write(ext, quick_filled(16 * MIB)).result()
    b.read(ext, empty(16 * MIB)).result()
    assert time.monotonic() - t0 < 1.0  # 16 s at the read cap if it applied
    u = b.usage()
    assert u["throttle_seconds_write"] == u["throttle_seconds_read"] == 0.0
    b.set_rate("write", None)
    assert "write cap" not in b.reason
    with pytest.raises(ValueError, match="'write' or 'read'"):
        b.set_rate("both", MB)
    b.close()


def test_kvikio_backend_is_capped_like_posix(make_cfg, monkeypatch):
    from fake_kvikio import FakeKvikio

    monkeypatch.setattr(kv_mod, "_cuda_probe_pair", lambda nbytes: None)
    b = kv_mod.KvikioBackend(
        make_cfg(max_write_bps="20MB/s", slab_bytes="16MiB"), kvikio_module=FakeKvikio()
    )
    try:
        assert b.reason.endswith("; write capped at 20 MB/s (burst 1.0 MiB)")
        exts = extents(b, 8, MIB)
        data = quick_filled(8 * MIB)
        t0 = time.monotonic()
        futs = stream(b, "write", exts, data)
        assert time.monotonic() - t0 < 0.1
        for f in futs:
            f.result()
        expected = (8 * MIB - MIB) / (20 * MB)
        assert 0.97 * expected < time.monotonic() - t0 < expected + 0.15
        assert b.usage()["throttle_seconds_write"] > 0.2
    finally:
        b.close()
