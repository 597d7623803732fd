"""Saved tensors that are tensor subclasses: DTensor is offloaded through its local shard, any
other subclass stays in memory, said once in a warning and in ``kept_reasons["subclass"]``.

# NOTE [DTensor]
A DTensor (FSDP2, tensor parallelism, ``distribute_tensor``/``distribute_module``) is a wrapper:
its bytes are those of its local shard, a plain tensor, plus a spec (mesh, placements, global
shape and stride). Autograd saves the DTensor itself, so the pack hook splits it: the local
shard goes through the ordinary path (dedup, keep rules, capture, write; its version counter is
the one in-place ops on the DTensor bump), and the handle remembers the spec. Unpack rebuilds
a DTensor over the unpacked shard with ``DTensor.from_local(..., run_check=False)`` and the
same mesh, placements, shape and stride: no communication, no copy. A DTensor parameter (a
grad-requiring leaf) is returned as it is, like any parameter, and the shards of a model's
DTensor parameters count as its parameter storages. torch.distributed is never imported by tba:
a DTensor can only exist once the application imported its module.

An AsyncCollectiveTensor (the result of a functional collective, e.g. what tensor parallelism's
RowwiseParallel returns as its local output) wraps the plain tensor the collective writes. The
op that saved it has already waited for it (any op on it does), so the pack waits (a no-op
then) and offloads the plain tensor; backward gets that plain tensor back, with the same bytes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # public, then pre-2.5


def dtensor_class() -> type | None:
    """The DTensor class if the application loaded it, else None (then none can exist)."""
    for name in _MODULES:
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return cls
    return None


def is_dtensor(t: torch.Tensor) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def waited(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor behind an AsyncCollectiveTensor (NOTE [DTensor]), else None."""
    mod = sys.modules.get("torch.distributed._functional_collectives")
    cls = getattr(mod, "AsyncCollectiveTensor", None)
    if cls is None or not isinstance(t, cls):
        return None
    out = t.trigger_wait()
    return out if type(out) is torch.Tensor else None


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The shard of DTensor ``t`` held by this rank, without an autograd op or a copy."""
    with torch.no_grad():
        return t.to_local()


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its local shard when it is a DTensor (for storage identities)."""
    return local_of(t) if is_dtensor(t) else t


class DTensorHandle:
    """What the pack hook returns for a DTensor: what its shard was packed into (a handle, a
    kept handle, or the shard itself), and what rebuilds the DTensor (NOTE [DTensor])."""

    __slots__ = ("inner", "mesh", "placements", "shape", "stride")

    def __init__(self, inner: Any, t: torch.Tensor):
        self.inner = inner
        self.mesh = t.device_mesh
        self.placements = tuple(t.placements)
        self.shape = t.shape
        self.stride = t.stride()

    def rebuild(self, local: torch.Tensor) -> torch.Tensor:
        cls = dtensor_class()
        with torch.no_grad():
            return cls.from_local(
                local,
                self.mesh,
                self.placements,
                run_check=False,
                shape=self.shape,
                stride=self.stride,
            )


def kind(t: torch.Tensor) -> str:
    """The class name used in the warning for a kept subclass."""
    cls = type(t)
    return f"{cls.__module__}.{cls.__qualname__}"
