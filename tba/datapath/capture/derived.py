"""Weight-derived saved tensors: recognised at pack, rebuilt from their parameter at unpack.

NOTE [Weight-derived tensors]
Under ``torch.autocast`` a ``Linear`` saves the low-precision cast of its weight (``W16.t()``,
``W16 = W.to(bfloat16)``). It is not a parameter, so the parameter filter (tba/decide/keep.py)
misses it, and without this rule it is written to disk every micro-batch although it is a
function of ``W`` alone. Such a tensor is recomputed at unpack instead. The rules:

1. *What qualifies.* ``t`` saved by autograd with ``B = t._base or t`` (the tensor that owns
   ``t``'s storage) such that ``B.grad_fn`` is a materialising copy (``ToCopyBackward0``:
   ``.to(dtype)``, autocast's cast; ``CloneBackward0``: ``clone``, ``contiguous``), whose one
   input reaches, through view nodes only (``t()``, ``transpose``, ``permute``, slicing,
   ``view``, ...), the ``AccumulateGrad`` of a parameter (a ``nn.Parameter``, or a tensor of
   the model given to ``step()``) on the same device. The graph says this and nothing else
   can: an in-place op on ``B`` under grad mode replaces ``B.grad_fn``, and one under
   ``no_grad`` bumps the version counter, so ``t._version`` must still be 0. Recognising costs
   one ``grad_fn`` lookup for every other saved tensor (activations fail at the first test),
   small next to the rest of the pack hook, and one more GC-tracked object per saved tensor, the
   producer node's Python object, which autograd keeps as long as the node
   (benchmarks/bench_hotpath.py counts it).
2. *The recipe.* The view nodes are replayed on the detached parameter once, at pack, to learn
   the geometry (size, stride, storage offset) of the copy's input in the parameter's storage.
   At unpack: an empty tensor with ``B``'s size and strides, ``copy_`` from that view of the
   parameter (what ``_to_copy`` and ``clone`` themselves do, so the values are the same bits),
   then ``t``'s view of it. Nothing is held but the parameter, which autograd's
   ``AccumulateGrad`` holds anyway.
3. *Guards.* ``t``'s version counter is witnessed (NOTE [Version witness] in tba/records/handle.py),
   so an edit of the saved tensor raises as stock PyTorch does. The parameter's version at pack is
   compared at every unpack: an in-place change of the parameter between forward and backward
   (``optimizer.step()`` too early, ``W.add_()`` under ``no_grad``) raises the same in-place
   error that autograd raises for a saved parameter in full precision, where stock autocast
   would silently use the stale cast. A parameter whose storage was replaced or resized
   (``W.data = ...``, sharded parameters gathered and freed) raises ``tba.UnpackError``
   naming ``TBA_RECOMPUTE_WEIGHTS=0``, which turns this rule off.
4. *Boundary.* Rules 1 to 3 need a graph that links the tensor to a parameter; tensors made
   by two copies in a row are not recognised.
   A parameter edited in place after its cast was made and before that cast is saved (a cast
   reused from autocast's cache across such an edit) is not detected; stock autocast then
   computes with the stale cast, tba with the new weights. Writes through ``.data`` bypass
   version counters here as everywhere (docs/how-it-works.md, "In-place checks").
5. *Frozen parameters.* A cast of a parameter with ``requires_grad=False`` has no ``grad_fn``:
   nothing in the graph says where it came from, so it is recognised by its values, checked,
   never assumed (:class:`FrozenCasts`). Each step that is given its model indexes the model's
   frozen floating-point parameters by the storage size of their casts to the other floating
   dtypes (bf16, f16, f32). A saved tensor without ``grad_fn`` whose storage size is not in
   that set is rejected by one set lookup (the cost every other saved tensor pays while such a
   model runs). A candidate ``B`` (``t._base or t``: at version 0, owning all its storage from
   offset 0, contiguous, with a frozen parameter's shape and strides on its device, in another
   floating dtype) is compared with a few sampled elements of each such parameter's cast
   (cached while the parameter's version stands), then bit for bit, as integers (so -0.0 and
   NaN payloads count), with ``param.to(B.dtype)``, chunk by chunk so the transient copy stays
   small; on a GPU the comparison waits for the device, once per candidate storage. Only an
   exact match is rebuilt (rule 2, from the whole parameter, and ``t``'s view of that); a
   tensor that differs anywhere is an activation like any other. The outcome is remembered
   for the step by storage identity (weakly, so a freed storage is never mistaken for a new
   one) and, for a match, the parameter's version: the same copy saved again is not compared
   again. Rule 3's guards apply as they are: an in-place change of the frozen parameter between
   forward and backward raises autograd's in-place error, as for a saved fp32 parameter. Not
   covered: parameters that are not contiguous, steps opened without their model, and
   quantized weights (bitsandbytes keeps what its matmuls need on the autograd context, out of
   the hooks' sight: docs/how-it-works.md).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from ...errors import UnpackError, modified_error
from ...records.handle import witness
from ...records.step import StorageRef

_MATERIALISE = frozenset({"ToCopyBackward0", "CloneBackward0"})
# View nodes replayed from their saved arguments; SIZED ones take the next node's input size.
_VIEWS = frozenset(
    {
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "AliasBackward0",
    }
)
_SIZED = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ExpandBackward0", "ReshapeAlias0"})
_ACC = "AccumulateGrad"
_MAX_VIEWS = 8

_MATERIAL_TYPES: dict[type, bool] = {}  # grad_fn class -> is a materialising copy


def _materialises(node: Any) -> bool:
    tp = type(node)
    hit = _MATERIAL_TYPES.get(tp)
    if hit is None:
        hit = _MATERIAL_TYPES[tp] = tp.__name__ in _MATERIALISE
    return hit


class Derived:
    """What the pack hook hands autograd for a weight-derived tensor: how to rebuild it from
    its parameter, and the versions that must not have moved (NOTE [Weight-derived tensors])."""

    __slots__ = ("param", "pversion", "pkey", "src", "base", "view", "dtype", "version")
    __slots__ += ("witness", "nbytes")

    def __init__(self, param: torch.Tensor, src: tuple, base: torch.Tensor, t: torch.Tensor):
        self.param = param
        self.pversion = param._version
        self.pkey = _param_key(param)
        self.src = src  # (size, stride, storage_offset) of the copy's input in param's storage
        self.base = (base.shape, base.stride())
        self.dtype = base.dtype
        same = t is base
        self.view = None if same else (t.shape, t.stride(), t.storage_offset())
        self.version = t._version
        self.witness = witness(t)
        self.nbytes = base.untyped_storage().nbytes()

    def rebuild(self) -> torch.Tensor:
        """The saved tensor, computed again from the parameter (after the guards)."""
        now = self.witness._version
        if now != self.version:
            size = self.view[0] if self.view is not None else self.base[0]
            raise modified_error(size, self.dtype, now, self.version)
        p = self.param
        if p._version != self.pversion:
            raise modified_error(p.shape, p.dtype, p._version, self.pversion, what="parameter")
        if _param_key(p) != self.pkey:
            raise UnpackError(
                "tba.unpack: a saved tensor derived from a parameter of shape "
                f"{list(self.pkey[2])} is recomputed from it at backward, but that parameter's "
                "storage was replaced or resized since the forward (param.data = ..., or a "
                "sharded parameter freed). Keep parameters in place between forward and "
                "backward, or set TBA_RECOMPUTE_WEIGHTS=0 to offload such tensors instead."
            )
        with torch.no_grad():
            out = torch.empty_strided(*self.base, dtype=self.dtype, device=p.device)
            out.copy_(p.detach().as_strided(*self.src))
        if self.view is not None:
            out = out.as_strided(*self.view)
        return out


def _param_key(p: torch.Tensor) -> tuple:
    s = p.untyped_storage()
    return (s._cdata, s.nbytes(), p.shape, p.stride(), p.storage_offset(), p.dtype)


def derived(t: torch.Tensor, param_storages: frozenset[int]) -> Derived | None:
    """A :class:`Derived` recipe when ``t`` is computed from a parameter alone by a cast or a
    copy and views (NOTE [Weight-derived tensors], rule 1), else None."""
    base = t._base
    b = t if base is None else base
    node = b.grad_fn
    if node is None or not _materialises(node):
        return None
    if t._version or b.storage_offset() or b.is_complex() or b.layout is not torch.strided:
        return None
    views: list[Any] = []
    nxt = node.next_functions
    while True:
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        node = nxt[0][0]
        name = type(node).__name__
        if name == _ACC:
            break
        if (name not in _VIEWS and name not in _SIZED) or len(views) == _MAX_VIEWS:
            return None
        views.append(node)
        nxt = node.next_functions
    p = node.variable
    if p.device != b.device or p.layout is not torch.strided:
        return None
    if not isinstance(p, torch.nn.Parameter) and p.untyped_storage()._cdata not in param_storages:
        return None
    try:
        src = _replay(p.detach(), views, b.shape)
    except RuntimeError:  # a view that does not replay as recorded: not recognised
        return None
    if src is None or src.shape != b.shape:
        return None
    return Derived(p, (src.shape, src.stride(), src.storage_offset()), b, t)


def _replay(v: torch.Tensor, views: list[Any], out_shape: torch.Size) -> torch.Tensor | None:
    """The view nodes (outermost first in ``views``) applied to ``v`` from the parameter out."""
    for i in range(len(views) - 1, -1, -1):
        node = views[i]
        name = type(node).__name__
        if name in _SIZED:  # its output size: the input size of the next node out, or B's
            size = out_shape if i == 0 else getattr(views[i - 1], "_saved_self_sym_sizes", None)
            if size is None:
                return None
            v = v.expand(size) if name == "ExpandBackward0" else v.view(size)
        elif name == "TBackward0":
            v = v.t()
        elif name == "TransposeBackward0":
            v = v.transpose(node._saved_dim0, node._saved_dim1)
        elif name == "PermuteBackward0":
            v = v.permute(node._saved_dims)
        elif name == "SliceBackward0":
            start, end, step = node._saved_start, node._saved_end, node._saved_step
            v = torch.ops.aten.slice.Tensor(v, node._saved_dim, start, end, step)
        elif name == "SelectBackward0":
            v = v.select(node._saved_dim, node._saved_index)
        elif name == "UnsqueezeBackward0":
            v = v.unsqueeze(node._saved_dim)
        elif name == "AliasBackward0":
            v = v.alias()
        else:  # SqueezeBackward*: the output size is known, squeezing is a view to it
            size = out_shape if i == 0 else getattr(views[i - 1], "_saved_self_sym_sizes", None)
            if size is None:
                return None
            v = v.view(size)
    return v


# -- rule 5: casts of frozen parameters -----------------------------------------------------------
_CAST_TO = (torch.bfloat16, torch.float16, torch.float32)  # what autocast casts to
_FROM = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_SAMPLES = 8
_CHUNK = 1 << 18  # elements cast and compared at a time on the CPU: a cache-sized scratch
_CHUNK_DEVICE = 1 << 24  # on a GPU, where each comparison waits for the device


class _ModelIndex:
    """One model's frozen parameters, by the storage size of each cast (rule 5)."""

    __slots__ = ("storages", "params", "flags", "by_size", "sizes", "prints")

    def __init__(self, model: torch.nn.Module, storages: frozenset[int]):
        self.storages = storages  # the ModelStorages set this index was built against
        self.params = list(model.parameters())
        self.flags = [p.requires_grad for p in self.params]
        self.by_size: dict[int, list[torch.Tensor]] = {}
        for p in self.params:
            if _frozen(p):
                for d in _CAST_TO:
                    if d is not p.dtype:
                        self.by_size.setdefault(p.numel() * d.itemsize, []).append(p)
        self.sizes = frozenset(self.by_size)
        # (id(param), dtype) -> (param version, sampled bits of its cast)
        self.prints: dict[tuple[int, torch.dtype], tuple[int, list[int]]] = {}

    def current(self, storages: frozenset[int]) -> bool:
        """Nothing registered or replaced (ModelStorages hands back the same set), and no
        parameter frozen or unfrozen since."""
        return storages is self.storages and self.flags == [p.requires_grad for p in self.params]


