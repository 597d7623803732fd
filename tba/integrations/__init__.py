"""Integrations: tba inside the training stacks people already run, enabled by one line.

- plain PyTorch (any loop, DDP): ``model = tba.integrations.wrap(model)``
- DeepSpeed: ``tba.integrations.deepspeed.initialize(...)`` in place of ``deepspeed.initialize``
- Megatron: ``extra_args_provider=add_args`` and ``wrap_forward_step(forward_step)``
  (``tba.integrations.megatron``)
- Hugging Face ``Trainer`` (TRL's ``SFTTrainer`` too):
  ``callbacks=[tba.integrations.hf.OffloadCallback()]``
- Lightning: ``Trainer(callbacks=[tba.integrations.lightning.OffloadCallback()])``
- Accelerate: ``tba.integrations.wrap(model)`` on what ``accelerator.prepare`` returns

Each submodule imports its framework; this package and the tba core import none of them.
Everything else comes from the ``TBA_*`` environment, and ``TBA_ENABLED=0`` switches each one
off without touching the code or the framework's config.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import is_wrapped, unwrap_forward, wrap_forward

__all__ = ["wrap", "unwrap", "is_wrapped"]


def _default_offloader() -> Any:
    from .. import default_offloader
    from ._common import env_config

    return default_offloader() if env_config().enabled else None


def wrap(model: torch.nn.Module, offloader: Any = None) -> torch.nn.Module:
    """Offload what every forward of ``model`` saves for backward; returns ``model``.

    The one line for a plain training loop: the loop itself does not change. Forwards with
    grad mode off (evaluation) are left alone. ``offloader``: a :class:`tba.Offloader`; by
    default the process-wide one built from the ``TBA_*`` environment, created at the first
    forward. ``TBA_ENABLED=0`` makes the wrapper call the original forward, creating nothing.
    With DDP, wrap either the DDP module or the model inside it.
    """
    return wrap_forward(model, _default_offloader if offloader is None else offloader)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`wrap`: ``model.forward`` is the original again. Returns ``model``."""
    unwrap_forward(model)
    return model
