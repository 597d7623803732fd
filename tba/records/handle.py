"""What the pack hook hands autograd for an offloaded or kept tensor, and where a saved
view's bytes sit in its entry's buffer.

A handle is a view's geometry (dtype, size, stride, offset) into an entry's bytes, plus what
checks that the tensor was not modified in place since its pack (NOTE [Version witness]).
See NOTE [Entries and handles] in tba/records/entry.py.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

from ..errors import modified_error
from .entry import Entry
from .step import StorageRef

# -- where a saved view's bytes are ------------------------------------------------------------


def is_dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when the strided view covers exactly ``numel`` consecutive elements (any order)."""
    dims = sorted((st, sz) for sz, st in zip(size, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def layout(
    t: torch.Tensor, storage_nbytes: int, stride: tuple[int, ...] | None = None
) -> tuple[bool, int, tuple[int, ...], int]:
    """How to capture ``t``: (whole_storage, nbytes, stride_in_buffer, offset_in_buffer).
    ``stride``: ``t.stride()`` when the caller has it (returned as is when it is kept).

    - The whole storage when ``t`` covers all of it, or is a non-dense view spanning at least
      half of it (q/k/v slices): views are rebuilt on the restored storage with their exact
      strides, and other views of the same storage share the capture.
    - Otherwise only ``t``'s elements: in memory order with the same strides when ``t`` is
      dense, else contiguously.
    """
    size, item = t.shape, t.element_size()
    if stride is None:
        stride = t.stride()
    view_bytes = t.numel() * item
    if view_bytes == storage_nbytes:
        return True, storage_nbytes, stride, t.storage_offset()
    if is_dense(size, stride):
        return False, view_bytes, stride, 0
    span = (sum((n - 1) * s for n, s in zip(size, stride)) + 1) * item
    if 2 * span >= storage_nbytes:
        return True, storage_nbytes, stride, t.storage_offset()
    return False, view_bytes, contiguous_stride(size), 0


def contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(size):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


# NOTE [Version witness]
# Stock PyTorch raises at backward when a saved tensor was modified in place after it was
# saved, because its SavedVariable keeps the tensor, and with it the tensor's version counter.
# tba must not keep the tensor (that is the memory it frees), but it can keep the counter: a
# *witness* is ``t.detach()`` (which shares t's version counter) whose data is then replaced
# by an empty tensor through ``.data`` (which keeps the counter and bumps nothing). It holds no
# bytes of t, outlives t, and its ``_version`` moves whenever t, or any view sharing t's
# counter, is modified in place. Every unpack of a handle compares it with the version at
# pack, whatever path its bytes took (forwarded, staged, written directly or coalesced, read
# back or prefetched), so an edit raises stock PyTorch's error in every timing. Cost: a detach
# and one small tensor object per handle, little next to the rest of the pack hook.
_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def witness(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter and none of its memory."""
    w = t.detach()
    key = (t.dtype, t.device)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    w.data = empty
    return w


class Handle:
    """An offloaded saved tensor: geometry into its entry's bytes, the pack-time version and
    a witness of the tensor's version counter (NOTE [Version witness])."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "version", "ref", "key", "packs")
    __slots__ += ("witness", "stat", "__weakref__")

    def __init__(self, entry: Entry, t: torch.Tensor, stride, offset: int, key: Any, stat: Any):
        self.entry = entry
        self.stat = (
            stat  # the GroupStat its unpacks time (NOTE [Backward timing] in tba/records/step.py)
        )
        self.dtype = t.dtype
        self.size = key[2]  # the key's torch.Size, shared
        self.stride = stride  # a tuple from layout()
        self.offset = offset
        self.version = t._version
        self.ref = weakref.ref(t)
        self.witness = witness(t)
        self.key = key
        self.packs = 1
        entry.handles += 1

    def __del__(self) -> None:
        try:
            e = self.entry
            e.graveyard.append((self.key, e, self.packs))  # NOTE [Deferred release]
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def check_version(self) -> None:
        """Raise stock PyTorch's error if the tensor was modified in place since its pack,
        alive or not (NOTE [Version witness])."""
        now = self.witness._version
        if now != self.version:
            raise modified_error(self.size, self.dtype, now, self.version)

    def live_original(self) -> torch.Tensor | None:
        """The packed tensor itself while it is alive (forwarding; check_version first)."""
        return self.ref()

    def view_of(self, buf: torch.Tensor) -> torch.Tensor:
        """This handle's tensor as a view of the uint8 buffer ``buf`` (zero-copy)."""
        base = buf.storage_offset() // self.dtype.itemsize
        out = torch.empty(0, dtype=self.dtype, device=buf.device)
        return out.set_(buf.untyped_storage(), base + self.offset, self.size, self.stride)


# NOTE [Passed through]
# Autograd checks a saved tensor's version when backward unpacks it, unless saved-tensor hooks
# are installed: then it leaves the check to the hooks. What tba's pack returns as it is (a
# parameter, a view of one, another grad-requiring leaf, a model buffer, a tensor tba cannot
# capture) would come back unchecked, so a parameter changed in place between forward and backward
# (an optimizer step, a weight update under no_grad) would give a silently wrong gradient where
# stock PyTorch raises. Such a tensor is packed as a Passed, which records the version at pack, as
# autograd's SavedVariable does at the same moment, and raises stock's error at unpack when the
# tensor's version counter has moved since. It holds the tensor, which something else holds anyway
# (NOTE [No cycle through the graph] for one that is not a leaf).


# NOTE [No cycle through the graph]
# A handle that holds a saved tensor which has a grad_fn (a kept intermediate, or an output its
# own node saves) would close a cycle: tensor -> grad_fn -> its SavedVariable -> handle ->
# tensor. Part of it is in C++, where Python's GC cannot see it, so a graph dropped without a
# backward would never be freed. Autograd itself saves an output without its grad_fn; a handle
# holds ``t.detach()``, which shares the storage and the version counter (the version check
# sees every in-place change of ``t``) and has no grad_fn. Unpack returns that alias: autograd
# gives an unpacked tensor its place in the graph again, as it does for bytes read back.
class Passed:
    """A saved tensor tba does not move, with its version at pack (NOTE [Passed through])."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor, leaf: bool = False):
        """``leaf``: a parameter, a view of one or another grad-requiring leaf, held as it is
        (its views' grad_fn is the view's, no cycle); anything else as NOTE [No cycle through
        the graph] says."""
        self.tensor = t if leaf or t.grad_fn is None else t.detach()
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            shape = ("nested",) if t.is_nested else t.shape
            base = t if t._base is None else t._base
            leaf = t.requires_grad and base.is_leaf
            what = "saved parameter or leaf" if leaf else "saved tensor"
            raise modified_error(shape, t.dtype, t._version, self.version, what)
        return t


def kept_alias(t: torch.Tensor) -> torch.Tensor:
    """What a kept handle holds: ``t``, or ``t.detach()`` when ``t`` has a grad_fn (NOTE [No
    cycle through the graph])."""
    return t if t.grad_fn is None else t.detach()


class KeptEntry(StorageRef):
    """Accounting for a storage that stays resident because kept handles reference it. It is
    also the storage's weak reference (a StorageRef), so that a kept storage is one object for
    the cyclic GC, and its address cannot be reused while the record exists (NOTE [Storage
    identity] in tba/records/index.py)."""

    __slots__ = ("graveyard", "sid", "nbytes", "handles")

    def __init__(self, storage: Any, graveyard: deque, sid: int, nbytes: int):
        super().__init__(storage)
        self.graveyard = graveyard
        self.sid = sid  # the storage's StorageImpl address (``cdata`` is the weak reference)
        self.nbytes = nbytes
        self.handles = 0


class KeptHandle:
    """A saved tensor tba keeps in memory. Holds it, and checks its version on unpack. Kept
    handles are not in the dedup index: saving a kept view again makes another kept handle on
    the same KeptEntry (the storage is charged once)."""

    __slots__ = ("tensor", "version", "entry", "stat")

    def __init__(self, alias: torch.Tensor, version: int, entry: KeptEntry, stat: Any = None):
        """``alias``: the saved tensor, or without its grad_fn (:func:`kept_alias`);
        ``version``: the saved tensor's at pack."""
        self.tensor = alias
        self.version = version
        self.entry = entry
        self.stat = (
            stat  # the GroupStat its unpacks time (NOTE [Backward timing] in tba/records/step.py)
        )
        entry.handles += 1

    def __del__(self) -> None:
        try:
            self.entry.graveyard.append((None, self.entry, 0))  # NOTE [Deferred release]
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise modified_error(t.shape, t.dtype, t._version, self.version)
        return t


class Credit:
    """The resident charge of a block run without tba's hooks (NOTE [Kept blocks without hooks]
    in tba/datapath/blocks/kept.py): ``nbytes`` charged until :meth:`release`, and the kept
    handles (``held``) on the storages it registered. Released once: by the hook that sees
    backward leave the block, or when the graph that holds that hook is freed."""

    __slots__ = ("graveyard", "nbytes", "held", "done")

    def __init__(self, graveyard: deque, nbytes: int):
        self.graveyard = graveyard
        self.nbytes = nbytes
        self.held: list[KeptHandle] | None = None
        self.done = False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.held = None  # their own releases go through the graveyard too
            self.graveyard.append((None, self, 0))  # NOTE [Deferred release]

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
