"""Hugging Face ``Trainer``: one callback offloads the activations of every training forward.

    from tba.integrations.hf import OffloadCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[OffloadCallback()])
    trainer.train()

Why a callback that wraps the forward, and not one that only listens to events: in
``Trainer.training_step`` the forward (``compute_loss`` inside ``compute_loss_context_manager``)
and the backward (``accelerator.backward``) of one micro-batch both happen between two callback
events (``on_step_begin`` fires once per accumulation window, ``on_substep_end`` /
``on_step_end`` after the backward). No pair of events brackets the forward alone, and a tba
step must close when the forward ends, so that reads can be planned before backward starts. So
``on_train_begin`` wraps ``model.forward`` (the model the Trainer trains; DDP, DeepSpeed and
accelerate wrappers call it) and ``on_train_end`` restores it. Each training forward is one tba
step, with gradient accumulation or without; forwards with grad mode off (evaluation, generation)
are left alone.

Settings come from the ``TBA_*`` environment (or pass a :class:`tba.Offloader` /
:class:`tba.Config`); ``TBA_ENABLED=0`` makes the callback do nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from ..config import Config
from ..datapath.offloader import Offloader
from ._common import unwrap_forward, wrap_forward

__all__ = ["OffloadCallback"]

log = logging.getLogger("tba.integrations.hf")


class OffloadCallback(TrainerCallback):
    """Offload what the model saves for backward during ``Trainer.train()``.

    ``offloader``: an Offloader to use (it stays open after training); or ``config``: a
    :class:`tba.Config` for the Offloader the callback creates at ``on_train_begin`` and closes at
    ``on_train_end``. Neither: ``Config()``, i.e. the ``TBA_*`` environment.
    """

    def __init__(self, offloader: Offloader | None = None, config: Config | None = None):
        self._given = offloader
        self._config = config
        self.offloader: Offloader | None = offloader
        self.last_stats: dict[str, Any] | None = None
        self._model: Any = None
        self._told = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        self.offloader, self.last_stats, self._told = self._given, None, False
        if model is None:
            return
        if self._given is None:
            cfg = self._config
            if cfg is None:  # the TBA_* environment, with the Trainer's process index as rank
                rank = getattr(args, "process_index", None)
                cfg = Config() if rank is None else Config(rank=rank)
            if not cfg.enabled:
                return
            self.offloader = Offloader(cfg)
        elif not self._given.enabled:
            return
        self._model = model
        wrap_forward(model, self.offloader)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self._told or self._model is None or self.offloader is None:
            return
        self._told = True  # once, after the first optimizer step: what the blocks ran as
        st = self.offloader.stats()
        user = st.get("user_checkpointed_groups", 0)
        if user:
            log.info(
                "tba.integrations.hf: %d of %d blocks run under the model's own gradient "
                "checkpointing; tba leaves them to it (no second recompute) and offloads what "
                "their checkpoints save, their inputs, and what runs outside them. Stats: "
                "user_checkpointed_groups, group_policy.",
                user,
                len(st.get("group_policy", [])),
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        if self._model is not None:
            unwrap_forward(self._model)
            self._model = None
        if self.offloader is not None:
            self.offloader.synchronize()  # the last step's writes are counted once they land
            self.last_stats = self.offloader.stats()
            if self._given is None:
                self.offloader.close()
