"""Lightning: one callback offloads what every training forward saves for backward.

    from tba.integrations.lightning import OffloadCallback

    trainer = lightning.Trainer(callbacks=[OffloadCallback()])
    trainer.fit(module, data)

# NOTE [Lightning steps]
As with the Hugging Face callback, each training forward is one tba step: with
``accumulate_grad_batches=N`` an optimizer step is N tba steps. A step must close when its
forward ends, before backward starts, so that reads are planned ahead of backward:

- ``training_step`` is wrapped for the length of ``fit`` (an instance attribute, removed at
  ``on_train_end``). Under automatic optimization Lightning runs the backward after
  ``training_step`` returns; under manual optimization ``self.manual_backward`` runs it inside.
- A step opens at the first forward of the LightningModule or of one of its direct submodules
  inside ``training_step`` (a forward pre-hook), so ``self(x)``, ``self.model(x)`` and a GAN's
  ``self.generator(z)`` all count. It closes at ``on_before_backward`` (both modes call it
  before the backward) or when ``training_step`` returns, whichever comes first. After a
  ``manual_backward`` the next forward in the same ``training_step`` opens the next step.
- The pre-hook opens nothing while someone else's saved-tensor hooks are installed (a
  checkpoint or ``save_on_cpu`` around that call): tba's step must sit below them, not on top.
  A ``training_step`` that saved no tensor under tba gets one warning naming the cause.

Forwards with grad off (validation, prediction) are left alone. Settings come from the
``TBA_*`` environment, or pass a :class:`tba.Offloader` / :class:`tba.Config`;
``TBA_ENABLED=0`` makes the callback do nothing. Both the ``lightning`` package and the older
``pytorch_lightning`` name work: :class:`OffloadCallback` subclasses ``lightning.pytorch``'s
``Callback`` when that is installed, else ``pytorch_lightning``'s;
``callback_class("pytorch_lightning")`` gives the class for the other one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from typing import Any

import torch

from ..config import Config
from ..datapath.offloader import Offloader
from ..errors import UsageError

__all__ = ["OffloadCallback", "LightningMissing", "callback_class"]

log = logging.getLogger("tba.integrations.lightning")

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


class LightningMissing(UsageError, ImportError):
    """Neither ``lightning`` nor ``pytorch_lightning`` can be imported."""


def _callback_base(package: str | None = None) -> type:
    names = _PACKAGES if package is None else (package,)
    for name in names:
        try:
            return importlib.import_module(name).Callback  # type: ignore[no-any-return]
        except ImportError:
            continue
    pkgs = [f"`{n.split('.')[0]}`" for n in names]
    wanted = f"neither {pkgs[0]} nor {pkgs[1]} is" if len(pkgs) == 2 else f"{pkgs[0]} is not"
    raise LightningMissing(
        f"tba.integrations.lightning: {wanted} installed, and the callback subclasses "
        "Lightning's Callback. Run `pip install lightning` (or use tba.integrations.wrap(model) "
        "in a loop of your own)."
    ) from None


def _foreign_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None  # type: ignore[attr-defined]


class _Offload:
    """The callback's behaviour, independent of which package's ``Callback`` it subclasses."""

    def __init__(self, offloader: Offloader | None = None, config: Config | None = None):
        self._given = offloader
        self._config = config
        self.offloader: Offloader | None = offloader
        self.last_stats: dict[str, Any] | None = None
        self.steps = 0  # tba steps this callback opened during the last fit
        self._module: Any = None
        self._handles: list[Any] = []
        self._open: contextlib.ExitStack | None = None
        self._armed = False  # inside the wrapped training_step, on the thread that runs it
        self._thread: int | None = None
        self._warned = False

    # -- Lightning events ---------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.offloader, self.last_stats, self.steps = self._given, None, 0
        if self._given is None:
            cfg = self._config
            if cfg is None:  # the TBA_* environment, with the trainer's global rank
                cfg = Config(rank=getattr(trainer, "global_rank", 0))
            if not cfg.enabled:
                return
            self.offloader = Offloader(cfg)
        elif not self._given.enabled:
            return
        self._install(pl_module)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._close()  # the forward has ended: the backward reads back what it offloaded

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish()

    # -- the step around each training forward (NOTE [Lightning steps]) -----------------------
    def _install(self, module: Any) -> None:
        self._module = module
        original = module.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            opened = self.steps
            self._armed, self._thread = True, threading.get_ident()
            try:
                return original(*args, **kwargs)
            finally:
                self._armed = False
                self._close()
                if self.steps == opened:
                    self._warn_nothing()

        training_step.__tba_original__ = original  # type: ignore[attr-defined]
        module.training_step = training_step
        for m in (module, *module.children()):
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))

    def _pre_forward(self, module: Any, args: Any) -> None:
        if (
            not self._armed
            or self._open is not None
            or self._thread != threading.get_ident()
            or not torch.is_grad_enabled()
            or _foreign_hooks()
        ):
            return
        off = self.offloader
        assert off is not None
        stack = contextlib.ExitStack()
        stack.enter_context(off.step(self._module))
        self._open = stack
        self.steps += 1

    def _close(self) -> None:
        stack, self._open = self._open, None
        if stack is not None:
            stack.close()

    def _warn_nothing(self) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning(
            "tba.integrations.lightning: a training_step ran no forward under tba, so nothing "
            "it saved was offloaded. A step opens at the first forward of the LightningModule "
            "or of one of its direct submodules, with grad on and no other saved-tensor hooks "
            "(checkpoint, save_on_cpu) around that call: call the model through one of them."
        )

    def _finish(self) -> None:
        self._close()
        self._armed = False
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._module is not None:
            self._module.__dict__.pop("training_step", None)
            self._module = None
        if self.offloader is not None and not self.offloader.closed:
            self.offloader.synchronize()  # the last step's writes are counted once they land
            self.last_stats = self.offloader.stats()
            if self._given is None:
                self.offloader.close()


_classes: dict[str, type] = {}


def callback_class(package: str | None = None) -> type:
    """The callback class for ``package`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``;
    default: the first of them installed). Raises :class:`LightningMissing` when it is not."""
    base = _callback_base(package)
    key = base.__module__
    if key not in _classes:
        doc = OffloadCallbackDoc
        _classes[key] = type("OffloadCallback", (_Offload, base), {"__doc__": doc})
    return _classes[key]


OffloadCallbackDoc = """Offload what the LightningModule saves for backward during ``fit``.

``offloader``: an Offloader to use (it stays open after training); or ``config``: a
:class:`tba.Config` for the Offloader the callback creates at ``on_train_start`` and closes at
``on_train_end``. Neither: ``Config()``, i.e. the ``TBA_*`` environment. After ``fit``,
``last_stats`` holds ``stats()`` of the last step and ``steps`` the tba steps opened.
"""

OffloadCallback: Any = callback_class()
