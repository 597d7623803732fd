"""The ``saved_tensors_hooks`` subclass: what autograd calls for every tensor it saves.

It holds no logic: pack goes to the Packer (tba/datapath/pack.py), unpack to the Reader
(tba/datapath/unpack.py). One instance per step, so every tensor is credited to the step that saved
it. Both are ``torch.compiler.disable``d: autograd calls them while compiled code runs, and dynamo
must not compile tba's own code (NOTE [Compiled regions] in tba/datapath/blocks/groups.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..records.handle import Handle, KeptHandle, Passed
from ..records.step import StepState
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

    # Both hooks time themselves, less any stall, into the group's GroupStat (NOTE [Hook time]
    # in tba/decide/block_policy.py): the seconds a block spends in tba rather than in its own
    # compute.

    @torch.compiler.disable
    def pack(self, t: torch.Tensor) -> Any:
        st = self.st
        t0, stalled = st.clock(), st.stall_seconds
        got = self.packer.pack(t, st)
        gs = self.packer.groups.stat
        if gs is not None:
            waited = st.stall_seconds - stalled  # for staging (NOTE [Staging backpressure])
            gs.pack_seconds += st.clock() - t0 - waited
            gs.pack_stall_seconds += waited
        return got

    @torch.compiler.disable
    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is Handle:  # the only kind whose unpack can wait on a read
            st = packed.entry.step
            t0, stalled = st.clock(), st.stall_seconds
            out = self.reader.unpack(packed)
            packed.stat.unpack_seconds += st.clock() - t0 - (st.stall_seconds - stalled)
            return out
        if type(packed) is Passed:  # NOTE [Passed through]
            return packed.unpack()
        if isinstance(packed, KeptHandle):
            clock = self.st.clock
            t0 = clock()
            out = self.reader.unpack(packed)
            if packed.stat is not None:
                packed.stat.unpack_seconds += clock() - t0
            return out
        if isinstance(packed, Derived):
            return self.reader.unpack(packed)
        if isinstance(packed, DTensorHandle):  # NOTE [DTensor]
            return packed.rebuild(self.unpack(packed.inner))
        return packed  # excluded at pack time: the tensor itself
