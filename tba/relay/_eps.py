"""The eager parameter server (EPS): each layer's weights and optimizer, outside the layer's run.

NOTE [EPS contract]
1. ``fetch(l)`` delivers a fresh buffer with layer l's weights (``FlatLayout`` order) for the
   executing layer: a copy from host memory, or a read from the SSD. Every fetch counts the
   weights' bytes in ``weight_bytes_moved``; a step fetches each layer once for the forward
   and once for the backward, whatever the number of micro-batches.
2. ``update(l, grads, fetched)`` runs layer l's optimizer on its master weights with the
   layer's gradients summed over the micro-batches. With workers it runs on the update worker
   while the compute thread works on layer l-1, so it touches nothing of any other layer.
3. The relay never fetches layer l while an update of layer l is queued or running: each step
   ends by waiting for its updates (``Relay.step``), and within a step the backward fetch of
   layer l comes before its update.
4. Between uses, the modules' own parameters are empty placeholders; the EPS holds the values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn

from ._errors import RelayConfigError
from ._layers import Layers, ParamCheck, build
from ._layout import FlatLayout, alloc, tensor_align
from ._meter import Meter

__all__ = ["EPS", "Fetched", "HostEPS", "LayerEntry", "empty_like_param"]

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def empty_like_param(t: torch.Tensor) -> torch.Tensor:
    """The placeholder a parameter holds while its layer is not executing: no bytes."""
    return torch.empty(0, dtype=t.dtype, device=t.device)


def done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class Fetched:
    """One fetch of one layer's weights; ``wait()`` gives the buffer to compute with."""

    def __init__(self, layer: int, future: Future, nbytes: int, meter: Meter, device, host=None):
        self.layer = layer
        self.nbytes = nbytes
        self.host = host  # SSD tier: the host buffer read from disk (also the update's master)
        # SSD tier: the optimizer state's buffer, its read, and the bytes held for it
        self.state: tuple[torch.Tensor, Future, int] | None = None
        self._future = future
        self._device = device
        self._buf: torch.Tensor | None = None
        self._meter = meter
        self._held = True
        meter.hold("weights", nbytes)

    def wait(self) -> torch.Tensor:
        if self._buf is None:
            got = self._future.result()
            buf = self.host if got is None else got
            # A CUDA device gets its copy here, on the compute thread's stream.
            self._buf = buf if buf.device == self._device else buf.to(self._device)
        return self._buf

    def drop_device_copy(self) -> None:
        """The layer's compute is done: free the device copy of its weights now, not when its
        update ends (the update reads host memory only). No-op for a buffer in host memory."""
        if self._buf is not None and self._buf.device.type != "cpu":
            self._buf = None

    def release(self) -> None:
        """Let go of the buffers (the update keeps ``host`` alive as long as it needs it)."""
        if self._held:
            self._held = False
            self._meter.drop("weights", self.nbytes)
        if self.state is not None:  # read and never used: the step failed
            self._meter.drop("state", self.state[2])
            self.state = None
        self._buf = None
        self.host = None


class LayerEntry:
    """What the EPS keeps for one layer."""

    def __init__(self, names: list[str], layout: FlatLayout, trainable: list[int]):
        self.names = names
        self.layout = layout
        self.trainable = trainable  # indexes (in layout order) of parameters that get gradients
        self.masters: list[nn.Parameter] = []  # the optimizer's parameters, trainable order
        self.optimizer: torch.optim.Optimizer | None = None


