"""Block-level recompute: tba runs a block under activation checkpointing for one step.

# NOTE [Block policy]
Each block of a step (NOTE [Groups] in tba/datapath/blocks/groups.py) gets one action: ``keep`` (its
saved tensors stay resident), ``offload`` (written to disk, read back ahead of backward) or
``recompute`` (the block runs under ``torch.utils.checkpoint(use_reentrant=False)``: what it saves
is dropped after its forward and computed again in backward), or ``recompute_offload`` (recomputed
too, but the inputs its checkpoint saves are offloaded like any saved tensor instead of kept:
DELTA's swap of the checkpoints, for when even those do not fit the budget and the disk has the
time). ``TBA_POLICY`` picks the actions (offload: the last ``TBA_KEEP_LAST`` blocks kept, the others
offloaded, the keep-last rule; recompute, keep: every block; auto: the chooser, NOTE [Chooser] in
tba/decide/chooser.py), and ``TBA_BLOCK_POLICY`` forces some blocks. A group between or after blocks
follows the block before it when that block is kept, and is offloaded otherwise (it cannot be
recomputed).
How recompute is done, and why it is exact:

1. The wrapper is installed when the step's forward starts, as an instance attribute
   ``forward`` of the block, and removed when the forward ends (the model's code does not
   change; an instance ``forward`` the block already had is put back). tba's forward pre-hook
   and forward hook run around it, outside the checkpoint.
2. Autograd consults only the innermost ``saved_tensors_hooks``. Checkpoint saves the block's
   inputs first, under tba's hooks (so tba packs them, in the block's group, and keeps them
   resident: kept reason ``recompute``, what a checkpointed block costs; with
   ``recompute_offload`` it offloads them, and backward's recompute unpacks them from disk
   first), then pushes its own
   hook for the forward: nothing the block saves reaches tba's pack. In backward the
   recompute runs under checkpoint's recomputation hook, also innermost, so its saves never
   reach tba either, even when a tba step is active in that thread.
3. ``preserve_rng_state=True``: checkpoint stashes the CPU (and device) RNG state before the
   forward and restores it for the recompute inside ``fork_rng``, so dropout masks match bit
   for bit and the caller's RNG stream is the same as without recompute.
4. A block the user already checkpoints is left as it is: when the block is entered and the
   innermost saved-tensors hooks are not tba's (the user's checkpoint, ``save_on_cpu``, or a
   recompute in backward), or grad is off (a reentrant checkpoint, such as megatron-core's
   ``recompute_granularity="full"``, runs the block without grad and pushes no hooks), or
   the block is a transformers layer with ``gradient_checkpointing`` on (transformers 5
   checkpoints the class's ``forward`` inside the call, after the module hooks, so no
   checkpoint runs yet when the block is entered), the wrapper calls the plain forward and
   the block's action is recorded as ``user``.
5. While the checkpointed forward runs, a hook chained over checkpoint's own (pack: count,
   then checkpoint's pack; unpack: checkpoint's) counts what the block saves, once per storage
   per step and parameters excluded, into ``saved_bytes`` (what stays resident without tba)
   and the group's ``hidden_bytes``: what the recompute brings back in backward. It runs once
   per block and signature (its inputs' shapes, dtypes and devices, its other arguments, its
   training flag and autocast's state): a later step of the same signature saves the same
   tensors, and is credited the bytes measured then (the outputs the block saved itself are
   marked as counted, so that the next block's checkpoint does not count them again). A
   selective block chains it every step: selective sees what each op saves.
6. While dynamo traces the wrapper (the block runs inside a compiled region: a whole-model
   ``torch.compile``, or ``block.compile()`` in place), it calls the plain forward at once and
   reads nothing of tba, so the graphs are those of the model without tba (with
   ``fullgraph=True`` too). Such a block is not recomputed: the region saves its tensors
   itself, and tba sees no block start inside it. tba then warns once naming the fix and
   groups that model by pack-order windows (NOTE [Compiled regions] in
   tba/datapath/blocks/groups.py). The wrappers are still installed every step, so the compiled
   code's guards on ``forward`` hold. Compile each block as a module of its own
   (``model.layers[i] = torch.compile(model.layers[i])``) and the wrapper runs eagerly around
   it: the block is recomputed, its recompute running the compiled block again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from ...config import SELECTIVE
from ...records.step import GroupStat, StepState
from .selective import Selective, kept_by_selective

USER = "user"  # the action recorded for a block someone else already checkpoints


def foreign_hooks_innermost(top: Any = False) -> bool:
    """True when the innermost saved-tensors hooks (``top``, found when not given) are someone
    else's than tba's (tba.datapath.hook.OffloadHooks): a checkpoint's, ``save_on_cpu``'s, a
    recompute's."""
    if top is False:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    return not getattr(getattr(top[0], "__self__", None), "tba_offload_hooks", False)


