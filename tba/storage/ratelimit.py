"""Bandwidth caps for the Python backends: a token bucket, and the pacer thread that applies it.

NOTE [Rate caps]
1. Each direction (write, read) of a backend may be capped at a rate in bytes per second:
   ``TBA_MAX_WRITE_BPS`` / ``TBA_MAX_READ_BPS`` at construction, ``set_rate(op, bps)`` at run
   time. None (or 0) means no cap. The native engine applies the same rules in C
   (``tba_engine_set_rate``, native/README.md); the memory backend records caps and ignores them,
   since it does no disk I/O.
2. Tokens are bytes. They accrue at the rate, up to the burst: by default
   :func:`default_burst`, 20 ms of the rate and at least 1 MiB. A short burst keeps the rate
   measured over a second within a few percent of the cap (the first burst is free), and is
   still long enough for ops to be released in batches rather than one wake-up each.
3. Pay before, no debt, no splitting: an op waits until the bucket holds its whole length, then
   takes it. An op longer than the burst (16 MiB at 100 MB/s, burst 2 MB) would never fit, so
   while it waits at the head of the line the bucket may fill up to its length. After an idle
   spell it therefore waits (length - burst) / rate; in a sustained stream, length / rate: like
   a disk of that speed.
   Catch-up: while there is a backlog (an op waits at the head of the line, refused or known
   to be next), the bucket may also keep up to CATCH_UP (100 ms) of the rate beyond that, so a
   late release (a GC pause of ~100 ms with torch loaded, a descheduled thread, the 1 ms
   release quantum) is made up by the ops behind it instead of lost: without it, every such
   pause would be time the stream never gets back, and a capped stream would run measurably
   below its cap. Idle time (no backlog) is never made up. A stream that
   starts from an idle bucket never gets more than burst + rate * T bytes in its first T
   seconds; any window of T seconds gets at most max(burst, longest op) + rate * (T +
   CATCH_UP), the excess being catch-up after a late release.
4. One line per direction, first come first served: the head of the line takes tokens, the
   others wait behind it (a long op holds back short ones, as on a real disk).
5. Throttle seconds: the time the head of the line spent waiting for tokens (from its first
   refusal to its release), summed, the wait going on now included. Those waits never
   overlap, so the total is at most the wall-clock time, and about the stream's duration
   while the cap binds. 0 without a cap.
6. A new cap starts with a full bucket. Changing a cap keeps the tokens (at most the new burst)
   and re-times the ops already waiting; removing it releases them at once. ``drain()`` (the
   backends' close) lifts the cap for good, so close neither waits out the cap nor drops ops.
7. The slab backends (posix, buffered, kvikio) send a capped direction's ops through a
   :class:`Pacer`: a queue and one thread per direction that takes each op's tokens (sleeping if it
   must) and only then hands the op to the I/O pool. The caller of ``write()``/``read()`` never
   waits, and neither do the pool threads: were they to sleep on tokens, a capped stream of writes
   would hold every pool thread and the reads queued behind it (in a mixed stream the reads would
   then fall far below their cap). The native engine likewise keeps one queue per direction. An op
   starts no earlier than its tokens allow; it may start later when the pool is busy, so a pool
   backlog can release a short catch-up burst, never more bytes over time. Uncapped directions go
   straight to the pool, as before.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

from ..config import format_size

__all__ = [
    "CATCH_UP",
    "DIRECTIONS",
    "MIN_BURST",
    "Pacer",
    "TokenBucket",
    "check_rate",
    "default_burst",
    "describe_caps",
    "format_rate",
]

DIRECTIONS = ("write", "read")
MIN_BURST = 1 << 20
BURST_DIVISOR = 50  # default burst: 1/50 s (20 ms) of the rate
QUANTUM = 0.001  # a held op is re-checked at most once a millisecond: ops go in batches
CATCH_UP = 0.1  # seconds of lateness a backlog may make up (NOTE 3)
_SLACK = 1e-3  # bytes: the floating-point error of the tokens is far below this


def default_burst(rate: int) -> int:
    """The burst of a cap when none is given: 20 ms of ``rate``, and at least 1 MiB."""
    return max(MIN_BURST, rate // BURST_DIVISOR)


def check_rate(value: Any, what: str = "rate") -> int | None:
    """``value`` as a whole number of bytes per second, or None for no cap (None or 0)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"tba.storage: a {what} is a whole number of bytes per second (0 or None for no "
            f"cap), not {value!r}"
        )
    return value or None


