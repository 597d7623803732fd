"""Structured logs for the sidecar: one JSON object per line on stderr.

Every record carries ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``event`` (a short
snake_case name, the log call's message) and the ``fields`` passed as keyword arguments::

    {"ts": "2025-01-01T12:00:00.123Z", "level": "info", "event": "listening", "port": 9477}

Library code logs through :func:`event`; only ``tba sidecar`` installs the JSON handler, so an
application that imports :mod:`tba.sidecar` keeps its own logging setup.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

__all__ = ["JsonFormatter", "event", "install", "logger"]

logger = logging.getLogger("tba.sidecar")


def event(level: int, name: str, **fields: Any) -> None:
    """Log ``name`` with ``fields`` at ``level`` (a :mod:`logging` level)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"tba_fields": fields})


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        fields = getattr(record, "tba_fields", None)
        if fields is None and record.name != logger.name:
            out["logger"] = record.name  # a record from elsewhere in tba (e.g. tba.storage)
        for k, v in (fields or {}).items():
            out.setdefault(k, _jsonable(v))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def install(level: str = "INFO", stream: TextIO | None = None) -> logging.Handler:
    """Send the ``tba`` loggers' records to ``stream`` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("tba")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    return handler