def _frozen(p: torch.Tensor) -> bool:
    return (
        not p.requires_grad
        and type(p) is torch.nn.Parameter
        and p.dtype in _FROM
        and p.layout is torch.strided
        and (p.is_cpu or p.is_cuda)
        and p.numel() > 0
        and p.is_contiguous()
    )


class FrozenCasts:
    """Recognises saved casts of the step's model's frozen parameters (rule 5 of NOTE
    [Weight-derived tensors]). ``sizes`` is the pack hook's precheck: empty outside a step, for
    a step without a model, or with TBA_RECOMPUTE_WEIGHTS=0."""

    __slots__ = ("sizes", "_index", "_known", "_seen")

    def __init__(self) -> None:
        self.sizes: frozenset[int] = frozenset()
        self._index: _ModelIndex | None = None
        self._known: weakref.WeakKeyDictionary[torch.nn.Module, _ModelIndex]
        self._known = weakref.WeakKeyDictionary()
        # storage cdata -> (its weak reference, the parameter it matched or None, that version)
        self._seen: dict[int, tuple[StorageRef, torch.Tensor | None, int]] = {}

    def begin(self, model: torch.nn.Module, storages: frozenset[int]) -> None:
        """A step of ``model`` starts; ``storages``: its parameters' and buffers' storages."""
        index = self._known.get(model)
        if index is None or not index.current(storages):
            index = self._known[model] = _ModelIndex(model, storages)
        self._index = index
        self.sizes = index.sizes

    def end(self) -> None:
        """The step's forward ended: nothing more to recognise, and nothing held."""
        self.sizes = frozenset()
        self._index = None
        self._seen.clear()

    def derived(self, t: torch.Tensor, storage: Any) -> Derived | None:
        """A :class:`Derived` recipe when ``t`` (no grad_fn; its storage size in ``sizes``) is a
        frozen parameter's cast, or a view of one, bit for bit; else None."""
        base = t._base
        b = t if base is None else base
        index = self._index
        if index is None or b.requires_grad or t._version or b.storage_offset():
            return None
        if t.dtype is not b.dtype:  # a view as another dtype: rule 2 rebuilds B's dtype only
            return None
        cdata = storage._cdata
        seen = self._seen.get(cdata)
        if seen is not None and not seen[0].expired():
            p = seen[1]
            if p is None:
                return None  # compared already: not a cast
            if p._version != seen[2] or b.dtype is p.dtype or not _fits(b, p):
                p = self._match(index, b, storage.nbytes())  # changed since: compare again
        else:
            p = self._match(index, b, storage.nbytes())
        self._seen[cdata] = (StorageRef(storage), p, -1 if p is None else p._version)
        if p is None:
            return None
        return Derived(p, (p.shape, p.stride(), p.storage_offset()), b, t)

    def _match(self, index: _ModelIndex, b: torch.Tensor, nbytes: int) -> torch.Tensor | None:
        if b.numel() * b.element_size() != nbytes or b.dtype not in _BITS:
            return None
        dtype = b.dtype
        found = [p for p in index.by_size.get(nbytes, ()) if p.dtype is not dtype and _fits(b, p)]
        if not found:
            return None
        picks = _picks(b.numel(), b.device)
        bits = b.take(picks).view(_BITS[dtype]).tolist()
        for p in found:
            if _print(index, p, dtype, picks) == bits and _same_bits(b, p):
                return p
        return None


