"""The SSD tier of the EPS: weights and optimizer state in tba slab files, one layer in memory.

NOTE [SSD EPS]
1. Each layer has one extent for its weights (``FlatLayout`` of its parameters) and, from its
   first optimizer step on, one for its optimizer state: every tensor-valued entry of
   ``optimizer.state`` with at least one dimension, in (parameter, key) order. 0-dim entries
   (Adam's ``step``) and non-tensor entries stay in memory, inside the optimizer.
2. Every fetch reads the weights; when a layer's backward starts (``prepare_update``), its
   optimizer state is read while the layer computes (not when its weights are read ahead: one
   state less in memory). The update then works on the buffers read: the optimizer's
   master parameters and state entries become views of them, it steps in place, and both
   buffers are written back to their extents before the update returns. Then masters and
   state entries are empty placeholders again (NOTE [EPS contract] 4).
3. An optimizer that replaces a state tensor instead of updating it in place, or creates state
   (the first step), gets a new buffer; a state of another size gets a new extent, and the old
   one is freed at once (its bytes were read already, and only this update uses them).
4. Slabs are tba's nameless files (NOTE [Slabs] in tba/storage/slab.py): nothing is left on
   disk when the process ends, even by SIGKILL.
5. Reads and writes are asynchronous backend futures; the compute thread only waits in
   ``Fetched.wait()``, the update worker in ``update``.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError
from ..host.memory import as_memoryview
from ..storage.base import Backend, Extent
from ._eps import EPS, Fetched, LayerEntry, OptimizerFactory, empty_like_param
from ._layers import Layers
from ._layout import FlatLayout, alloc
from ._meter import Meter
from ._stash import refusal_text

__all__ = ["SSDEPS"]

_CPU = torch.device("cpu")


class _OnDisk:
    """One layer's extents and the checksums of what was written to them."""

    def __init__(self) -> None:
        self.weights: Extent | None = None
        self.weights_digest: int | None = None
        self.state: Extent | None = None
        self.state_digest: int | None = None
        self.state_layout: FlatLayout | None = None
        self.state_keys: list[tuple[int, str]] = []  # (master index, optimizer state key)


