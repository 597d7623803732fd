"""`tba.Config`: every setting, its ``TBA_*`` variable, its parser and its help text.

This module is the only reader of ``os.environ`` in tba. Precedence, per field: an explicit
argument beats the environment, which beats the default. All problems are collected and raised
together as one :class:`tba.ConfigError`.

The field table (each field's variable, parser, default and help) is in tba/config/fields.py
and the value parsers (and :func:`parse_size`, :func:`format_size`) in tba/config/values.py;
this module holds :class:`Config` and the environment. The parsers that other parts use too
(``tba`` command's flags, ``tba plan``'s budget) are re-exported here: one rule and one error
wording per kind of value.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, ValueParseError
from .fields import _FIELDS, BACKENDS, CHECKSUMS, _default_spill_dir
from .values import (
    BLOCK_ACTIONS,
    BY_BLOCK,
    POLICIES,
    RECOMPUTED,
    SELECTIVE,
    format_size,
    parse_budget,
    parse_rate,
    parse_seconds,
    parse_size,
    parse_tbw,
    positive_number,
    seconds_between,
    size_at_least,
    whole_number,
)

__all__ = [
    "Config",
    "parse_size",
    "parse_budget",
    "parse_rate",
    "parse_seconds",
    "parse_tbw",
    "positive_number",
    "seconds_between",
    "size_at_least",
    "whole_number",
    "format_size",
    "environment",
    "BACKENDS",
    "BLOCK_ACTIONS",
    "BY_BLOCK",
    "RECOMPUTED",
    "SELECTIVE",
    "CHECKSUMS",
    "POLICIES",
]

_UNSET: Any = object()

ENV_NAMES = {f.env: name for name, f in _FIELDS.items()}

# Variables outside TBA_* that tba reads: Config.rank's fallback, and what `tba doctor` bases
# advice on (ranks per node for the per-process disk quota, and why no CUDA device is seen).
OTHER_ENV = (
    *(e for f in _FIELDS.values() for e in f.fallback_env),
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
)


def environment() -> dict[str, str]:
    """A copy of every variable tba reads, as set now: each ``TBA_*`` one (known or not, so a
    caller can report them) and those in :data:`OTHER_ENV`. ``Config(environ=...)`` takes it."""
    return {k: v for k, v in os.environ.items() if k.startswith("TBA_") or k in OTHER_ENV}


_warned_env: set[str] = set()


def _warn_unknown_env(environ: Mapping[str, str]) -> None:
    for key in environ:
        if not key.startswith("TBA_") or key in ENV_NAMES or key in _warned_env:
            continue
        _warned_env.add(key)
        close = difflib.get_close_matches(key, list(ENV_NAMES), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(ENV_NAMES)}"
        warnings.warn(
            f"tba.config: unknown environment variable {key} is ignored{hint}",
            UserWarning,
            stacklevel=4,
        )


@dataclasses.dataclass(frozen=True)
class Config:
    """Every tba setting. ``Config()`` reads the ``TBA_*`` environment; arguments override it.

    Sizes accept ``4096``, ``"64MiB"``, ``"1GiB"``. See :meth:`describe` for each field's help.
    """

    enabled: bool = _UNSET
    spill_dir: str = _UNSET
    backend: str = _UNSET
    min_offload_bytes: int = _UNSET
    io_threads: int = _UNSET
    io_depth: int = _UNSET
    gds_task_bytes: int = _UNSET
    coalesce_bytes: int = _UNSET
    staging_bytes: int = _UNSET
    prefetch_bytes: int = _UNSET
    device_prefetch_bytes: int = _UNSET
    staging_full: str = _UNSET
    staging_wait: float = _UNSET
    keep_last: int | str = _UNSET
    policy: str = _UNSET
    max_slowdown: float = _UNSET
    block_policy: tuple[tuple[int, str], ...] | None = _UNSET
    memory_budget: int | float | None = _UNSET
    host_bytes: int | float = _UNSET
    max_disk_bytes: int | None = _UNSET
    node_max_disk_bytes: int | None = _UNSET
    ssd_tbw: float | None = _UNSET
    min_free_bytes: int = _UNSET
    slab_bytes: int = _UNSET
    group_bytes: int = _UNSET
    recompute_weights: bool = _UNSET
    checksum: str = _UNSET
    max_write_bps: int | None = _UNSET
    max_read_bps: int | None = _UNSET
    trace: str | None = _UNSET
    metrics_dir: str | None = _UNSET
    log_level: str = _UNSET
    rank: int | None = _UNSET
    # Where each value came from ("argument", "env", "default"); not compared.
    sources: Mapping[str, str] = dataclasses.field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    environ: Mapping[str, str] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        environ = os.environ if self.environ is None else self.environ
        _warn_unknown_env(environ)
        problems: list[str] = []
        sources: dict[str, str] = {}
        for name, f in _FIELDS.items():
            raw = getattr(self, name)
            where = "argument"
            label = f"{name}={raw!r}"
            if raw is _UNSET:
                env_key = next((k for k in (f.env, *f.fallback_env) if k in environ), None)
                if env_key is not None:
                    raw, where = environ[env_key], "env"
                    label = f"{env_key}={raw!r}"
                else:
                    raw, where = f.default, "default"
            try:
                value = None if (raw is None and f.default is None) else f.parse(raw)
            except ValueParseError as bad:
                problems.append(f"{label} is invalid; expected {bad.expected}.")
                value = f.default
            object.__setattr__(self, name, value)
            sources[name] = where
        if self.spill_dir is None:
            object.__setattr__(self, "spill_dir", _default_spill_dir())
        if self.rank is None:
            object.__setattr__(self, "rank", 0)
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "environ", None)
        if problems:
            raise ConfigError(problems)

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (explicit arguments keep their precedence)."""
        current = {n: getattr(self, n) for n in _FIELDS if self.sources.get(n) == "argument"}
        current.update(changes)
        return Config(**current)

    def as_dict(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in _FIELDS}

    @staticmethod
    def describe() -> list[tuple[str, str, Any, str]]:
        """(field, environment variable, default, help) for every setting."""
        return [(n, f.env, f.default, f.help) for n, f in _FIELDS.items()]
