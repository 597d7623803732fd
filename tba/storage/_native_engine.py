"""One running native engine and its reaper thread: how an op goes in and how its future
resolves (NOTE [Native engine] 3 and 4 in tba/storage/native.py).

:class:`_Engine` submits ops from the caller's thread and settles their completions on the
reaper thread: checksums, usage counters, and a StorageError that names where an op failed.
It holds no reference to a backend; :class:`tba.storage.native.NativeBackend` owns one.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import itertools
import logging
import os
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any

from ..errors import StorageError, hint_for
from ..host.memory import address_of
from ._native_lib import _P, NativeUnavailable, _Completion, _Config, _Info, _name
from .checksum import mismatch_hint
from .filebackend import _release

log = logging.getLogger("tba.storage")

_WHY_EOF, _WHY_STALLED, _WHY_RETRIES, _WHY_SUBMIT = 2, 3, 4, 5
_BATCH = 64


def _buffer_address(buf: memoryview) -> int:
    if buf.readonly:
        return address_of(buf)
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # cheaper than address_of's numpy array


def _failure_hint(err: int, why: int, tries: int) -> str:
    if why == _WHY_EOF:
        return (
            "Unexpected end of file: the spill file is shorter than the extent. Nothing was "
            "zero-filled; the tensor cannot be restored."
        )
    if why == _WHY_STALLED:
        return f"The device made no progress in {tries} attempts."
    if why == _WHY_RETRIES:
        return f"Still {_name(err)} after {tries} attempts. " + hint_for(err)
    if why == _WHY_SUBMIT:
        return "io_uring_enter refused the request itself. " + hint_for(err)
    if err == _errno.ESHUTDOWN:
        return "The backend was closed while the request was being submitted."
    if err == _errno.ECHILD:
        return (
            "This process was forked from the one that opened the backend, whose io_uring it "
            "shares: open a new backend in this process."
        )
    return hint_for(err)


# -- one engine and its reaper ---------------------------------------------------------------
class _Request:
    """What the reaper needs to finish one op. Holds the buffer alive until then."""

    __slots__ = ("future", "op", "shown", "offset", "buf", "digest", "name", "expect", "counted")

    def __init__(self, op, shown, offset, buf, digest, name, expect, counted):
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()  # in flight: cancel() can no longer stop it
        self.op = op
        self.shown = shown
        self.offset = offset
        self.buf = buf
        self.digest = digest
        self.name = name
        self.expect = expect
        self.counted = counted


class _Engine:
    """A C engine and the reaper thread resolving its futures. Holds no reference to a backend,
    so an unclosed backend can still be collected (its finalizer closes this)."""

    def __init__(self, lib: ctypes.CDLL, depth: int, setup_errno: int | None):
        cfg = _Config(size=ctypes.sizeof(_Config), depth=depth)
        cfg.simulate_setup_errno = setup_errno or 0
        handle = _P()
        rc = lib.tba_engine_open(ctypes.byref(cfg), ctypes.byref(handle))
        if rc < 0:
            raise NativeUnavailable(
                -rc,
                f"tba.storage: the native engine could not start: {_name(-rc)} "
                f"({os.strerror(-rc)}). Lower TBA_IO_DEPTH, or use TBA_BACKEND=posix.",
            )
        self.lib = lib
        self.eng: int | None = handle.value
        self.pid = os.getpid()  # a forked child must not use (or wait on) the parent's engine
        self.pending: dict[int, _Request] = {}
        self.stats: dict[str, int] = {}
        self.stats_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._gate = threading.Lock()  # no C call may race with tba_engine_close
        self._closed = False
        self._final: _Info | None = None  # the counters as they were at close
        self._thread = threading.Thread(target=self._run, name="tba-native-reaper", daemon=True)
        self._thread.start()

    # -- calls into the engine -------------------------------------------------------------
    def call(self, name: str, *args: Any) -> int:
        if os.getpid() != self.pid:
            return -_errno.ECHILD
        with self._gate:
            if self.eng is None:
                return -_errno.ESHUTDOWN
            return getattr(self.lib, name)(self.eng, *args)

    def info(self) -> _Info:
        info = _Info(size=ctypes.sizeof(_Info))
        if self.call("tba_engine_info", ctypes.byref(info)) < 0 and self._final is not None:
            return self._final  # closed: the last counters still stand
        return info

    def submit(self, code: int, handle: int, buf: memoryview, offset: int, unit: int, req):
        uid = next(self._ids)
        self.pending[uid] = req
        n = buf.nbytes
        if os.getpid() != self.pid:
            rc = -_errno.ECHILD
        else:
            rc = self._submit(code, handle, buf, n, offset, unit, uid)
        if rc < 0:
            del self.pending[uid]
            err = -rc
            req.future.set_exception(
                StorageError(req.op, req.shown, offset, n, err, _failure_hint(err, 0, 0))
            )
        return req.future

    def _submit(self, code, handle, buf, n, offset, unit, uid) -> int:
        with self._gate:
            if self.eng is None:
                return -_errno.ESHUTDOWN
            return self.lib.tba_engine_submit(
                self.eng, code, handle, _buffer_address(buf), n, offset, unit, uid
            )

    # -- completions -----------------------------------------------------------------------
    def _run(self) -> None:
        out = (_Completion * _BATCH)()
        reap = self.lib.tba_engine_reap
        while True:
            eng = self.eng
            if eng is None:
                return  # closed by a callback on this thread
            n = reap(eng, out, _BATCH, -1)
            if n < 0:
                if n != -_errno.ESHUTDOWN:
                    log.error("tba.storage: the native reaper stops: %s", _name(-n))
                return
            self._dispatch([(c.user_data, c.result, c.done, c.why, c.tries) for c in out[:n]])

    def _dispatch(self, batch: list[tuple[int, int, int, int, int]]) -> None:
        """Settle a batch (checksums, errors), count it, then resolve its futures: the usage
        counters already include an op when its future resolves, as with the other backends."""
        tally = dict.fromkeys(self.stats, 0)
        settled = []
        for uid, result, done, why, tries in batch:
            req = self.pending.pop(uid, None)
            if req is not None:
                try:
                    settled.append((req, *self._settle(req, tally, result, done, why, tries)))
                except BaseException as e:  # never let one op stop the reaper
                    settled.append((req, False, e))
        if any(tally.values()):
            with self.stats_lock:
                for k, v in tally.items():
                    self.stats[k] += v
        for req, ok, value in settled:
            try:
                if ok:
                    req.future.set_result(value)
                else:
                    req.future.set_exception(value)
            except InvalidStateError:  # pragma: no cover - the future is ours alone
                pass

    def _settle(
        self, req: _Request, tally: dict[str, int], result: int, done: int, why: int, tries: int
    ) -> tuple[bool, Any]:
        """(True, the future's value) or (False, its exception); adds the op to ``tally``."""
        buf = req.buf
        n = buf.nbytes
        counted = req.counted and bool(tally)
        if result < 0:
            err = -result
            if counted:
                tally["io_errors"] += 1
            hint = _failure_hint(err, why, tries)
            return False, StorageError(req.op, req.shown, req.offset + done, n - done, err, hint)
        if req.op == "write":
            value = req.digest(buf) if req.digest is not None else None
            if counted:
                tally["writes"] += 1
                tally["bytes_written"] += n
            return True, value
        if req.digest is not None and req.expect is not None:
            got = req.digest(buf)
            if got != req.expect:
                if counted:
                    tally["io_errors"] += 1
                    tally["checksum_errors"] += 1
                hint = mismatch_hint(req.name, req.expect, got)
                return False, StorageError("read", req.shown, req.offset, n, _errno.EBADMSG, hint)
        if counted:
            tally["reads"] += 1
            tally["bytes_read"] += n
        return True, None

    def close(self) -> None:
        """Refuse new ops, let the reaper finish every op in flight, then free the engine."""
        if os.getpid() != self.pid:  # a forked child: drop its copies, leave the parent's ops
            if self.eng is not None:
                self.lib.tba_engine_close(self.eng)
                self.eng = None
            return
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self.lib.tba_engine_shutdown(self.eng)
        if threading.current_thread() is self._thread:
            self._run()  # closed from a done-callback: finish the rest right here
        else:
            self._thread.join()
        self._final = self.info()
        with self._gate:
            self.lib.tba_engine_close(self.eng)
            self.eng = None
        # Every op has been reaped. Closed from a callback, the rest of that callback's batch is
        # still in `pending`: the reaper resolves it as soon as the callback returns.


def _release_native(engine: _Engine, *slab_parts: Any) -> None:
    engine.close()  # before the slab fds close: in-flight ops still use them
    _release(*slab_parts)
