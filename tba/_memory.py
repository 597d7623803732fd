"""Aligned host memory as torch tensors, so O_DIRECT can use it without a copy."""

from __future__ import annotations

import torch

PAGE = 4096


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int, align: int = PAGE, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data pointer is a multiple of ``align``.

    It over-allocates by ``align`` bytes and returns an aligned slice; the slice keeps the whole
    allocation alive. With ``pin`` the memory is page-locked (CUDA hosts only).
    """
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % align
    return raw[start : start + nbytes]


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a contiguous uint8 CPU tensor."""
    return memoryview(t.numpy()).cast("B")


def io_buffer(t: torch.Tensor):
    """What a backend's ``write``/``read`` takes for ``t``: a memoryview of host memory, or the
    device tensor itself (device-direct I/O, kvikio with GDS)."""
    return as_memoryview(t) if t.device.type == "cpu" else t