def check_burst(burst: Any) -> int | None:
    """``burst`` as a whole number of bytes (at least 1), or None for the default."""
    if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int)):
        raise ValueError(f"tba.storage: a burst is a whole number of bytes, not {burst!r}")
    if burst is not None and burst < 1:
        raise ValueError(f"tba.storage: a burst must be at least 1 byte, not {burst}")
    return burst


def format_rate(bps: int) -> str:
    """``300 MB/s``, ``1.5 GB/s``, ``64 kB/s``: decimal units, as disks are rated."""
    for unit, scale in (("GB/s", 10**9), ("MB/s", 10**6), ("kB/s", 10**3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps} B/s"


def describe_caps(caps: Mapping[str, tuple[int, int] | None]) -> str:
    """``write capped at 300 MB/s (burst 5.7 MiB)``, one clause per capped direction; "" if none."""
    parts = []
    for op in DIRECTIONS:
        cap = caps.get(op)
        if cap:
            rate, burst = cap
            parts.append(f"{op} capped at {format_rate(rate)} (burst {format_size(burst)})")
    return ", ".join(parts)


class TokenBucket:
    """A thread-safe token bucket capping one direction; NOTE [Rate caps] gives the rules.

    ``acquire(n)`` sleeps the calling thread until ``n`` bytes may go; ``try_acquire(n)`` never
    sleeps. ``clock`` (monotonic seconds) can be replaced in tests; a test that moves a fake
    clock calls :meth:`wake` so that sleeping threads look at it again.
    """

    def __init__(
        self,
        rate: int | None = None,
        burst: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._rate = 0  # bytes per second; 0: no cap
        self._burst = 0
        self._tokens = 0.0
        self._stamp = clock()
        # The backlog: the length of the op at the head of the line (refused for want of tokens,
        # or known to be waiting right behind the op that just went); 0 when there is none.
        self._held = 0
        self._refused_at: float | None = None  # when the head was first refused tokens
        self._throttled = 0.0  # finished waits for tokens, summed
        self._line: deque[tuple[object, int]] = deque()  # acquire() calls waiting, in order
        self._drained = False
        if rate:
            self.set_rate(rate, burst)

    # -- settings and state ----------------------------------------------------------------
    @property
    def rate(self) -> int | None:
        return self._rate or None

    @property
    def burst(self) -> int | None:
        return self._burst or None

    @property
    def waiting(self) -> int:
        """acquire() calls now waiting (for tokens, or behind the one that is)."""
        with self._cond:
            return len(self._line)

    @property
    def throttled_seconds(self) -> float:
        """Seconds the head of the line has waited for tokens, the current wait included."""
        with self._cond:
            total = self._throttled
            if self._refused_at is not None:
                total += max(0.0, self._clock() - self._refused_at)
            return total

    def set_rate(self, rate: int | None, burst: int | None = None) -> None:
        """Cap at ``rate`` bytes per second (None or 0: no cap) with a bucket of ``burst`` bytes
        (None: :func:`default_burst`). Waiting calls are re-timed at once."""
        rate = check_rate(rate)
        burst = check_burst(burst)
        with self._cond:
            now = self._clock()
            if self._rate:
                self._fill(now)  # what accrued so far accrued at the old rate
            if not rate:
                self._unhold(now)
                self._rate = self._burst = 0
                self._tokens = 0.0
            else:
                size = burst or default_burst(rate)
                if not self._rate:
                    self._tokens = float(size)  # a new cap starts with a full bucket
                else:  # keeps the tokens, not the catch-up credit
                    self._tokens = min(self._tokens, float(max(size, self._held)))
                self._rate, self._burst = rate, size
            self._stamp = now
            self._cond.notify_all()

    def drain(self) -> None:
        """Lift the cap for good: every waiting and later call goes at once (backend close)."""
        with self._cond:
            self._drained = True
            self._unhold(self._clock())
            self._cond.notify_all()

    def wake(self) -> None:
        """Make sleeping acquire() calls look at the clock again (tests move a fake clock)."""
        with self._cond:
            self._cond.notify_all()

    # -- taking tokens ---------------------------------------------------------------------
    def acquire(self, nbytes: int, then: int = 0) -> float:
        """Sleep until ``nbytes`` may go and take their tokens; returns the seconds this call
        waited at the head of the line for tokens (0.0 when it went at once or without a cap).
        ``then``: the length of the op known to come right after this one (a queue's next op),
        so the backlog, and its catch-up, carries on from this op to that one. A call for 0
        bytes goes at once and ends a backlog that ``then`` announced but that never came."""
        with self._cond:
            if not self._rate or self._drained:
                return 0.0
            me = object()
            self._line.append((me, nbytes))
            start: float | None = None
            now = 0.0
            admitted = False
            try:
                while self._rate and not self._drained:
                    if self._line[0][0] is not me:
                        self._cond.wait()
                        continue
                    now = self._clock()
                    after = then or (self._line[1][1] if len(self._line) > 1 else 0)
                    delay = self._take(nbytes, now, after)
                    if delay == 0.0:
                        admitted = True
                        break
                    if start is None:
                        start = now
                    self._cond.wait(max(delay, QUANTUM))
                else:
                    now = self._clock()  # the cap went away (or drain): go now
            finally:
                if not admitted and self._line[0][0] is me:
                    self._unhold(self._clock())
                self._line.remove((me, nbytes))
                self._cond.notify_all()
            return max(0.0, now - start) if start is not None else 0.0

    def try_acquire(self, nbytes: int, then: int = 0) -> float:
        """Take ``nbytes`` of tokens if they may go now and nobody waits: returns 0.0. Else
        returns the seconds until they might, taking nothing. A refused call counts as the op
        at the head of the line: the bucket may then fill up to ``nbytes``, so retrying the
        same op succeeds eventually however long it is. ``then`` as for :meth:`acquire`."""
        with self._cond:
            if not self._rate or self._drained:
                return 0.0
            if self._line:
                return QUANTUM
            return self._take(nbytes, self._clock(), then)

    # -- the bucket itself (lock held) -----------------------------------------------------
    def _fill(self, now: float) -> None:
        if now <= self._stamp:
            return
        ceiling = float(max(self._burst, self._held))
        if self._held:
            ceiling += self._rate * CATCH_UP  # a backlog makes up for a late release
        # Clipped every time: catch-up credit does not outlive its backlog.
        self._tokens = min(ceiling, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def _unhold(self, now: float) -> None:
        if self._refused_at is not None:
            self._throttled += max(0.0, now - self._refused_at)
            self._refused_at = None
        self._held = 0

    def _take(self, nbytes: int, now: float, then: int) -> float:
        """0.0 after taking the tokens of ``nbytes`` (the backlog goes on with ``then`` bytes,
        if any), else the seconds until they accrue (the op is then held). A thousandth of a
        byte of slack absorbs floating-point rounding."""
        self._fill(now)
        if self._tokens + _SLACK >= nbytes:
            self._tokens -= nbytes
            self._unhold(now)
            self._held = then
            return 0.0
        self._held = nbytes
        if self._refused_at is None:
            self._refused_at = now
        return (nbytes - self._tokens) / self._rate

    def __repr__(self) -> str:
        if not self._rate:
            return "<TokenBucket: no cap>"
        return f"<TokenBucket {format_rate(self._rate)}, burst {format_size(self._burst)}>"


def _relay(future: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run ``fn`` on a pool thread and settle the caller's future with its outcome."""
    if not future.set_running_or_notify_cancel():
        return  # cancelled while it waited for tokens
    try:
        value = fn(*args)
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(value)


class Pacer:
    """One direction's queue: ops leave it for ``pool`` once ``bucket`` pays for them.

    ``submit`` returns a future at once. The pacer's thread, started on first use, takes the
    head op's tokens (it sleeps, nobody else does), then hands the op to the pool, so ops start
    in submission order. ``close`` hands over what is left (after the bucket is drained that
    is immediate) and ends the thread; it does not shut the pool down.
    """

    def __init__(self, bucket: TokenBucket, pool: Executor, name: str):
        self._bucket = bucket
        self._pool = pool
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[Future, int, Callable[..., Any], tuple[Any, ...]]] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        """Nothing queued: an op may bypass the pacer without overtaking one."""
        return not self._queue

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"tba.storage: the {self._name} pacer is closed")
            self._queue.append((future, nbytes, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and empty
                future, nbytes, fn, args = self._queue[0]
                then = self._queue[1][1] if len(self._queue) > 1 else 0
            # A cancelled op costs nothing; taking 0 bytes keeps the backlog bookkeeping right.
            self._bucket.acquire(0 if future.cancelled() else nbytes, then)
            with self._cond:
                self._queue.popleft()
            if future.cancelled():
                continue
            try:
                self._pool.submit(_relay, future, fn, args)
            except BaseException as e:  # the pool is shut down (a dropped backend)
                if future.set_running_or_notify_cancel():
                    future.set_exception(e)

    def close(self, wait: bool = True) -> None:
        """Stop taking ops; the thread hands over the queued ones, then ends (joined if
        ``wait``). Drain the bucket first, or this waits out the cap."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()