class EPS:
    """Builds each layer in turn, takes its parameters' values and gives it empty placeholders."""

    tier = ""
    async_fetch = True  # a fetch returns before its bytes are there (so reading ahead helps)

    def __init__(
        self, layers: Layers, factory: OptimizerFactory, device: torch.device, meter: Meter
    ):
        self.device = device
        self.meter = meter
        self.tensor_align = tensor_align(device)
        self.modules: list[nn.Module] = []
        self.entries: list[LayerEntry] = []
        check = ParamCheck()
        for i, item in enumerate(layers.modules):
            module = build(i, item)
            named = check.params(i, module)
            values = [p.detach() for _, p in named]
            trainable = [j for j, (_, p) in enumerate(named) if p.requires_grad]
            layout = FlatLayout.of(values, align=self.tensor_align)
            entry = LayerEntry([n for n, _ in named], layout, trainable)
            self._adopt(i, entry, values, factory)
            for _, p in named:
                p.data = empty_like_param(p)
            if device.type != "cpu":
                module.to(device)  # its buffers; the parameters are empty placeholders now
            self.modules.append(module)
            self.entries.append(entry)
        if not any(e.trainable for e in self.entries):
            raise RelayConfigError(
                "no layer has a parameter with requires_grad=True: there is nothing to train."
            )

    @staticmethod
    def make_optimizer(index: int, entry: LayerEntry, factory: OptimizerFactory) -> None:
        if not entry.masters:
            return
        opt = factory(list(entry.masters))
        if not isinstance(opt, torch.optim.Optimizer):
            raise RelayConfigError(
                f"the optimizer factory returned a {type(opt).__name__} for layer {index}; it "
                "must return a torch.optim.Optimizer over the parameters it is given, e.g. "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)."
            )
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        given = {id(p) for p in entry.masters}
        if held != given:
            raise RelayConfigError(
                f"the optimizer built for layer {index} holds {len(held & given)} of the "
                f"{len(given)} parameters it was given (and {len(held - given)} others); build "
                "it from its argument: optimizer=lambda params: torch.optim.AdamW(params, ...)."
            )
        entry.optimizer = opt

    # -- per tier ------------------------------------------------------------------------------
    def _adopt(
        self, index: int, entry: LayerEntry, values: list[torch.Tensor], factory: OptimizerFactory
    ) -> None:
        raise NotImplementedError

    def fetch(self, index: int, backward: bool) -> Fetched:
        raise NotImplementedError

    def prepare_update(self, fetched: Fetched) -> None:
        """Layer ``fetched.layer``'s backward starts: get ready for its update (SSD tier: read
        its optimizer state while the layer computes)."""

    def update(self, index: int, grads: list[torch.Tensor | None], fetched: Fetched) -> None:
        raise NotImplementedError

    def values(self, index: int, copy: bool = True) -> list[torch.Tensor]:
        """Layer ``index``'s current weights, in host memory (layout order). ``copy=False``
        may return the EPS's own tensors (for ``close(restore=True)``)."""
        raise NotImplementedError

    def host_bytes(self) -> int:
        """Host memory the EPS holds between steps (weights and optimizer state)."""
        return 0

    def close(self) -> None:
        pass

    def _step(self, entry: LayerEntry, grads: list[torch.Tensor | None]) -> None:
        """Run the optimizer on ``entry.masters`` (whose data the tier has put in place)."""
        for m, g in zip(entry.masters, grads):
            m.grad = g if g is None or g.device.type == "cpu" else g.to("cpu")
        with self.meter.waiting("update_seconds"):
            entry.optimizer.step()  # type: ignore[union-attr]
        for m in entry.masters:
            m.grad = None
        self.meter.add(updates=1)


class HostEPS(EPS):
    """Weights, gradients and optimizer state in host memory (the L2L paper's EPS).

    Each fetch copies the layer's weights into a fresh buffer on the compute device (on a CPU
    host, host memory: the copy is what a GPU host would send over the bus, and what the
    traffic counters count). With workers (RelayConfig.workers), copies run on a fetch worker.

    On the CPU the modules' own tensors become the masters (no copy). On a CUDA device (or
    with ``flat_on_cpu``, for tests) each layer's weights live in one buffer of its ``FlatLayout``,
    page-locked on a CUDA host, and the masters are views of it: a fetch is then one DMA copy
    of the whole layer instead of one pageable copy per tensor. Copies are synchronous
    (``copy_`` without ``non_blocking``): when a fetch's future is done its bytes are on the
    device, and the host buffer may change (the layer's next update) without a stream wait.
    """

    tier = "host"
    flat_on_cpu = False

    def __init__(self, layers, factory, device, meter, workers: bool):
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="tba-relay-fetch") if workers else None
        )
        self.async_fetch = workers
        self._flat = device.type != "cpu" or self.flat_on_cpu
        self._pin = device.type == "cuda"
        self._values: list[list[torch.Tensor]] = []
        self._hosts: list[torch.Tensor | None] = []  # with flat: each layer's host buffer
        super().__init__(layers, factory, device, meter)

    def _adopt(self, index, entry, values, factory):
        host = None
        if self._flat:
            host = self._host_buffer(entry.layout.nbytes)
            entry.layout.fill(host, values)
            values = entry.layout.views(host)
        self._hosts.append(host)
        self._values.append(values)  # without flat: the modules' own tensors, no copy
        entry.masters = [nn.Parameter(values[j]) for j in entry.trainable]
        self.make_optimizer(index, entry, factory)

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._pin:
            try:
                return alloc(nbytes, _CPU, pin=True)
            except RuntimeError as e:  # page-locked memory refused: pageable copies are slower
                log.warning("tba.relay: page-locked host memory refused (%s); using pageable", e)
                self._pin = False
        return alloc(nbytes, _CPU)

    def _copy(self, index: int) -> torch.Tensor:
        entry = self.entries[index]
        buf = alloc(entry.layout.nbytes, self.device)
        host = self._hosts[index]
        if host is not None:
            buf.copy_(host)
        else:
            entry.layout.fill(buf, self._values[index])
        self.meter.add(weight_bytes_moved=entry.layout.data_bytes, fetches=1)
        return buf

    def fetch(self, index: int, backward: bool) -> Fetched:
        nbytes = self.entries[index].layout.nbytes
        fut = self._pool.submit(self._copy, index) if self._pool else done(self._copy(index))
        return Fetched(index, fut, nbytes, self.meter, self.device)

    def update(self, index, grads, fetched):
        entry = self.entries[index]
        if entry.optimizer is not None:
            self._step(entry, grads)

    def values(self, index, copy=True):
        return [v.detach().clone() if copy else v for v in self._values[index]]

    def host_bytes(self) -> int:
        total = sum(v.numel() * v.element_size() for vs in self._values for v in vs)
        for e in self.entries:
            if e.optimizer is None:
                continue
            for st in e.optimizer.state.values():
                total += sum(
                    t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t)
                )
        return total

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
