"""Splitting a batch (and its target) into the relay's micro-batches."""

from __future__ import annotations

from typing import Any

import torch

from ._errors import RelayConfigError

__all__ = ["split"]


def _rows(obj: Any, what: str) -> int:
    if torch.is_tensor(obj):
        if obj.dim() == 0:
            raise RelayConfigError(
                f"the {what} is a 0-dim tensor; its first dimension must be the batch."
            )
        return obj.shape[0]
    if isinstance(obj, dict):
        sizes = {k: _rows(v, f"{what}[{k!r}]") for k, v in obj.items()}
    elif isinstance(obj, (tuple, list)):
        sizes = {i: _rows(v, f"{what}[{i}]") for i, v in enumerate(obj)}
    else:
        raise RelayConfigError(
            f"the {what} is a {type(obj).__name__}; pass a tensor, or a dict, tuple or list of "
            "tensors, whose first dimension is the batch."
        )
    if len(set(sizes.values())) > 1:
        raise RelayConfigError(
            f"the parts of the {what} have different batch sizes ({sizes}); they must agree."
        )
    if not sizes:
        raise RelayConfigError(f"the {what} is empty; it holds no tensor to split.")
    return next(iter(sizes.values()))


def _cut(obj: Any, size: int, device: torch.device) -> list:
    if torch.is_tensor(obj):
        return [t.to(device) for t in obj.split(size)]
    if isinstance(obj, dict):
        parts = {k: _cut(v, size, device) for k, v in obj.items()}
        return [dict(zip(parts, vals)) for vals in zip(*parts.values())]
    parts = [_cut(v, size, device) for v in obj]
    return [type(obj)(vals) for vals in zip(*parts)]


def split(obj: Any, micro_batches: int, what: str, device: torch.device) -> list:
    """``obj`` cut along its first dimension into ``micro_batches`` equal parts (views)."""
    if obj is None:
        return [None] * micro_batches
    rows = _rows(obj, what)
    if rows % micro_batches:
        lower = rows // micro_batches * micro_batches
        upper = lower + micro_batches
        near = f"{lower} or {upper}" if lower else f"{upper}"
        raise RelayConfigError(
            f"the {what} has {rows} rows, which micro_batches={micro_batches} cannot split into "
            f"equal micro-batches; pass a {what} whose first dimension is a multiple of "
            f"{micro_batches} (e.g. {near}), or change micro_batches."
        )
    return _cut(obj, rows // micro_batches, device)