def user_checkpointed(block: nn.Module | None, top: Any = False) -> bool:
    """True when the block entered now runs under someone else's checkpoint (item 4 of NOTE
    [Block policy]): foreign saved-tensor hooks innermost, grad off (a reentrant checkpoint
    pushes no hooks), or a transformers layer with gradient checkpointing on (transformers 5
    checkpoints the class's ``forward`` inside the module call, so at the block's hooks no
    checkpoint is running yet)."""
    if foreign_hooks_innermost(top) or not torch.is_grad_enabled():
        return True
    if block is None or not block.training:
        return False
    on = block.__dict__.get("gradient_checkpointing")  # no Module.__getattr__ on a miss
    if on is None:
        on = getattr(type(block), "gradient_checkpointing", False)
    return on is True


class Recompute:
    """Installs and removes the recompute wrappers of a step's blocks (see the NOTE).

    ``count(t, step)`` counts a tensor the checkpointed forward saves into ``step`` and returns
    the bytes it added (0 for parameters and storages already counted); ``seen(step, tensors)``
    marks storages counted without adding bytes; ``recomputing(step, stat)`` is told when
    backward recomputes the block of ``stat``.
    """

    def __init__(
        self,
        count: Callable[[torch.Tensor, StepState], int],
        recomputing: Callable[[StepState, GroupStat], None],
        hold: Callable[[StepState, GroupStat, list[torch.Tensor]], list[Any]] | None = None,
        seen: Callable[[StepState, list[torch.Tensor]], None] | None = None,
        measure_cacheable: bool = False,
    ):
        self.count = count
        self.recomputing = recomputing
        # charges the tensors a selective block keeps; returns what holds the charge
        self.hold = hold or (lambda step, stat, ts: [])
        # marks tensors' storages as counted in a step's saved_bytes, without adding bytes
        self.seen = seen or (lambda step, ts: None)
        self.measure_cacheable = measure_cacheable  # only the chooser (auto) weighs it
        # block -> signature -> what its checkpointed forward saved (item 5 of the NOTE)
        self.measured: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Saved]] = (
            weakref.WeakKeyDictionary()
        )

    def install(
        self, block: nn.Module, where: Callable[[], tuple[Any, Any]], action: str = "recompute"
    ) -> Callable[[], None]:
        """Wrap ``block.forward``; ``where()`` gives the (StepState, GroupStat) of the block's
        group when it runs; ``action`` is one of RECOMPUTED (``selective``: NOTE [Selective
        recompute] in tba/datapath/blocks/selective.py). Returns the function that removes the
        wrapper."""
        had = "forward" in block.__dict__
        prev = block.__dict__.get("forward")
        inner = block.forward
        owner = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return inner(*args, **kwargs)  # traced: the plain forward (item 6 of the NOTE)
            step, stat = where()
            if step is None or user_checkpointed(block):
                return inner(*args, **kwargs)  # no grad, or the user's checkpoint: as it is
            calls = [0]
            sel = None
            if action == SELECTIVE:
                sel = Selective(lambda ts: owner.hold(step, stat, ts))
                kwargs = {**kwargs, "context_fn": sel.contexts}

            def run(*a: Any, **kw: Any) -> Any:
                calls[0] += 1
                if calls[0] > 1:  # backward: the recompute (its saves are checkpoint's)
                    if sel is not None:
                        sel.release()  # from here on counted as what the recompute brings back
                    owner.recomputing(step, stat)
                    marks = stat.marks  # the device's (NOTE [Device clock]), else None
                    if marks is not None:
                        marks.recompute_edge()
                    t0 = step.clock()
                    try:
                        return inner(*a, **kw)
                    finally:  # checkpoint may stop it early, by raising: timed all the same
                        stat.recompute_seconds += step.clock() - t0
                        if marks is not None:
                            marks.recompute_edge()
                if sel is not None:
                    out = owner._counted(inner, step, stat, a, kw, sel)
                    sel.settle()
                    return out
                return owner._once(block, inner, step, stat, a, kw)

            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        block.forward = forward

        def remove() -> None:
            if block.__dict__.get("forward") is not forward:
                return  # someone replaced it since: leave theirs
            if had:
                block.forward = prev
            else:
                del block.__dict__["forward"]

        return remove

    def _once(self, block: nn.Module, fn, step: StepState, stat: GroupStat, args, kwargs) -> Any:
        """Run the checkpointed forward; count what it saves the first time its block runs with
        this signature, else credit what was counted then (item 5 of the NOTE)."""
        by_sig = self.measured.get(block)
        if by_sig is None:
            by_sig = self.measured[block] = {}
        sig = signature(block, args, kwargs)
        known = by_sig.get(sig)
        if known is None:
            added: set[int] = set()
            before = stat.hidden_bytes, stat.cacheable_bytes
            out = self._counted(fn, step, stat, args, kwargs, added=added)
            leaves = _tensor_leaves(out)
            mine = tuple(i for i, t in enumerate(leaves) if _cdata(t) in added)
            hidden, cacheable = stat.hidden_bytes - before[0], stat.cacheable_bytes - before[1]
            by_sig[sig] = _Saved(hidden, cacheable, mine)
            return out
        out = fn(*args, **kwargs)
        stat.hidden_bytes += known.hidden
        stat.cacheable_bytes += known.cacheable
        step.saved_bytes += known.hidden
        if known.outputs:
            leaves = _tensor_leaves(out)
            self.seen(step, [leaves[i] for i in known.outputs if i < len(leaves)])
        return out

    def _counted(self, fn, step, stat, args, kwargs, sel=None, added=None) -> Any:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:  # pragma: no cover - checkpoint always pushes its hook
            return fn(*args, **kwargs)
        pack, unpack = top
        count = self.count
        cacheable = self.measure_cacheable

        def counting(t: torch.Tensor) -> Any:
            n = count(t, step)
            if n:
                stat.hidden_bytes += n
                if added is not None:
                    added.add(t.untyped_storage()._cdata)
                if cacheable and kept_by_selective(t):  # what selective would keep of it
                    stat.cacheable_bytes += n
            if sel is not None:
                sel.saw(t)
            return pack(t)

        with torch.autograd.graph.saved_tensors_hooks(counting, unpack):
            return fn(*args, **kwargs)


