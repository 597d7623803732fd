"""Pack 1-bit flags eight per byte and 2-bit codes four per byte.

The packed form is a flat ``uint8`` tensor of ``ceil(n / 8)`` (1-bit) or ``ceil(n / 4)`` (2-bit)
bytes; the caller keeps the original shape. Element ``k`` lives in byte ``k // 8`` at bit
``k % 8`` (1-bit), or in byte ``k // 4`` at bits ``2 * (k % 4)`` and up (2-bit), so the layout is
little-endian within a byte and does not depend on the device. Padding bits are zero.

Packing and unpacking allocate transient tensors of about ``n`` bytes; only the packed result is
meant to be kept for backward.
"""

from __future__ import annotations

import torch

from ._errors import LayerShapeError

__all__ = ["pack_bits", "unpack_bits", "pack_2bit", "unpack_2bit", "packed_nbytes"]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits (1 or 2) occupy when packed."""
    per_byte = 8 // bits
    return -(-numel // per_byte)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    flat = codes.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=flat.device)
    # Codes never overlap after shifting, so the sum is an OR and fits in a uint8.
    return (flat.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise LayerShapeError(
            f"tba.layers.packing: expected a 1-D uint8 tensor, got {packed.dtype} with shape "
            f"{tuple(packed.shape)}. Pass the tensor returned by the matching pack function."
        )
    if packed.numel() != packed_nbytes(numel, bits):
        raise LayerShapeError(
            f"tba.layers.packing: {packed.numel()} packed bytes cannot hold exactly {numel} "
            f"{bits}-bit codes (need {packed_nbytes(numel, bits)}). Pass the element count used "
            f"when packing."
        )
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> shifts) & mask
    return codes.reshape(-1)[:numel]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool (or 0/1) tensor into ``ceil(numel / 8)`` bytes, eight flags per ``uint8``."""
    return _pack(mask, 1)


def unpack_bits(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``shape``."""
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return _unpack(packed, numel, 1).view(shape).bool()


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes in ``0..3`` into ``ceil(numel / 4)`` bytes, four codes per ``uint8``.

    Values outside ``0..3`` are not checked (that would cost a device sync); their high bits
    would corrupt the neighbouring code, so callers must produce codes in range.
    """
    return _pack(codes, 2)


def unpack_2bit(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: a ``uint8`` tensor of ``shape`` with values in ``0..3``."""
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return _unpack(packed, numel, 2).view(shape)
