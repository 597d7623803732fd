"""The ``saved_tensors_hooks`` subclass: what autograd calls for every tensor it saves.

It holds no logic: pack goes to the Packer (tba/pack.py), unpack to the Reader
(tba/unpack.py). One instance per step, so every tensor is credited to the step that saved it.
"""

from __future__ import annotations

from typing import Any

import torch

from .derived import Derived
from .handle import Handle, KeptHandle
from .pack import Packer
from .step import StepState
from .subclass import DTensorHandle
from .unpack import Reader


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks bound to one Packer, one Reader and one step."""

    tba_offload_hooks = (
        True  # how tba.recompute tells tba's hooks from others' (NOTE [Block policy])
    )

    def __init__(self, packer: Packer, reader: Reader, step: StepState):
        self.packer = packer
        self.reader = reader
        self.st = step
        super().__init__(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        return self.packer.pack(t, self.st)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, (Handle, KeptHandle, Derived)):
            return self.reader.unpack(packed)
        if isinstance(packed, DTensorHandle):  # NOTE [DTensor]
            return packed.rebuild(self.unpack(packed.inner))
        return packed  # excluded at pack time: the tensor itself
