"""Megatron: ``--tba-*`` flags from a dataclass, and a ``forward_step_func`` wrapper.

    from tba.integrations.megatron import add_args, wrap_forward_step

    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        wrap_forward_step(forward_step),      # the forward runs under the offloader
        extra_args_provider=add_args,         # adds --tba-activation-offload, --tba-spill-dir, ...
    )

Then ``--tba-activation-offload --tba-spill-dir /local_nvme/tba`` turns it on. Each field of
:class:`OffloadArgs` is one flag (``spill_dir`` -> ``--tba-spill-dir``), its docstring the help.
A flag left out falls back to its ``TBA_*`` variable, then to tba's default. Offload is on with
``--tba-activation-offload`` or ``TBA_ENABLED=1``; ``TBA_ENABLED=0`` turns it off whatever the
flags say. As in Megatron, a count of 0 means off: ``--tba-keep-last 0`` keeps no block
resident, ``--tba-min-offload-bytes 0`` offloads every size, ``--tba-max-disk-bytes 0`` sets no
quota, ``--tba-coalesce-bytes 0`` turns coalescing off.

The wrapper reads the parsed flags from ``megatron.training.get_args()`` (Megatron-LM) at the
first forward, or from ``args=`` when given; with neither, from the environment only.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import dataclasses
import functools
import inspect
import logging
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..config import Config, parse_size
from ..datapath.hook import EagerScope
from ..datapath.offloader import Offloader
from ..errors import ConfigError, UsageError, ValueParseError
from ._common import build_config, describe_sources, env_config, env_kill_switch, forward_scope

__all__ = [
    "OffloadArgs",
    "add_args",
    "args_to_flags",
    "config_from_args",
    "wrap_forward_step",
    "offloader",
]

log = logging.getLogger("tba.integrations.megatron")

PREFIX = "tba"


@dataclasses.dataclass
class OffloadArgs:
    """tba's Megatron options. ``None`` means: the ``TBA_*`` variable, else tba's default."""

    activation_offload: bool = False
    """Offload the activations saved for backward to local SSD and prefetch them back in time
    (tba). Also on with TBA_ENABLED=1; TBA_ENABLED=0 turns it off over this flag."""

    spill_dir: str | None = None
    """Root directory for spill files, on a node-local NVMe drive (not tmpfs); each rank makes
    its own sub-directory. Default: TBA_SPILL_DIR, else /var/tmp/tba-<uid>."""

    backend: str | None = None
    """I/O backend: auto, native, posix, kvikio, buffered or memory. Default: TBA_BACKEND,
    else auto (probes each and takes the first that works)."""

    keep_last: str | None = None
    """The last K transformer layers stay in memory (backward needs them first): a number, or
    'auto' to choose K from measured compute time and disk bandwidth. 0 keeps none."""

    min_offload_bytes: str | None = None
    """Saved tensors smaller than this stay in memory, e.g. 1MiB. 0 offloads every size."""

    prefetch_bytes: str | None = None
    """Most bytes read ahead and not yet used during backward, e.g. 256MiB."""

    staging_bytes: str | None = None
    """Size of the (pinned on CUDA) staging pool, e.g. 512MiB. When it is full, tensors stay in
    memory rather than stall the forward pass."""

    io_threads: str | None = None
    """I/O threads (requests in flight) for the posix, buffered and kvikio backends."""

    io_depth: str | None = None
    """Requests the native engine keeps in flight (io_uring queue depth)."""

    coalesce_bytes: str | None = None
    """Offloaded tensors smaller than this are packed, per layer, into one write. 0 turns
    coalescing off."""

    max_disk_bytes: str | None = None
    """Quota on the spill files of each rank, e.g. 200GiB. 0 means no quota."""

    checksum: str | None = None
    """Verify reads against a checksum taken at write time: off, crc32, crc32c or xxh64."""

    trace: str | None = None
    """Append a JSON-lines trace of every step and layer to this file."""


# Fields where Megatron's "0 means off" needs translating into tba's value for "off".
_ZERO_IS_NONE = ("max_disk_bytes",)


def _docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after its annotation in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flag(name: str) -> str:
    """``spill_dir`` -> ``--tba-spill-dir``."""
    return f"--{PREFIX}-{name.replace('_', '-')}"


def _dest(name: str) -> str:
    return f"{PREFIX}_{name}"


def _zero_is_none(name: str, raw: Any) -> Any:
    if name in _ZERO_IS_NONE:
        try:
            if parse_size(raw) == 0:
                return "none"
        except ValueParseError:
            pass  # Config reports it, under the flag's name
    return raw


def _checker(name: str) -> Callable[[str], str]:
    """argparse ``type=``: reject a bad value at parse time; argparse names the flag."""

    def check(text: str) -> str:
        try:
            Config(environ={}, **{name: _zero_is_none(name, text)})
        except ConfigError as err:
            why = err.problems[0].partition(" is invalid; ")[2] or err.problems[0]
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; {why}") from None
        return text

    check.__name__ = name
    return check


def add_args(
    parser: argparse.ArgumentParser, options: type = OffloadArgs
) -> argparse.ArgumentParser:
    """Add one ``--tba-*`` flag per field of ``options``; usable as ``extra_args_provider``.

    Booleans become ``store_true`` flags; every other flag takes a string that tba parses
    (sizes such as ``64MiB``). Unset flags stay ``None``. Returns ``parser``.
    """
    docs = _docstrings(options)
    group = parser.add_argument_group("tba activation offload", options.__doc__)
    for f in dataclasses.fields(options):
        doc = docs.get(f.name)
        if not doc:  # a field without a docstring is a bug in the options class
            raise TypeError(f"tba.megatron: {options.__name__}.{f.name} has no docstring")
        if f.type in (bool, "bool"):
            group.add_argument(flag(f.name), dest=_dest(f.name), action="store_true", help=doc)
            group.set_defaults(**{_dest(f.name): None})
        else:
            group.add_argument(
                flag(f.name), dest=_dest(f.name), default=None, type=_checker(f.name), help=doc
            )
    return parser


def args_to_flags(args: Any, options: type = OffloadArgs) -> dict[str, Any]:
    """The ``--tba-*`` flags that were given: {field: value}."""
    out = {}
    for f in dataclasses.fields(options):
        value = getattr(args, _dest(f.name), None)
        if value is not None:
            out[f.name] = value
    return out


def config_from_args(args: Any = None, rank: int | None = None) -> tuple[Config, dict[str, str]]:
    """The :class:`tba.Config` from the parsed flags (``None``: environment only).

    ``rank``: this process's rank (default: ``TBA_RANK``, else ``$RANK``, else 0). Returns the
    Config with where each flag-set value came from. Raises :class:`tba.ConfigError` naming the
    flag, e.g. ``--tba-keep-last='-1' is invalid; expected 'auto' or ...``.
    """
    given = args_to_flags(args) if args is not None else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    labels: dict[str, str] = {}
    for name, raw in given.items():
        if name == "activation_offload":
            continue
        values[name] = _zero_is_none(name, raw)
        sources[name] = labels[name] = flag(name)
    if rank is not None:
        values["rank"], sources["rank"] = rank, "torch.distributed rank"
    env = env_config()
    if env_kill_switch(env):
        values["enabled"], sources["enabled"] = False, "TBA_ENABLED=0 (beats the flags)"
    elif given.get("activation_offload"):
        values["enabled"], sources["enabled"] = True, flag("activation_offload")
    elif env.sources.get("enabled") == "env":
        sources["enabled"] = "TBA_ENABLED"
    else:  # Megatron's convention: features are off unless their flag is given
        values["enabled"], sources["enabled"] = False, f"default (no {flag('activation_offload')})"
    cfg = build_config(values, labels)
    others = ", ".join(flag(n) for n in given if n != "activation_offload")
    if not cfg.enabled and others:
        fix = (
            "Unset TBA_ENABLED"
            if env_kill_switch(env)
            else f"Add {flag('activation_offload')} (or set TBA_ENABLED=1)"
        )
        warnings.warn(
            f"tba.megatron: {others} given, but activation offload is off "
            f"({sources['enabled']}). {fix} to turn it on.",
            UserWarning,
            stacklevel=2,
        )
    return cfg, sources


def _megatron_args() -> Any:
    try:
        from megatron.training import get_args  # Megatron-LM; not part of megatron-core
    except ImportError:
        return None
    try:
        return get_args()
    except Exception:  # not initialized yet: no flags parsed
        return None


def _dist_rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class _Lazy:
    """The Offloader behind :func:`wrap_forward_step`, built at the first forward."""

    def __init__(self, args: Any, off: Offloader | None):
        self.args = args
        self.off = off
        self.resolved = off is not None

    def __call__(self) -> Offloader | None:
        if not self.resolved:
            args = self.args if self.args is not None else _megatron_args()
            cfg, sources = config_from_args(args, _dist_rank())
            if cfg.rank == 0:
                log.info(
                    "tba.megatron: activation offload %s. Settings (--tba-* > TBA_* > "
                    "default):\n%s",
                    "on" if cfg.enabled else "off",
                    describe_sources(cfg, sources),
                )
            if cfg.enabled:
                self.off = Offloader(cfg)
                atexit.register(self.off.close)
            self.resolved = True
        return self.off


def _model_position(func: Callable[..., Any]) -> int | None:
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("model") if "model" in params else None


def _find_model(pos: int | None, args: tuple, kwargs: dict) -> torch.nn.Module | None:
    model = kwargs.get("model")
    if model is None and pos is not None and pos < len(args):
        model = args[pos]
    if model is None:
        model = next((a for a in args if isinstance(a, torch.nn.Module)), None)
    if isinstance(model, (list, tuple)):
        if len(model) > 1:
            _warn_chunk_list(len(model))
        model = model[0] if len(model) == 1 else None
    return model if isinstance(model, torch.nn.Module) else None


_warned_chunk_list = False


def _warn_chunk_list(n: int) -> None:
    global _warned_chunk_list
    if not _warned_chunk_list:
        _warned_chunk_list = True
        warnings.warn(
            f"tba.megatron: forward_step was called with a list of {n} model chunks, so tba "
            "cannot tell which chunk runs and groups this forward's saved tensors by pack order "
            "(TBA_GROUP_BYTES windows) instead of by layer. megatron-core's schedules pass one "
            "chunk per call (virtual pipeline included); pass that chunk as `model`.",
            UserWarning,
            stacklevel=4,
        )


def wrap_forward_step(
    forward_step_func: Callable[..., Any],
    args: Any = None,
    offloader: Offloader | None = None,
) -> Callable[..., Any]:
    """``forward_step_func`` with the model's forward under the offloader.

    Megatron calls it once per micro-batch: each call is one tba step, and the backward that
    Megatron's schedule runs later reads the saved tensors back. The signature is kept (it is
    inspected by Megatron-LM). ``args``: the parsed flags (default: Megatron-LM's
    ``get_args()`` at the first call); ``offloader``: use this one instead.
    """
    lazy = _Lazy(args, offloader)
    pos = _model_position(forward_step_func)

    @functools.wraps(forward_step_func)
    def wrapped(*a: Any, **k: Any) -> Any:
        with EagerScope(forward_scope(lazy, _find_model(pos, a, k))):
            return forward_step_func(*a, **k)

    wrapped.tba_offloader = lazy  # type: ignore[attr-defined]
    return wrapped


def offloader(wrapped: Callable[..., Any]) -> Offloader | None:
    """The Offloader behind a :func:`wrap_forward_step` result (None while off or unused)."""
    lazy = getattr(wrapped, "tba_offloader", None)
    if lazy is None:
        raise UsageError(
            "tba.megatron: offloader() takes the function wrap_forward_step returned, not "
            f"{type(wrapped).__name__}."
        )
    return lazy.off
