"""How each kind of setting is read: the value parsers of Config's field table (sizes, rates,
counts, choices, paths, quotas), and :func:`parse_size` / :func:`format_size`.

Every parser takes what a caller passed or the environment holds, and returns the typed value
or raises :class:`tba.errors.ValueParseError` saying what it expected; tba/config/__init__.py
collects those into one ConfigError. Re-exported by :mod:`tba.config`, where callers import them
from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from ..errors import ValueParseError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(value: Any) -> int:
    """Parse ``4096``, ``"64MiB"``, ``"1.5GB"`` or ``"4k"`` into bytes.

    KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of 1024; KB/MB/GB/TB are powers of 1000.
    Anything else raises :class:`tba.errors.ValueParseError` (a :class:`tba.ConfigError`).
    """
    if isinstance(value, bool):
        raise ValueParseError(value, "a size, such as 4096, 64MiB or 1GiB")
    if isinstance(value, int):
        if value < 0:
            raise ValueParseError(value, "a size of 0 or more bytes")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n.is_integer() or m.group(2):
                return int(n)
    raise ValueParseError(value, "a size, such as 4096, 64MiB or 1GiB")


def format_size(n: int) -> str:
    """Human-readable binary size, e.g. ``64.0 MiB``."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off", ""):
            return False
    raise ValueParseError(value, "1 or 0 (also true/false, yes/no, on/off)")


def whole_number(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueParseError(value, f"a whole number >= {minimum}")
        try:
            n = int(value.strip()) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            raise ValueParseError(value, f"a whole number >= {minimum}") from None
        if isinstance(value, float) and not value.is_integer():
            raise ValueParseError(value, f"a whole number >= {minimum}")
        if n < minimum:
            raise ValueParseError(value, f"a whole number >= {minimum}")
        return n

    return parse


def size_at_least(minimum: int) -> Callable[[Any], int]:
    least = "more than 0" if minimum <= 1 else f"at least {format_size(minimum)}"

    def parse(value: Any) -> int:
        try:
            n = parse_size(value)
        except ValueParseError:
            n = -1
        if n < minimum:
            raise ValueParseError(value, f"a size of {least}, such as 64MiB or 1GiB")
        return n

    return parse


def _choice(options: tuple[str, ...], upper: bool = False) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str):
            raise ValueParseError(value, "one of " + "|".join(options))
        v = value.strip().upper() if upper else value.strip().lower()
        if v not in options:
            raise ValueParseError(value, "one of " + "|".join(options))
        return v

    return parse


def _path(value: Any) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueParseError(value, "a directory path")
    return os.path.abspath(os.path.expanduser(value.strip()))


