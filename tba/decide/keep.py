"""Keep or offload: the decision for one saved tensor. No I/O here.

The reasons a tensor stays in memory are the keys of ``stats()["kept_reasons"]``, listed with
their meaning in ``KEPT_REASONS`` (tba/records/reasons.py). This module decides the two that depend
only on the tensor and its group: ``small`` (a tiny I/O costs more than it saves) and ``group`` (one
of the last ``keep_last`` groups, which backward needs first). The Packer (tba/datapath/pack.py)
adds the ones that depend on resources: unsupported, staging full, and what the disk refused.

Parameters, views of parameter storage and other leaves that require grad are never offloaded
nor counted: something else holds them anyway, so writing them would free nothing.
"""

from __future__ import annotations

import torch

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_parameter_like(t: torch.Tensor, param_storages: frozenset[int] | set[int]) -> bool:
    """Parameters, their views (``W.t()``), other grad-requiring leaves, and model storages."""
    if t.requires_grad and t.is_leaf:
        return True
    base = t._base
    if base is not None and base.requires_grad and base.is_leaf:
        return True
    return bool(param_storages) and t.untyped_storage()._cdata in param_storages


def unsupported(t: torch.Tensor) -> bool:
    return (
        type(t) not in PLAIN_TYPES
        or t.is_nested  # strided, but without sizes or strides of its own
        or t.layout is not torch.strided
        or t.is_conj()  # a lazy view: its storage holds the base's values, not its own
        or t.is_neg()
        or t._is_zerotensor()  # no storage at all
        or not (t.is_cpu or t.is_cuda)
        or t.numel() == 0
        or t.is_quantized
    )


class Policy:
    """Pure decision logic, configured from :class:`tba.Config`."""

    def __init__(self, min_offload_bytes: int):
        self.min_offload_bytes = min_offload_bytes

    def keep_reason(self, retained_bytes: int, group_kept: bool | str) -> str | None:
        """Why a supported tensor (see :func:`unsupported`, which the pack hook checks first)
        stays in memory, or None to offload it. ``group_kept``: True for a kept group, or the
        reason its group keeps everything ("recompute": a checkpoint's inputs)."""
        if retained_bytes < self.min_offload_bytes or retained_bytes == 0:
            return "small"
        if group_kept:
            return group_kept if isinstance(group_kept, str) else "group"
        return None