def _fits(b: torch.Tensor, p: torch.Tensor) -> bool:
    """``b`` has ``p``'s geometry on ``p``'s device, as ``p.to(dtype)`` does."""
    return b.shape == p.shape and b.stride() == p.stride() and b.device == p.device


def _picks(n: int, device: torch.device) -> torch.Tensor:
    """Flat indices of the sampled elements: spread over the tensor, both ends included."""
    k = min(n, _SAMPLES)
    at = [0] if k == 1 else [i * (n - 1) // (k - 1) for i in range(k)]
    return torch.tensor(at, device=device)


def _print(
    index: _ModelIndex, p: torch.Tensor, dtype: torch.dtype, picks: torch.Tensor
) -> list[int]:
    """The sampled elements of ``p.to(dtype)``, as integers, cached while ``p``'s version
    stands."""
    key = (id(p), dtype)
    got = index.prints.get(key)
    if got is not None and got[0] == p._version:
        return got[1]
    with torch.no_grad():
        bits = p.detach().take(picks).to(dtype).view(_BITS[dtype]).tolist()
    index.prints[key] = (p._version, bits)
    return bits


def _same_bits(b: torch.Tensor, p: torch.Tensor) -> bool:
    """``b`` holds exactly the bits of ``p.to(b.dtype)`` (both contiguous, same shape). The
    cast is made chunk by chunk into one scratch buffer with ``copy_``, the kernel ``to()``
    itself runs; on the CPU the bytes are compared with ``memcmp``."""
    flat_b, flat_p = b.detach().view(-1), p.detach().view(-1)
    n = flat_b.numel()
    cpu = b.is_cpu and _memcmp is not None
    step = _CHUNK if b.is_cpu else _CHUNK_DEVICE
    scratch = torch.empty(min(n, step), dtype=b.dtype, device=b.device)
    bits, size = _BITS[b.dtype], b.element_size()
    with torch.no_grad():
        for i in range(0, n, step):
            m = min(step, n - i)
            cast = scratch[:m]
            cast.copy_(flat_p[i : i + m])
            mine = flat_b[i : i + m]
            if cpu:
                if _memcmp(mine.data_ptr(), cast.data_ptr(), m * size):  # type: ignore[misc]
                    return False
            elif not torch.equal(mine.view(bits), cast.view(bits)):
                return False
    return True


def _libc_memcmp() -> Any:
    try:
        f = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # pragma: no cover - no C library to call: torch.equal
        return None
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return f


_memcmp = _libc_memcmp()
