"""`Relay`: train a model layer by layer (L2L), weights and optimizer state on the EPS.

NOTE [Relay step]
Forward: for each layer l = 0..L-1, fetch its weights, then run it on each micro-batch u in
order; its output is the next layer's input. With ``recompute`` the input of every layer l>0
is stashed (NOTE [SSD stash] for the SSD) and the graph dropped at once; without, the graph is
kept (NOTE [Weights out of the graph]). The last layer's output goes through ``loss`` and is
divided by U.
Backward: for l = L-1 down to the lowest layer with trainable parameters, fetch the weights
again; for each micro-batch u in order, recompute the layer on its stashed input (with the RNG
state its forward had) or take the kept graph, and backpropagate the gradient that layer l+1
gave for u. Parameter gradients accumulate in ``p.grad`` over u = 0..U-1, the order in which
plain gradient accumulation (``(model(x_u) / U).backward()`` for each u) adds them, which is why
the result is bit-identical on the CPU. Then layer l's gradients go to its optimizer step (on
the update worker with workers, while layer l-1 computes: NOTE [Relay overlap]).
Each layer's forward runs as its recompute will: grad mode on, the input requiring grad exactly
when a layer below has trainable parameters (as it would inside the whole model), so that both
pick the same kernels and produce the same bits.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..config import Config
from ..errors import UsageError
from ._batch import split
from ._config import RelayConfig, check_arguments
from ._eps import EPS, HostEPS
from ._errors import RelayConfigError, describe
from ._layers import Layers, as_layers
from ._meter import Meter
from ._pipeline import LayerPrefetcher, Updater
from ._rng import replaying, rng_state
from ._stash import DiskStash, MemoryStash
from ._weights import Slots, WeightTokens

__all__ = ["Relay"]

log = logging.getLogger(__name__)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Relay:
    """Train a model layer by layer (L2L relay execution).

    ``layers``: a :class:`Layers` (e.g. from ``tba.relay.layers_of(model)``), or a list of
    modules, embed → blocks → head, with ``loss`` (and optionally ``call`` and ``prepare``; see
    :class:`Layers`). The relay takes the modules' parameters: between steps they are empty
    placeholders and the EPS holds the values (``close()`` gives them back).

    ``optimizer``: builds one optimizer per layer from that layer's trainable parameters, e.g.
    ``lambda params: torch.optim.AdamW(params, lr=1e-4)``. Any ``torch.optim`` optimizer whose
    update of a parameter depends only on that parameter (Adam, AdamW, SGD, ...) gives what one
    optimizer over the whole model gives. Global-norm gradient clipping cannot apply: each
    layer's step runs before the layers below have their gradients.

    ``micro_batches``: U; ``step`` splits each batch into U equal micro-batches.
    ``config``: :class:`RelayConfig`. ``storage``: the :class:`tba.Config` whose spill_dir,
    backend, slab_bytes, checksum, staging_bytes (the SSD stash's write window) and quotas the
    SSD tiers use (default: ``tba.Config()``, from ``TBA_*``).
    """

    def __init__(
        self,
        layers: Layers | Any,
        *,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        micro_batches: int,
        loss: Callable | None = None,
        call: Callable | None = None,
        prepare: Callable | None = None,
        config: RelayConfig | None = None,
        storage: Config | None = None,
    ):
        cfg = check_arguments(config, micro_batches, optimizer)
        self.spec = as_layers(layers, loss, call, prepare)
        self.config = cfg
        self.micro_batches = micro_batches
        self.device = torch.device(cfg.device)
        self._meter = Meter()
        self._backend = None
        self._closed = False
        self._failed: str | None = None
        self._steps = 0
        self._updater_submitted = 0  # layers whose update the current step has queued
        self._in_use: list = []  # fetches the compute thread holds (released on failure)
        self._stats: dict = {}
        self.storage = storage
        if cfg.eps == "ssd" or cfg.stash == "ssd":
            from ..storage import open_backend

            self.storage = storage if storage is not None else Config()
            self._backend = open_backend(self.storage)
        try:
            self._eps = self._make_eps(optimizer)
        except BaseException:
            if self._backend is not None:
                self._backend.close()
            raise
        self._slots = [Slots(m, e.layout) for m, e in zip(self._eps.modules, self._eps.entries)]
        trainable = [bool(s.trainable) for s in self._slots]
        self._needs_input_grad = [any(trainable[:i]) for i in range(len(trainable))]
        self._lowest = trainable.index(True)
        if not cfg.recompute:
            self._stash = None
        elif cfg.stash == "ssd":
            self._stash = DiskStash(
                self._backend,
                self.storage.checksum,
                self.storage.staging_bytes,
                self.device,
                self._meter,
            )
        else:
            self._stash = MemoryStash(self._meter)
        self._tokens = None if cfg.recompute else WeightTokens(self._meter)
        ahead = cfg.read_ahead if cfg.overlap and self._eps.async_fetch else 0
        self._prefetcher = LayerPrefetcher(self._eps, ahead, self._meter)
        workers = cfg.use_workers()
        self._updater = Updater(self._eps, workers, cfg.max_pending_updates, self._meter)
        self.param_bytes = sum(e.layout.data_bytes for e in self._eps.entries)

    def _make_eps(self, optimizer) -> EPS:
        cfg = self.config
        if cfg.eps == "ssd":
            from ._eps_ssd import SSDEPS

            return SSDEPS(
                self.spec, optimizer, self.device, self._meter, self._backend, self.storage.checksum
            )
        return HostEPS(self.spec, optimizer, self.device, self._meter, cfg.use_workers())

    # -- public --------------------------------------------------------------------------------
    @property
    def modules(self) -> list[nn.Module]:
        """The layer modules (built), whose parameters are placeholders between steps."""
        return list(self._eps.modules)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer | None]:
        """Each layer's optimizer (None for a layer with nothing to train), e.g. to set the
        learning rate between steps. With eps='ssd' their tensor state lives on disk."""
        return [e.optimizer for e in self._eps.entries]

    def step(self, batch: Any, target: Any = None) -> torch.Tensor:
        """One training step on ``batch``: forward, backward and every layer's optimizer step.

        Returns the loss: the micro-batches' losses, each divided by U, summed in micro-batch
        order (a 0-dim tensor, detached).
        """
        self._check_usable()
        U = self.micro_batches
        inputs = split(batch, U, "batch", self.device)
        targets = split(target, U, "target", self.device)
        self._meter.start_step()
        t0 = time.perf_counter()
        updated = self._updater_submitted = 0
        try:
            with torch.enable_grad():
                loss, fwd = self._run(inputs, targets)
            self._updater.drain()
        except BaseException as e:
            updated = self._updater_submitted
            self._abort(e, updated)
            raise
        self._steps += 1
        self._stats = self._snapshot(time.perf_counter() - t0, fwd)
        return loss

    def stats(self) -> dict:
        """Figures for the last completed step (NOTE [Working bytes] in _meter.py)."""
        return dict(self._stats)

    def parameters_of(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s current weights by parameter name, in host memory."""
        self._check_usable()
        entry = self._eps.entries[layer]
        return dict(zip(entry.names, self._eps.values(layer)))

    def close(self, restore: bool | None = None) -> None:
        """Stop the workers and free the EPS. ``restore`` puts the trained weights back into
        the modules' parameters (default: yes with eps='host', no with eps='ssd', where the
        model may not fit in memory; read it layer by layer with ``parameters_of``)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._updater.close()
        finally:
            self._prefetcher.cancel()
            if restore is None:
                restore = self.config.eps == "host"
            if restore and self._failed is None:
                for layer, slots in enumerate(self._slots):
                    for p, v in zip(slots.params, self._eps.values(layer, copy=False)):
                        p.data = v  # host memory, where the model was built
            self._eps.close()
            if self._stash is not None:
                self._stash.clear()
            if self._backend is not None:
                self._backend.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step (NOTE [Relay step]) ----------------------------------------------------------
    def _run(self, inputs: list, targets: list) -> tuple[torch.Tensor, float]:
        n, U = len(self._slots), self.micro_batches
        recompute = self.config.recompute
        plan = [(i, False) for i in range(n)] + [
            (i, True) for i in range(n - 1, self._lowest - 1, -1)
        ]
        self._prefetcher.start(plan)
        if self._tokens is not None:
            self._tokens.reset()
        extras: list = [None] * U
        rng: dict[tuple[int, int], Any] = {}
        graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        t0 = time.perf_counter()
        xs = inputs
        for i in range(n):
            fetched, buf = self._take(i)
            ys = []
            hooks = self._tokens.hooks() if self._tokens else contextlib.nullcontext()
            copied = recompute and not self._stash.holds_inputs()  # boundary: see _meter.py
            with hooks:
                for u in range(U):
                    if recompute and self.config.preserve_rng and i >= self._lowest:
                        rng[(i, u)] = rng_state(self.device)
                    xin, out = self._forward(i, u, xs[u], extras, targets)
                    y = out.detach()
                    if i == 0 and self.spec.prepare is not None:
                        with torch.no_grad():
                            extras[u] = self.spec.prepare(inputs[u], y)
                    if not recompute:
                        if i >= self._lowest:  # layers below it never run backward
                            graphs[(i, u)] = (xin, out)
                    elif self._lowest <= i + 1 < n:
                        self._stash.put((i + 1, u), y)
                    if copied and i + 1 < n:
                        self._meter.hold("boundary", _nbytes(y))
                    if copied and i > 0:
                        self._meter.drop("boundary", _nbytes(xs[u]))
                    ys.append(y)
                    del xin, out
            self._unbind(i)
            self._in_use.remove(fetched)
            fetched.release()
            xs = ys
        loss = xs[0]
        for u in range(1, U):
            loss = loss + xs[u]
        fwd = time.perf_counter() - t0
        self._backward(inputs, targets, extras, rng, graphs)
        return loss, fwd

    def _forward(self, i: int, u: int, x: Any, extras: list, targets: list):
        """Layer ``i`` on micro-batch ``u``: (its input leaf, its output or scaled loss)."""
        if torch.is_tensor(x) and x.is_floating_point():
            x = x.detach().requires_grad_(self._needs_input_grad[i])
        out = self.spec.call(i, self._eps.modules[i], x, extras[u])
        last = i == len(self._slots) - 1
        if last:
            out = self.spec.loss(out, targets[u])
            if not torch.is_tensor(out) or out.numel() != 1:
                raise RelayConfigError(
                    f"loss() returned {describe(out)}; it must return the micro-batch's loss "
                    "as a tensor with one element."
                )
            out = out / self.micro_batches
        elif not torch.is_tensor(out):
            raise RelayConfigError(
                f"layer {i} returned {describe(out)}; the relay passes one tensor from layer "
                "to layer: make call() return the hidden states (e.g. out[0] of a tuple)."
            )
        return x, out

    def _backward(self, inputs, targets, extras, rng, graphs) -> None:
        U = self.micro_batches
        grads: list[torch.Tensor | None] = [None] * U
        top = len(self._slots) - 1
        ahead = self._stash is not None and self.config.overlap
        if ahead:  # the top layer's inputs: read while its weights come
            self._stash.prefetch([(top, u) for u in range(U)])
        for i in range(top, self._lowest - 1, -1):
            fetched, buf = self._take(i)
            self._eps.prepare_update(fetched)
            if ahead:  # one layer ahead (NOTE [SSD stash] 3)
                self._stash.prefetch([(i - 1, u) for u in range(U)])
            for u in range(U):
                if self._stash is None:
                    xin, out = graphs.pop((i, u))
                else:
                    x = inputs[u] if i == 0 else self._stash.take((i, u))
                    with replaying(rng.pop((i, u), None), self.device):
                        xin, out = self._forward(i, u, x, extras, targets)
                if out.requires_grad:
                    torch.autograd.backward(out, grads[u])
                g = xin.grad if self._needs_input_grad[i] and torch.is_tensor(xin) else None
                self._meter.drop("boundary", _nbytes(grads[u]))
                self._meter.hold("boundary", _nbytes(g))
                grads[u] = g
                del xin, out
            if self._tokens is not None:
                self._tokens.release(i)
            layer_grads = self._slots[i].take_grads()
            self._unbind(i)
            fetched.drop_device_copy()
            self._updater_submitted += 1
            self._in_use.remove(fetched)
            self._updater.submit(i, layer_grads, fetched)
        for g in grads:
            self._meter.drop("boundary", _nbytes(g))

    def _take(self, i: int):
        """Layer ``i``'s next fetch, waited for and bound to its module."""
        fetched, buf = self._prefetcher.next(i)
        self._in_use.append(fetched)
        self._bind(i, buf)
        return fetched, buf

    def _bind(self, i: int, buf: torch.Tensor) -> None:
        self._slots[i].bind(buf)
        if self._tokens is not None:
            self._tokens.attach(i, buf)

    def _unbind(self, i: int) -> None:
        self._slots[i].unbind()
        if self._tokens is not None:
            self._tokens.detach(i)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise UsageError("tba.relay: the Relay is closed; create a new one.")
        if self._failed is not None:
            raise UsageError(
                f"tba.relay: an earlier step failed after some layers' optimizer steps had run "
                f"({self._failed}); the model is partly updated. Create a new Relay."
            )

    def _abort(self, err: BaseException, updated: int) -> None:
        """Leave no fetch, stash entry, gradient or bound weight behind after a failed step."""
        self._prefetcher.cancel()
        while self._in_use:
            self._in_use.pop().release()
        with contextlib.suppress(BaseException):
            self._updater.drain()
        for i, slots in enumerate(self._slots):
            slots.take_grads()
            self._unbind(i)
        if self._stash is not None:
            self._stash.clear()
        if self._tokens is not None:
            self._tokens.reset()
        if updated:
            self._failed = f"{type(err).__name__}: {err}"

    def _snapshot(self, seconds: float, fwd: float) -> dict:
        out = self._meter.snapshot()
        out.update(
            step=self._steps,
            step_seconds=seconds,
            forward_seconds=fwd,
            micro_batches=self.micro_batches,
            layers=len(self._slots),
            eps=self.config.eps,
            stash=self.config.stash if self.config.recompute else "graph",
            recompute=self.config.recompute,
            overlap=self.config.overlap,
            workers=self.config.use_workers(),
            param_bytes=self.param_bytes,
            eps_host_bytes=self._eps.host_bytes(),
            eps_disk_bytes=getattr(self._eps, "disk_bytes", lambda: 0)(),
            backend=getattr(self._backend, "name", None),
            backend_reason=getattr(self._backend, "reason", None),
        )
        return out
