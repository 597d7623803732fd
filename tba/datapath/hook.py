"""The ``saved_tensors_hooks`` subclass: what autograd calls for every tensor it saves.

It holds no logic: pack goes to the Packer (tba/datapath/pack.py), unpack to the Reader
(tba/datapath/unpack.py). One instance per step, so every tensor is credited to the step that saved
it. Both are marked eager-only (:func:`eager_only`): autograd calls them while compiled code runs,
and dynamo must not compile tba's own code (NOTE [Compiled regions] in
tba/datapath/blocks/groups.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..records.handle import Handle, KeptHandle, Passed
from ..records.step import StepState
from .blocks.kept import top_hooks
from .capture.derived import Derived
from .capture.dtensor import DTensorHandle
from .pack import Packer
from .unpack import Reader

COMPILED_STEP = (
    "tba: a step cannot open inside code that torch.compile traces (a compiled region is one "
    "autograd node that saves its tensors when the region ends, after the step would have "
    "closed), so it needs a graph break here, which fullgraph=True forbids. Open the step "
    "outside the compiled code: compile the model or its blocks, not the function that calls "
    "`off.step()`; with tba.integrations.wrap (or a framework integration), compile first and "
    "wrap the compiled module: `tba.integrations.wrap(torch.compile(model, fullgraph=True))`."
)


def eager_only(fn: Any) -> Any:
    """``fn``, which dynamo never compiles, nor anything it calls.

    ``torch.compiler.disable`` would do the same through a wrapper that switches dynamo's frame
    callback off and on again at every call, about a microsecond, twice per saved tensor. Marking
    the code object to be skipped, with everything it calls, costs nothing per call. Where this
    torch has no such mark, the wrapper it is.
    """
    try:
        from torch._C._dynamo.eval_frame import (  # type: ignore[attr-defined]
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # pragma: no cover - torch releases without frame strategies
        return torch.compiler.disable(fn)
    skip = _FrameAction.SKIP
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(skip, skip))
    return fn


class EagerScope:
    """Runs a context manager's enter and exit outside dynamo (NOTE [Compiled regions] in
    tba/datapath/blocks/groups.py): traced code breaks its graph at the ``with`` (``fullgraph=True``
    refuses, quoting :data:`COMPILED_STEP`), and at run time the step machinery runs eagerly
    around the compiled code inside the block, never compiled as frames of its own."""

    __slots__ = ("cm",)

    def __init__(self, cm: Any):
        self.cm = cm

    @torch.compiler.disable(reason=COMPILED_STEP)
    def __enter__(self) -> Any:
        return self.cm.__enter__()

    @torch.compiler.disable(reason=COMPILED_STEP)
    def __exit__(self, *exc: Any) -> Any:
        return self.cm.__exit__(*exc)


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks bound to one Packer, one Reader and one step."""

    # how tba.datapath.blocks.recompute tells tba's hooks from others' (NOTE [Block policy])
    tba_offload_hooks = True

    def __init__(self, packer: Packer, reader: Reader, step: StepState):
        self.packer = packer
        self.reader = reader
        self.st = step
        super().__init__(self.pack, self.unpack)

    def __enter__(self) -> None:
        kb = self.packer.groups.kept_blocks
        if kb is not None:  # NOTE [Kept blocks without hooks] in tba/datapath/blocks/kept.py:
            alone = top_hooks(False) is None  # only when no other hooks are below these
            kb.hooks = self if alone else None
        super().__enter__()

    def __exit__(self, *args: object) -> None:
        kb = self.packer.groups.kept_blocks
        if kb is not None:  # hooks popped for a block that raised, or for the head: back first
            kb.restore(self.st, failed=args[0] is not None)
            kb.hooks = None
        super().__exit__(*args)

    # Both hooks time themselves, less any stall, into the group's GroupStat (NOTE [Hook time]
    # in tba/decide/block_policy.py): the seconds a block spends in tba rather than in its own
    # compute.

    @eager_only
    def pack(self, t: torch.Tensor) -> Any:
        packer = self.packer
        st = self.st
        if not packer.time_hooks:
            return packer.pack(t, st)
        t0, stalled = st.clock(), st.stall_seconds
        got = packer.pack(t, st)
        gs = packer.groups.stat
        if gs is not None:  # less what it waited for staging (NOTE [Staging backpressure])
            gs.pack_seconds += st.clock() - t0 - (st.stall_seconds - stalled)
        return got

    @eager_only
    def unpack(self, packed: Any) -> torch.Tensor:
        tp = type(packed)
        if tp is KeptHandle:  # in memory all along: its version, and its group's backward time
            stat = packed.stat
            if stat is not None:
                t0 = self.st.clock()
                if not stat.bwd_first:  # GroupStat.unpacked, inline
                    stat.bwd_first = t0
                stat.bwd_last = t0
                if stat.marks is not None:
                    stat.marks.unpacked()
                if self.packer.time_hooks:
                    out = packed.unpack()
                    stat.unpack_seconds += self.st.clock() - t0
                    return out
            return packed.unpack()
        if tp is Passed:  # NOTE [Passed through]
            return packed.unpack()
        if tp is Handle:  # the only kind whose unpack can wait on a read
            st = packed.entry.step
            t0, stalled = st.clock(), st.stall_seconds
            out = self.reader.unpack(packed)
            packed.stat.unpack_seconds += st.clock() - t0 - (st.stall_seconds - stalled)
            return out
        if tp is Derived:
            return packed.rebuild()  # NOTE [Weight-derived tensors]
        if tp is DTensorHandle:  # NOTE [DTensor]
            return packed.rebuild(self.unpack(packed.inner))
        return packed  # excluded at pack time: the tensor itself
