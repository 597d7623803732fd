"""What the integrations share: running a module's forward under an Offloader, and building a
:class:`tba.Config` from a framework's own settings while naming them in errors and logs.

# NOTE [Forward wrapping]
An integration makes a module's ``forward`` run inside ``offloader.step(blocks_of)``, so the
tensors autograd saves in that forward are offloaded; backward needs nothing more (unpack is a
hook on the graph). The wrapper steps aside, calling the original forward directly, when:
grad mode is off (evaluation, generation: nothing is saved), a wrapped forward is already
running in this thread (a DeepSpeed engine around a wrapped model), or the Offloader already has
a step open in this thread (the caller wrote ``with off.step():`` around it). Each forward is one
step, so gradient accumulation (several forwards, then one optimizer step) needs nothing special.

# NOTE [Precedence]
A framework's setting (ds_config, a Megatron flag) is an explicit argument to ``Config``, so it
beats the ``TBA_*`` variable, which beats the default. One exception: ``TBA_ENABLED=0`` turns
offload off whatever the framework's settings say, so that it can be switched off without
editing a config file or a launch command.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..config import Config, format_size
from ..datapath.hook import EagerScope
from ..errors import ConfigError

_active = threading.local()  # a wrapped forward is running in this thread


def env_config() -> Config:
    """The ``TBA_*`` environment alone (``Config`` is the only reader of the environment)."""
    return Config()


def env_kill_switch(env: Config) -> bool:
    """True when ``TBA_ENABLED`` is set to a false value: off, whatever else says on."""
    return env.sources.get("enabled") == "env" and not env.enabled


def build_config(values: Mapping[str, Any], labels: Mapping[str, str]) -> Config:
    """``Config(**values)``; a bad value is reported under its framework name from ``labels``.

    ``labels`` maps a field to how the user wrote it, e.g. ``"--tba-keep-last"`` or
    ``"ds_config activation_offload.keep_last"``. Problems with ``TBA_*`` variables keep theirs.
    """
    try:
        return Config(**values)
    except ConfigError as err:
        problems = []
        for p in err.problems:
            field, sep, rest = p.partition("=")
            problems.append(f"{labels[field]}={rest}" if sep and field in labels else p)
        raise ConfigError(problems) from None


def describe_sources(cfg: Config, sources: Mapping[str, str]) -> str:
    """One line per setting: its value and where it came from (framework, env or default)."""
    lines = []
    for name, env, _, _ in Config.describe():
        value = getattr(cfg, name)
        if name.endswith("_bytes") and isinstance(value, int):
            value = format_size(value)
        where = sources.get(name) or (env if cfg.sources.get(name) == "env" else "default")
        lines.append(f"  {name} = {value}  [{where}]")
    return "\n".join(lines)


def _step_open_here(off: Any) -> bool:
    # Offloader.step refuses to nest; a caller's own `with off.step():` around a wrapped
    # forward must win, so the wrapper checks the Offloader's owner thread first.
    return getattr(off, "_active_thread", None) == threading.get_ident()


@contextlib.contextmanager
def forward_scope(offloader: Any, blocks_of: torch.nn.Module | None) -> Iterator[bool]:
    """``offloader.step(blocks_of)`` unless NOTE [Forward wrapping] says to step aside.

    ``offloader`` is an Offloader, or a callable returning one (or None: offload off) that is
    called only when a step is about to open. Yields whether a step is open.
    """
    if getattr(_active, "on", False) or not torch.is_grad_enabled():
        yield False
        return
    off = offloader() if callable(offloader) else offloader
    if off is None or not off.enabled or _step_open_here(off):
        yield False
        return
    _active.on = True
    try:
        with off.step(blocks_of):
            yield True
    finally:
        _active.on = False


def wrap_forward(
    module: torch.nn.Module,
    offloader: Any,
    blocks_of: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """Make ``module.forward`` run under ``offloader`` (see NOTE [Forward wrapping]).

    ``blocks_of``: the model whose blocks become the prefetch groups (default: ``module``).
    Wrapping twice replaces the first wrapper. Returns ``module``.
    """
    unwrap_forward(module)
    had_own = "forward" in module.__dict__
    original = module.forward
    groups = module if blocks_of is None else blocks_of

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with EagerScope(forward_scope(offloader, groups)):
            return original(*args, **kwargs)

    forward.__tba_original__ = (original, had_own)  # type: ignore[attr-defined]
    forward.tba_offloader = offloader  # type: ignore[attr-defined]
    module.forward = forward
    return module


def unwrap_forward(module: torch.nn.Module) -> bool:
    """Undo :func:`wrap_forward`. Returns whether ``module`` was wrapped."""
    got = getattr(module.__dict__.get("forward"), "__tba_original__", None)
    if got is None:
        return False
    original, had_own = got
    if had_own:
        module.forward = original
    else:
        del module.__dict__["forward"]
    return True


def is_wrapped(module: torch.nn.Module) -> bool:
    return hasattr(module.__dict__.get("forward"), "__tba_original__")


def wrapped_offloader(module: torch.nn.Module) -> Any:
    """What :func:`wrap_forward` was given for ``module`` (None when not wrapped)."""
    return getattr(module.__dict__.get("forward"), "tba_offloader", None)
