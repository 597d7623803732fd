"""The ``saved_tensors_hooks`` subclass: what autograd calls for every tensor it saves.

``pack`` decides in order: exclude (parameters and their views), dedup (the same view saved
again), keep (policy), offload. It never waits for I/O: a capture is a memcpy into staging (CPU)
or an async copy (CUDA), and the write runs on an I/O thread. ``unpack`` hands the tensor back:
forwarded from memory when possible, else from a prefetched or a synchronous read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .cache import Handle, KeptHandle, layout
from .policy import is_parameter_like, unsupported

if TYPE_CHECKING:
    from .offloader import Offloader
    from .stats import StepState


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks bound to one Offloader and one step."""

    def __init__(self, offloader: Offloader, step: StepState):
        self.off = offloader
        self.st = step
        super().__init__(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        off, st = self.off, self.st
        if unsupported(t):
            st.keep("unsupported")
            return t
        if is_parameter_like(t, off.param_storages):
            return t  # held by the model anyway; never written, never counted
        storage = t.untyped_storage()
        key = (storage._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        with off._lock:
            off.cache.bury()
            st.packs += 1
            h = off.cache.find(key)
            if h is not None:
                return off.reuse(h, st)
            snbytes = storage.nbytes()
            sref = st.see(storage, key[0], snbytes)
            whole, nbytes, stride, offset = layout(t, snbytes, key[3])
            reason = off.policy.keep_reason(nbytes, off.groups.on_pack(nbytes))
            gs = off.groups.stat
            gs.tensors += 1
            gs.packed_bytes += nbytes
            if reason is None:
                got = off.offload(t, storage, key, whole, nbytes, stride, offset, st, sref)
                if not isinstance(got, str):
                    return got
                reason = got
            gs.kept_bytes += nbytes
            if reason == "group":
                gs.keepable_bytes += nbytes
            return off.keep(t, key, snbytes, reason, st)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, (Handle, KeptHandle)):
            return self.off.unpack(packed)
        return packed  # excluded at pack time: the tensor itself
