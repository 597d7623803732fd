"""The buffers the kvikio backend moves: device bytes as cuFile takes them, host views, and host
copies of device bytes for checksums and the probe's comparison (NOTE [kvikio] 3 in
tba/storage/kvikio.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..host.memory import as_memoryview
from .checksum import Digest


class _CudaBytes:
    """A contiguous byte range of device memory, exported through ``__cuda_array_interface__``.

    Slicing gives a sub-range (the transfer loop resubmits ``buf[pos:]``); ``owner`` keeps the
    memory alive.
    """

    __slots__ = ("ptr", "nbytes", "owner", "device", "readonly")

    def __init__(
        self, ptr: int, nbytes: int, owner: Any, device: int | None, readonly: bool = False
    ):
        self.ptr = ptr
        self.nbytes = nbytes
        self.owner = owner
        self.device = device
        self.readonly = readonly

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> _CudaBytes:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("tba.storage: a device buffer slices only as buf[start:stop]")
        start, stop, _ = key.indices(self.nbytes)
        stop = max(start, stop)
        return _CudaBytes(self.ptr + start, stop - start, self.owner, self.device, self.readonly)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # No "stream" key: our callers order the memory themselves (NOTE [CUDA ordering]).
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, self.readonly),
            "version": 3,
            "strides": None,
        }

    def __repr__(self) -> str:
        return f"<device bytes {self.ptr:#x}+{self.nbytes}>"


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    step = itemsize
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def _device_view(buf: Any) -> _CudaBytes | None:
    """``buf`` as device bytes, or None when it is host memory."""
    if isinstance(buf, _CudaBytes):
        return buf
    if isinstance(buf, (memoryview, bytes, bytearray)):
        return None
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cuda":
            return None
        if not buf.is_contiguous():
            raise ValueError("tba.storage: a device buffer must be contiguous")
        return _CudaBytes(buf.data_ptr(), buf.numel() * buf.element_size(), buf, buf.device.index)
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is None:
        return None
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    ptr, readonly = cai["data"]
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, tuple(strides), itemsize):
        raise ValueError("tba.storage: a device buffer must be C-contiguous")
    return _CudaBytes(int(ptr), itemsize * math.prod(shape), buf, None, bool(readonly))


def _host_view(buf: Any) -> Any:
    """Host tensors become byte memoryviews; other host buffers pass through."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("tba.storage: a host tensor buffer must be contiguous")
        return as_memoryview(buf.reshape(-1).view(torch.uint8))
    return buf


def _device_to_host(view: _CudaBytes) -> memoryview:
    """A host copy of device bytes (for checksums and the probe's comparison)."""
    where = "cuda" if view.device is None else f"cuda:{view.device}"
    return as_memoryview(torch.as_tensor(view, device=where).cpu())


def _host_bytes(buf: Any) -> memoryview:
    return _device_to_host(buf) if isinstance(buf, _CudaBytes) else memoryview(buf)


def _via_host(digest: Digest | None) -> Digest | None:
    if digest is None:
        return None
    return lambda view: digest(_device_to_host(view))
