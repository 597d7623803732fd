"""The two overlaps of the relay: weights fetched ahead, optimizer steps behind.

NOTE [Relay overlap]
1. A step fetches layers in one known order: 0..L-1 for the forward, then L-1 down to the
   lowest trainable layer for the backward. ``LayerPrefetcher`` keeps up to ``read_ahead`` fetches
   issued beyond the one in use (host tier: copies on the EPS's fetch worker, in order; SSD
   tier: asynchronous reads on the backend's I/O threads).
2. With workers (RelayConfig.workers), ``Updater`` runs each layer's optimizer step on one
   worker thread, in submission order,
   while the compute thread goes on with the layer below. At most ``max_pending_updates`` are
   queued or running; past that, ``submit`` waits (``update_wait_seconds``). The update owns
   the layer's gradients and fetched buffers and releases them when it ends.
3. ``drain`` waits for every update of the step and raises the first error; it runs before
   ``step()`` returns, so that the next step's fetches read updated weights (NOTE [EPS
   contract] 3) and the caller sees the trained model.
Without overlap, fetches are issued only when needed. Without workers, updates (and host-tier
copies) run on the compute thread; on the SSD tier their reads and writes stay asynchronous.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ._eps import EPS, Fetched
from ._meter import Meter

__all__ = ["LayerPrefetcher", "Updater"]


class LayerPrefetcher:
    def __init__(self, eps: EPS, ahead: int, meter: Meter):
        self._eps = eps
        self._ahead = ahead
        self._meter = meter
        self._plan: list[tuple[int, bool]] = []
        self._next = 0  # the next plan position to issue
        self._issued: collections.deque[Fetched] = collections.deque()

    def start(self, plan: list[tuple[int, bool]]) -> None:
        """A new step's fetch order: (layer, for the backward) pairs."""
        self.cancel()
        self._plan = plan
        self._next = 0

    def _issue(self, count: int) -> None:
        while len(self._issued) < count and self._next < len(self._plan):
            layer, backward = self._plan[self._next]
            self._issued.append(self._eps.fetch(layer, backward))
            self._next += 1

    def next(self, layer: int) -> tuple[Fetched, torch.Tensor]:
        """The fetch for ``layer`` (the next in the plan) and its buffer, once it is there."""
        self._issue(1)
        fetched = self._issued.popleft()
        if fetched.layer != layer:  # pragma: no cover - the relay follows its own plan
            raise RuntimeError(f"tba.relay: fetched layer {fetched.layer}, expected {layer}")
        self._issue(self._ahead)  # the next ones go out before we wait for this one
        with self._meter.waiting("fetch_wait_seconds"):
            buf = fetched.wait()
        return fetched, buf

    def cancel(self) -> None:
        """Let go of fetches issued and not used (after a failed step)."""
        while self._issued:
            self._issued.popleft().release()
        self._plan, self._next = [], 0


class Updater:
    def __init__(self, eps: EPS, workers: bool, limit: int, meter: Meter):
        self._eps = eps
        self._limit = limit
        self._meter = meter
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="tba-relay-update") if workers else None
        )
        self._pending: collections.deque[Future] = collections.deque()

    def submit(self, layer: int, grads: list[torch.Tensor | None], fetched: Fetched) -> None:
        nbytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
        self._meter.hold("grads", nbytes)
        self._meter.add(grad_bytes_moved=nbytes)
        if self._pool is None:
            self._run(layer, grads, fetched, nbytes)
            return
        while len(self._pending) >= self._limit:
            oldest = self._pending.popleft()
            with self._meter.waiting("update_wait_seconds"):
                oldest.result()
        self._pending.append(self._pool.submit(self._run, layer, grads, fetched, nbytes))

    def _run(self, layer, grads, fetched: Fetched, nbytes: int) -> None:
        try:
            self._eps.update(layer, grads, fetched)
        finally:
            grads.clear()
            fetched.release()
            self._meter.drop("grads", nbytes)

    def drain(self) -> None:
        """Wait for every queued update; raise the first error once all have ended."""
        first: BaseException | None = None
        with self._meter.waiting("update_wait_seconds"):
            while self._pending:
                err = self._pending.popleft().exception()
                first = first or err
        if first is not None:
            raise first

    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