def _optional_path(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return _path(value)


def _quota(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    n = parse_size(value)
    if n == 0:
        raise ValueParseError(
            value,
            "a size such as 100GiB, or 'none' for no quota (0 would forbid every offload; "
            "use TBA_ENABLED=0 to turn tba off)",
        )
    return n


def parse_tbw(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    text = str(value).strip().lower().removesuffix("tbw").removesuffix("tb").strip()
    try:
        tb = float(text)
    except ValueError:
        raise ValueParseError(
            value, "the drive's rated endurance in terabytes written, e.g. 3500 or 3500TB"
        ) from None
    if not (tb > 0 and tb != float("inf")):
        raise ValueParseError(value, "a positive number of terabytes written, e.g. 3500")
    return tb


def parse_rate(value: Any) -> int | None:
    """Bytes per second: ``300MB``, ``300MB/s``, ``1GiB/s``; 0, 'none' or empty mean no limit."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
        if value.lower() in ("", "none"):
            return None
        value = value[:-2] if value.lower().endswith("/s") else value
    try:
        n = parse_size(value)
    except ValueParseError:
        raise ValueParseError(value, "a rate such as 300MB/s, 1GiB/s or 0 for no limit") from None
    if n == 0:
        return None
    if n < 4096:
        raise ValueParseError(
            value, "a rate of at least 4096 bytes per second, such as 300MB/s, or 0 for no limit"
        )
    return n


def parse_seconds(value: Any) -> float:
    """A duration: ``10``, ``2.5``, ``500ms``, ``30s``; more than 0."""
    text = str(value).strip().lower() if not isinstance(value, (int, float)) else value
    scale = 1.0
    if isinstance(text, str):
        if text.endswith("ms"):
            text, scale = text[:-2], 1e-3
        elif text.endswith("s"):
            text = text[:-1]
    try:
        n = float(text) * scale
    except (TypeError, ValueError):
        n = float("nan")
    if isinstance(value, bool) or not (0 < n < float("inf")):
        raise ValueParseError(value, "a duration of more than 0 seconds, such as 10, 2.5s or 500ms")
    return n


def seconds_between(low: float, high: float, example: str) -> Callable[[Any], float]:
    """A duration as :func:`parse_seconds` reads it, from ``low`` to ``high`` seconds."""
    expected = f"a duration from {low:g} to {high:g} seconds, such as {example} or {example}s"

    def parse(value: Any) -> float:
        try:
            n = parse_seconds(value)
        except ValueParseError:
            n = float("nan")
        if not low <= n <= high:
            raise ValueParseError(value, expected)
        return n

    return parse


def positive_number(example: str) -> Callable[[Any], float]:
    """A finite number above 0 (``4.8``, ``400e12``)."""

    def parse(value: Any) -> float:
        try:
            n = float(value)
        except (TypeError, ValueError):
            n = 0.0
        if isinstance(value, bool) or not 0 < n < float("inf"):
            raise ValueParseError(value, f"a number above 0, such as {example}")
        return n

    return parse


_SLOWDOWN_EXPECTED = (
    "a factor of the step time of at least 1, such as 1.05 (5% slower at most) or 1.1x"
)


def parse_slowdown(value: Any) -> float:
    """TBA_MAX_SLOWDOWN: how much slower than keeping everything a step may run, as a factor of
    at least 1 (``1.05``, ``1.05x``); NOTE [Slowdown bound] in tba/decide/adaptive.py."""
    if isinstance(value, bool):
        raise ValueParseError(value, _SLOWDOWN_EXPECTED)
    text = value.strip().lower().removesuffix("x") if isinstance(value, str) else value
    try:
        n = float(text)
    except (TypeError, ValueError):
        n = float("nan")
    if not 1.0 <= n < float("inf"):
        raise ValueParseError(value, _SLOWDOWN_EXPECTED)
    return n


def _optional_file(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueParseError(value, "a file path, such as /tmp/tba-trace.jsonl")
    return os.path.abspath(os.path.expanduser(value.strip()))


def _keep(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return whole_number(0)(value)
    except ValueParseError:
        raise ValueParseError(value, "'auto' or a whole number >= 0") from None


def _optional_rank(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return whole_number(0)(value)


POLICIES = ("auto", "offload", "recompute", "selective", "keep")
# recompute_offload: recomputed, and the inputs its checkpoint saves are offloaded, not kept;
# selective: recomputed, but its matrix products kept (NOTE [Selective recompute])
SELECTIVE = "selective"
BLOCK_ACTIONS = ("keep", "offload", "recompute", "recompute_offload", SELECTIVE)
# the TBA_POLICY values that act on a model's blocks (the others keep or offload by keep_last)
BY_BLOCK = ("recompute", SELECTIVE, "auto")
# the actions that run a block again in backward
RECOMPUTED = ("recompute", "recompute_offload", SELECTIVE)
_BLOCK_POLICY_HELP = (
    "per-block actions, keep|offload|recompute|recompute_offload|selective: a list in block "
    "order such as "
    "'recompute,offload,recompute', or 'index:action' pairs such as '0:recompute,2:keep' "
    "(in Python also a list or a dict {index: action})"
)


def _block_policy(value: Any) -> tuple[tuple[int, str], ...] | None:
    """TBA_BLOCK_POLICY: forced per-block actions, as sorted ``(block index, action)`` pairs."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if all(":" in p for p in parts):
            pairs = [tuple(x.strip() for x in p.split(":", 1)) for p in parts]
        elif any(":" in p for p in parts):
            raise ValueParseError(value, _BLOCK_POLICY_HELP)
        else:
            pairs = list(enumerate(parts))
    elif isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        pairs = [tuple(v) for v in value] if value and isinstance(value[0], tuple) else None
        pairs = pairs if pairs is not None else list(enumerate(value))
    else:
        raise ValueParseError(value, _BLOCK_POLICY_HELP)
    out: dict[int, str] = {}
    for i, action in pairs:
        try:
            index = whole_number(0)(i)
        except ValueParseError:
            raise ValueParseError(value, _BLOCK_POLICY_HELP) from None
        if not isinstance(action, str) or action.strip().lower() not in BLOCK_ACTIONS:
            raise ValueParseError(value, _BLOCK_POLICY_HELP)
        if index in out:
            raise ValueParseError(value, _BLOCK_POLICY_HELP + f"; block {index} is named twice")
        out[index] = action.strip().lower()
    return tuple(sorted(out.items())) or None


_BUDGET_EXPECTED = (
    "a fraction of the step's saved bytes in (0, 1], such as 0.35 or 35%, a size of at least "
    "1MiB, such as 2GiB, or 'none'"
)


def _share(value: Any, is_share: bool, expected: str) -> float | None:
    """A fraction in (0, 1]: ``value`` itself when ``is_share`` (a float the caller reads as
    one), or a string with a point or a percent sign ('0.5', '50%'); None: not a fraction."""
    if isinstance(value, str) and ("." in value or value.strip().endswith("%")):
        text = value.strip()
        try:
            share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise ValueParseError(value, expected) from None
    elif is_share:
        share = float(value)
    else:
        return None
    if not 0 < share <= 1:
        raise ValueParseError(value, expected)
    return share


def parse_budget(value: Any) -> int | float | None:
    """TBA_MEMORY_BUDGET: ``None`` (no budget), a fraction (a float in (0, 1]) of the step's
    saved bytes, or bytes (an int of at least 1 MiB). A number with a point or a percent sign
    is a fraction, a whole number or a size is bytes (NOTE [Memory budget] in
    tba/decide/budget.py)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    if isinstance(value, bool):
        raise ValueParseError(value, _BUDGET_EXPECTED)
    share = _share(value, isinstance(value, float), _BUDGET_EXPECTED)
    if share is not None:
        return share
    try:
        n = parse_size(value)
    except ValueParseError:
        raise ValueParseError(value, _BUDGET_EXPECTED) from None
    if n < 1 << 20:
        raise ValueParseError(value, _BUDGET_EXPECTED + f" ({n} bytes is too small to hold a step)")
    return n


_HOST_EXPECTED = (
    "a fraction in (0, 1] of the memory this node can spare, such as 0.5 or 50%, a size such "
    "as 64GiB, or 0 / 'off' for no host tier"
)


def parse_host_bytes(value: Any) -> int | float:
    """TBA_HOST_BYTES: the node's host-tier budget (NOTE [Host tier] in
    tba/storage/hosttier.py). A fraction (a float in (0, 1]) of what the node can spare, bytes
    (an int), or 0 for no host tier. A number with a point or a percent sign is a fraction."""
    if isinstance(value, str) and value.strip().lower() in ("off", "none", "no", ""):
        return 0
    if isinstance(value, bool):
        raise ValueParseError(value, _HOST_EXPECTED)
    is_share = isinstance(value, float) and (0 < value <= 1 or not value.is_integer())
    share = _share(value, is_share, _HOST_EXPECTED)
    if share is not None:
        return share
    try:
        return parse_size(value)
    except ValueParseError:
        raise ValueParseError(value, _HOST_EXPECTED) from None
