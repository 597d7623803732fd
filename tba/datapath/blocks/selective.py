"""The ``selective`` block action: recompute a block's cheap tensors, keep its matmul outputs.

# NOTE [Selective recompute]
``recompute`` runs a block's whole forward again in backward, about a third more of the block's
compute (a backward costs about twice its forward). Most of that time goes to its matrix products,
most of its saved bytes to the cheap tensors around them (norms, activations, residual sums,
dropout). ``selective`` is the per-tensor half of DELTA that Megatron's selective recompute and
torchtitan's op-level checkpointing do by hand: the block runs under the same non-reentrant
checkpoint as ``recompute`` (NOTE [Block policy] in tba/datapath/blocks/recompute.py), and in
forward a dispatch mode keeps the outputs of the ops in :data:`KEPT_OPS` (matrix products, fused
attention); the recompute in backward takes those from memory instead of computing them again, and
computes the rest.

1. What is kept: an output of a kept op that autograd saved in the block's forward (the counting
   hook of tba's checkpoint sees every saved tensor, so after the forward the cache drops the
   outputs nothing saved: in a pre-LN block without dropout the attention output projection's and
   the second MLP matrix's, which feed only residual sums, and which the recompute computes again or
   never reaches). Fused attention with dropout is computed again, never kept: its recompute draws
   the same mask from the restored RNG state, and skipping it would shift every later draw.
2. Exact: a kept output is the tensor the forward computed, and everything else is computed
   again from the same inputs under checkpoint's restored RNG and autocast state. The
   recompute takes a kept output only when the op is called with arguments of the same
   shapes, dtypes and devices, as its n-th call of that op, and its version is unchanged (an
   in-place op on it since): otherwise it computes the op, which is what ``recompute`` does.
3. Counted: the kept outputs stay resident from the block's forward to its backward, so they
   are charged to ``peak_resident_bytes`` as kept storages (``cached_bytes`` of the group's
   record) until the recompute starts; from then on they are part of what the recompute
   brings back (``hidden_bytes``), as for ``recompute``.
4. ``retain_graph=True`` works: the cache lives as long as the checkpoint's graph and hands
   out fresh aliases each time the block is recomputed.
5. Cost: the dispatch mode is Python on every op of the block, forward and recompute, a fixed
   cost per op; the recompute timer measures what the block's recompute then costs.
6. A compiled block (``torch.compile(block)``, or ``block.compile()``) is recomputed whole
   instead, and its action says ``recompute``: dynamo does not compile a frame while a Python
   dispatch mode is active, so under selective the block would lose its compiled code
   (tests/integrations/test_compile.py pins that a compiled block is recomputed whole).

Before a block has run ``selective``, the chooser (NOTE [Chooser] in tba/decide/chooser.py) needs
what it would keep: the pack hook marks a saved tensor whose autograd history, through views,
starts at one of these ops (:func:`kept_by_selective`), and the group's ``cacheable_bytes``
are those storages' bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["KEPT_OPS", "Selective", "compiled", "kept_by_selective"]

# aten ops whose outputs selective keeps: products a recompute would pay FLOPs for, per byte
KEPT_OPS = (
    "mm",
    "addmm",
    "_addmm_activation",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)

# the autograd nodes of those ops, for kept_by_selective
_KEPT_NODES = frozenset(
    {
        "MmBackward0",
        "AddmmBackward0",
        "AddmmActivationBackward0",
        "ScaledDotProductFlashAttentionBackward0",
        "ScaledDotProductFlashAttentionForCpuBackward0",
        "ScaledDotProductEfficientAttentionBackward0",
        "ScaledDotProductCudnnAttentionBackward0",
    }
)
# nodes of ops that return a view of their input: kept_by_selective looks through them
_VIEW_WORDS = (
    "View",
    "Transpose",
    "Split",
    "Select",
    "Slice",
    "Permute",
    "Expand",
    "Squeeze",
    "Unsqueeze",
    "AsStrided",
    "Alias",
    "Unbind",
    "Chunk",
    "TBackward",
    "Reshape",
)


def _packets() -> frozenset:
    got = (getattr(torch.ops.aten, name, None) for name in KEPT_OPS)
    return frozenset(p for p in got if p is not None)


_KEPT_PACKETS = _packets()


def kept_by_selective(t: torch.Tensor) -> bool:
    """True when ``t`` (a tensor autograd saves) is, through views, the output of an op in
    :data:`KEPT_OPS`: what ``selective`` would keep of it (NOTE [Selective recompute])."""
    fn = t.grad_fn
    for _ in range(16):
        if fn is None:
            return False
        name = type(fn).__name__
        if name in _KEPT_NODES:
            return True
        if not any(w in name for w in _VIEW_WORDS):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


def compiled(block: torch.nn.Module) -> bool:
    """True when ``block`` runs compiled code (``torch.compile(block)``, or ``block.compile()``
    in place). Dynamo does not compile frames while a Python dispatch mode is active, so under
    selective such a block would run eager: it is recomputed whole instead (point 6 of the
    NOTE), keeping its compiled code."""
    return isinstance(block, torch._dynamo.eval_frame.OptimizedModule) or (
        getattr(block, "_compiled_call_impl", None) is not None
    )


def _has_dropout(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when ``func`` draws random numbers here (fused attention with dropout_p > 0)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            p = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(p)
    return False


def _signature(args: tuple) -> tuple:
    return tuple(
        (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else None for a in args
    )


def _alias(x: Any) -> Any:
    """A fresh alias of a tensor, sharing its storage and version counter; anything else as is."""
    return x.detach() if isinstance(x, torch.Tensor) else x


def _tensors(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor)]


class Selective:
    """One block's cache for one forward and its recomputes (NOTE [Selective recompute]).

    ``contexts`` is checkpoint's ``context_fn``; ``saw(t)`` is told of each tensor autograd
    saves in the forward; ``settle()`` after the forward drops what nothing saved and returns
    the tensors kept; ``release`` is the charge's end (called when the recompute starts)."""

    def __init__(self, hold: Callable[[list[torch.Tensor]], list[Any]]):
        self.hold = hold
        self.cache: dict[tuple[Any, int], tuple[tuple, Any, tuple[int, ...]]] = {}
        self.saved: set[int] = set()
        self.held: list[Any] = []
        self.taken = self.computed = 0  # in recomputes: kept outputs taken, kept ops computed

    def contexts(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        return _Keep(self), _Take(self)

    def saw(self, t: torch.Tensor) -> None:
        self.saved.add(t.untyped_storage()._cdata)

    def settle(self) -> None:
        """The forward ended: keep the outputs autograd saved, and charge them."""
        kept: list[torch.Tensor] = []
        for key, (_, out, _) in list(self.cache.items()):
            ts = _tensors(out)
            if not any(t.untyped_storage()._cdata in self.saved for t in ts):
                del self.cache[key]
                continue
            kept.extend(ts)
        self.saved.clear()
        self.held = self.hold(kept)

    def release(self) -> None:
        self.held = []


class _Keep(TorchDispatchMode):
    """The forward: keeps the outputs of KEPT_OPS, numbered per op."""

    def __init__(self, sel: Selective):
        super().__init__()
        self.sel = sel
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _KEPT_PACKETS:
            n = self.calls.get(func, 0)
            self.calls[func] = n + 1
            if not _has_dropout(func, args, kwargs):
                kept = tree_map(_alias, out)
                versions = tuple(t._version for t in _tensors(out))
                self.sel.cache[(func, n)] = (_signature(args), kept, versions)
        return out


class _Take(TorchDispatchMode):
    """A recompute: the kept outputs instead of their ops, where they still match."""

    def __init__(self, sel: Selective):
        super().__init__()
        self.sel = sel
        self.calls: dict[Any, int] = {}

    def __enter__(self):
        self.calls = {}  # each recompute (retain_graph=True) numbers the calls afresh
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _KEPT_PACKETS:
            n = self.calls.get(func, 0)
            self.calls[func] = n + 1
            got = self.sel.cache.get((func, n))
            if got is not None:
                sig, kept, versions = got
                same = tuple(t._version for t in _tensors(kept)) == versions
                if same and sig == _signature(args):
                    self.sel.taken += 1
                    return tree_map(
                        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, kept
                    )
            self.sel.computed += 1
        return func(*args, **kwargs)