class SSDEPS(EPS):
    tier = "ssd"

    def __init__(
        self,
        layers: Layers,
        factory: OptimizerFactory,
        device: torch.device,
        meter: Meter,
        backend: Backend,
        checksum: str,
    ):
        self._backend = backend
        self._checksum = checksum
        self._align = backend.alignment
        self._disk: list[_OnDisk] = []
        super().__init__(layers, factory, device, meter)

    # -- extents -------------------------------------------------------------------------------
    def _allocate(self, nbytes: int, index: int, what: str) -> Extent:
        ext = self._backend.allocate(nbytes)
        if ext is None:
            raise CapacityError(
                f"tba.relay: the SSD EPS could not reserve {nbytes} bytes for layer {index}'s "
                f"{what} {refusal_text(self._backend)}. Free space on the spill filesystem, "
                "raise TBA_MAX_DISK_BYTES (or TBA_NODE_MAX_DISK_BYTES), or use eps='host'."
            )
        return ext

    def _write(self, ext: Extent, buf: torch.Tensor):
        return self._backend.write(ext, as_memoryview(buf), self._checksum)

    def _read(self, ext: Extent, buf: torch.Tensor, expect: int | None):
        return self._backend.read(ext, as_memoryview(buf), self._checksum, expect)

    # -- building ------------------------------------------------------------------------------
    def _adopt(self, index, entry, values, factory):
        layout = FlatLayout.of(values, self._align, self.tensor_align)
        entry.layout = layout
        buf = alloc(layout.nbytes, _CPU, self._align)
        layout.fill(buf, values)
        views = layout.views(buf)
        # The factory sees real tensors (shapes, dtypes), e.g. to group by ndim for decay.
        entry.masters = [torch.nn.Parameter(views[j]) for j in entry.trainable]
        self.make_optimizer(index, entry, factory)
        disk = _OnDisk()
        disk.weights = self._allocate(layout.nbytes, index, "weights")
        disk.weights_digest = self._write(disk.weights, buf).result()
        for m in entry.masters:
            m.data = empty_like_param(m)
        self._disk.append(disk)

    # -- fetch ---------------------------------------------------------------------------------
    def fetch(self, index: int, backward: bool) -> Fetched:
        entry, disk = self.entries[index], self._disk[index]
        buf = alloc(entry.layout.nbytes, _CPU, self._align)
        fut = self._read(disk.weights, buf, disk.weights_digest)
        self.meter.add(weight_bytes_moved=entry.layout.data_bytes, fetches=1)
        return Fetched(index, fut, entry.layout.nbytes, self.meter, self.device, host=buf)

    def prepare_update(self, fetched: Fetched) -> None:
        entry, disk = self.entries[fetched.layer], self._disk[fetched.layer]
        if entry.optimizer is None or disk.state is None or fetched.state is not None:
            return
        layout = disk.state_layout
        sbuf = alloc(layout.nbytes, _CPU, self._align)
        self.meter.hold("state", layout.nbytes)
        self.meter.add(state_bytes_read=layout.data_bytes)
        fetched.state = (sbuf, self._read(disk.state, sbuf, disk.state_digest), layout.nbytes)

    # -- update (NOTE [SSD EPS] 2-3) -----------------------------------------------------------
    def update(self, index, grads, fetched):
        entry, disk = self.entries[index], self._disk[index]
        if entry.optimizer is None:
            return
        fetched._future.result()  # the weights read (the compute thread waited for it already)
        views = entry.layout.views(fetched.host)
        for j, m in zip(entry.trainable, entry.masters):
            m.data = views[j]
        self.prepare_update(fetched)  # a no-op when the relay called it already
        state_buf, held = None, 0
        if fetched.state is not None:
            state_buf, fut, held = fetched.state
            fetched.state = None  # this update drops what it holds, below
            fut.result()
            self._load_state(entry, disk, state_buf)
        try:
            self._step(entry, grads)
            state_buf, held = self._pack_state(index, entry, disk, state_buf, held)
            w = self._write(disk.weights, fetched.host)
            s = self._write(disk.state, state_buf) if state_buf is not None else None
            disk.weights_digest = w.result()
            if s is not None:
                disk.state_digest = s.result()
            self.meter.add(
                weight_bytes_written=entry.layout.data_bytes,
                state_bytes_written=disk.state_layout.data_bytes if s is not None else 0,
            )
        finally:
            for m in entry.masters:
                m.data = empty_like_param(m)
            self._unload_state(entry, disk)
            self.meter.drop("state", held)

    def _state_tensors(self, entry: LayerEntry) -> list[tuple[int, str, torch.Tensor]]:
        out = []
        for i, m in enumerate(entry.masters):
            for key, value in entry.optimizer.state.get(m, {}).items():  # type: ignore[union-attr]
                if torch.is_tensor(value) and value.dim() > 0:
                    out.append((i, key, value))
        return out

    def _load_state(self, entry: LayerEntry, disk: _OnDisk, buf: torch.Tensor) -> None:
        state = entry.optimizer.state  # type: ignore[union-attr]
        for (i, key), view in zip(disk.state_keys, disk.state_layout.views(buf)):
            state[entry.masters[i]][key] = view

    def _unload_state(self, entry: LayerEntry, disk: _OnDisk) -> None:
        state = entry.optimizer.state  # type: ignore[union-attr]
        for i, key in disk.state_keys:
            st = state.get(entry.masters[i])
            if st is not None and torch.is_tensor(st.get(key)):
                st[key] = empty_like_param(st[key])

    def _pack_state(self, index, entry, disk, buf, held):
        """The buffer to write the state from (NOTE [SSD EPS] 3); returns it and bytes held."""
        found = self._state_tensors(entry)
        if not found:
            return None, held
        keys = [(i, k) for i, k, _ in found]
        tensors = [t for _, _, t in found]
        layout = disk.state_layout
        if buf is not None and keys == disk.state_keys and layout.matches(tensors):
            views = layout.views(buf)
            if all(t.data_ptr() == v.data_ptr() for t, v in zip(tensors, views)):
                return buf, held  # updated in place: write the buffer as it is
        new = FlatLayout.of(tensors, self._align)
        out = alloc(new.nbytes, _CPU, self._align)
        self.meter.hold("state", new.nbytes)
        new.fill(out, tensors)
        old = disk.state if layout is None or new.nbytes != layout.nbytes else None
        if disk.state is None or old is not None:
            disk.state = self._allocate(new.nbytes, index, "optimizer state")
        if old is not None:
            self._backend.free(old)  # nothing reads it: its layer's update is running now
        disk.state_layout, disk.state_keys = new, keys
        return out, held + new.nbytes

    # -- values and teardown -------------------------------------------------------------------
    def values(self, index, copy=True):  # a fresh read either way
        entry, disk = self.entries[index], self._disk[index]
        buf = alloc(entry.layout.nbytes, _CPU, self._align)
        self._read(disk.weights, buf, disk.weights_digest).result()
        return entry.layout.views(buf)

    def disk_bytes(self) -> int:
        total = 0
        for d in self._disk:
            total += d.weights.length if d.weights else 0
            total += d.state.length if d.state else 0
        return total

    def close(self) -> None:
        for d in self._disk:
            for ext in (d.weights, d.state):
                if ext is not None:
                    self._backend.free(ext)
            d.weights = d.state = None