class _Saved:
    """What one block's checkpointed forward saved, for one signature (item 5 of the NOTE)."""

    __slots__ = ("hidden", "cacheable", "outputs")

    def __init__(self, hidden: int, cacheable: int, outputs: tuple[int, ...]):
        self.hidden = hidden  # bytes counted in saved_bytes and hidden_bytes
        self.cacheable = cacheable
        self.outputs = outputs  # the tensor outputs (by position) among what it saved


def _cdata(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata if t.layout is torch.strided else 0


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]


def signature(
    block: nn.Module, args: tuple, kwargs: dict, tensors: list[torch.Tensor] | None = None
) -> tuple:
    """What decides which tensors a block's forward saves, and how large (item 5 of the NOTE):
    its tensor arguments' shapes, dtypes and devices, its other arguments (by value when a
    plain scalar, else by type), its training flag and autocast's state. The tensors found are
    appended to ``tensors`` when given. Built for every block of every step: no generators."""
    cast = (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
    )
    described = _described(args, tensors), _described(kwargs, tensors) if kwargs else ()
    return (*described, block.training, cast)


def _described(v: Any, tensors: list[torch.Tensor] | None) -> Any:
    if isinstance(v, torch.Tensor):
        if tensors is not None:
            tensors.append(v)
        return (v.shape, v.dtype, v.device, v.requires_grad, v.layout)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return tuple([_described(x, tensors) for x in v])
    if isinstance(v, dict):
        return tuple([(k, _described(x, tensors)) for k, x in v.items()])
    return type(v)
