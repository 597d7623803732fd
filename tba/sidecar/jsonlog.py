"""Structured logs for the sidecar: one JSON object per line on stderr.

Every record carries ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``event`` (a short
snake_case name, the log call's message) and the ``fields`` passed as keyword arguments::

    {"ts": "2025-01-01T12:00:00.123Z", "level": "info", "event": "listening", "port": 9477}

Library code logs through :func:`event`; only ``tba sidecar`` installs the JSON handler, so an
application that imports :mod:`tba.sidecar` keeps its own logging setup. In the sidecar process
nothing else reaches stderr either (NOTE [Malformed requests] 4 in http.py): :func:`install`
also formats every other logger (asyncio's included) and Python warnings as JSON, turns an
uncaught exception of the main thread or another thread into an ``uncaught_exception`` record,
and :func:`loop_exception` does the same for what the event loop reports.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any, TextIO

__all__ = ["JsonFormatter", "event", "install", "logger", "loop_exception"]

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
            out["logger"] = record.name  # from elsewhere: tba.storage, asyncio, py.warnings
        for k, v in (fields or {}).items():
            out.setdefault(k, _jsonable(v))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def _traceback(exc: BaseException | None) -> str:
    return "".join(traceback.format_exception(exc)) if exc is not None else ""


def loop_exception(loop: Any, context: dict[str, Any]) -> None:
    """An event loop exception handler (``loop.set_exception_handler``) that logs JSON."""
    exc = context.get("exception")
    event(
        logging.ERROR,
        "asyncio_error",
        message=context.get("message", ""),
        error=repr(exc) if exc is not None else "",
        traceback=_traceback(exc),
    )


def _uncaught(
    kind: type[BaseException], exc: BaseException, tb: TracebackType | None, thread: str
) -> None:
    if issubclass(kind, KeyboardInterrupt):
        return
    event(
        logging.CRITICAL,
        "uncaught_exception",
        thread=thread,
        error=repr(exc),
        traceback="".join(traceback.format_exception(kind, exc, tb)),
    )


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        name = args.thread.name if args.thread is not None else "?"
        _uncaught(args.exc_type, args.exc_value, args.exc_traceback, name)


def install(level: str = "INFO", stream: TextIO | None = None) -> logging.Handler:
    """Make this process log JSON lines to ``stream`` (stderr): the ``tba`` loggers at
    ``level``, every other logger (asyncio, Python warnings) at WARNING and above, and uncaught
    exceptions. For the ``tba sidecar`` process only: it takes over the process's logging."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("tba")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    everything = logging.getLogger()
    everything.handlers[:] = [handler]
    everything.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    sys.excepthook = lambda kind, exc, tb: _uncaught(kind, exc, tb, "MainThread")
    threading.excepthook = _thread_hook
    return handler
