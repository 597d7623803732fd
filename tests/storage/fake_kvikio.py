"""A stand-in for the ``kvikio`` package, with the shapes of its real API across releases.

``CuFile`` really opens the path it is given and really does ``pread``/``pwrite`` on it, so bytes
round-trip through the real slab files, and it starts the transfer only when the ``IOFuture`` is
waited on: a caller that never calls ``get()`` moves nothing. ``get()`` works once, as
``std::future::get`` does. Faults are switched on with attributes:

- ``raise_at_call``: an exception ``pread``/``pwrite`` raise at once (kvikio with no driver:
  ``is_host_memory`` fails before anything is queued);
- ``raise_at_get``: an exception ``IOFuture.get()`` raises (a failed task), for the requests
  ``fail_when(op, offset, size)`` selects (all of them by default);
- ``short``: ``short(op, offset, size) -> n``, the bytes a request really moves and reports;
- ``corrupt_reads``: flip the first byte of every read (True), or of the reads at the offsets a
  predicate ``corrupt_reads(offset)`` selects.

Settings exist in two shapes: ``api="new"`` (25.04 and later: ``defaults.set/get``,
``cufile_driver.get``) and ``api="old"`` (24.x: ``num_threads_reset``, ``task_size_reset``,
``get_num_threads``, ``task_size()``, ``compat_mode() -> bool``, ``DriverProperties``, and a
``set_num_threads`` context manager that does nothing unless entered).

"Device" buffers (:class:`FakeDeviceBuffer`) are host memory behind a
``__cuda_array_interface__``. CuFile reaches them through that pointer, as kvikio would.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import types

import numpy as np


class CompatMode(enum.IntEnum):
    OFF = 0
    ON = 1
    AUTO = 2


_FLAGS = {"r": os.O_RDONLY, "r+": os.O_RDWR, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}
_FLAGS["w+"] = os.O_RDWR | os.O_CREAT | os.O_TRUNC


def _bytes_of(buf, size: int) -> memoryview:
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        ptr = cai["data"][0]
        return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
    return memoryview(buf).cast("B")[:size]


def _length(buf) -> int:
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        return int(np.prod(cai["shape"])) * int(cai["typestr"][2:])
    return memoryview(buf).nbytes


class FakeIOFuture:
    def __init__(self, run):
        self._run = run
        self._used = False

    def get(self) -> int:
        if self._used:
            raise RuntimeError("std::future_error: No associated state")
        self._used = True
        return self._run()

    def done(self) -> bool:
        return True


class FakeCuFile:
    def __init__(self, kv: FakeKvikio, path, flags: str = "r"):
        kv.calls.append(("CuFile", str(path), flags))
        if kv.open_error is not None:
            raise kv.open_error
        if flags not in _FLAGS:
            raise ValueError("Unknown file open flag")
        self.kv = kv
        self.path = str(path)
        self.flags = flags
        self.fd = os.open(self.path, _FLAGS[flags] | os.O_CLOEXEC, 0o644)
        self.closed = False
        kv.files.append(self)

    def pread(self, buf, size=None, file_offset=0, task_size=None) -> FakeIOFuture:
        return self._submit("pread", buf, size, file_offset, task_size)

    def pwrite(self, buf, size=None, file_offset=0, task_size=None) -> FakeIOFuture:
        return self._submit("pwrite", buf, size, file_offset, task_size)

    def _submit(self, op, buf, size, offset, task_size) -> FakeIOFuture:
        kv = self.kv
        size = _length(buf) if size is None else size
        kv.requests.append((op, self.path, offset, size, task_size))
        if kv.raise_at_call is not None:
            raise kv.raise_at_call

        def run() -> int:
            if self.closed:
                raise RuntimeError("File handle is closed")
            if kv.raise_at_get is not None and kv.fail_when(op, offset, size):
                raise kv.raise_at_get
            n = size if kv.short is None else kv.short(op, offset, size)
            view = _bytes_of(buf, size)[:n]
            if op == "pwrite":
                done = os.pwrite(self.fd, view, offset)
            else:
                done = os.preadv(self.fd, [view], offset)
                pick = kv.corrupt_reads
                if done and (pick is True or (callable(pick) and pick(offset))):
                    view[0] ^= 0xFF
            return n if kv.short is not None else done

        return FakeIOFuture(run)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class FakeKvikio(types.ModuleType):
    """A module object that answers like ``import kvikio`` would."""

    def __init__(
        self,
        *,
        version: str = "25.04.00",
        gds: bool | None = False,
        compat: str = "AUTO",
        api: str = "new",
        preferred: bool | None = None,
    ):
        super().__init__("kvikio")
        self.__version__ = version
        self.calls: list = []
        self.files: list[FakeCuFile] = []
        self.requests: list = []
        self.registered: list = []
        self.deregistered: list = []
        self.settings_calls: list = []
        self.open_error: BaseException | None = None
        self.raise_at_call: BaseException | None = None
        self.raise_at_get: BaseException | None = None
        self.fail_when = lambda op, offset, size: True
        self.short = None
        self.corrupt_reads = False
        self.CompatMode = CompatMode
        self.settings = {"num_threads": 1, "task_size": 4 << 20, "compat_mode": CompatMode[compat]}
        if preferred is None:
            preferred = compat == "ON" or not gds
        self.defaults = self._new_defaults(preferred) if api == "new" else self._old_defaults()
        self.cufile_driver = self._driver(api, gds)

    # the module's functions
    def CuFile(self, path, flags="r"):  # noqa: N802 - mirrors kvikio.CuFile
        return FakeCuFile(self, path, flags)

    def memory_register(self, buf) -> None:
        self.registered.append(buf)

    def memory_deregister(self, buf) -> None:
        self.deregistered.append(buf)

    # kvikio.defaults and kvikio.cufile_driver, in the shape of each API
    def _new_defaults(self, preferred: bool) -> types.SimpleNamespace:
        def set_(config):
            self.settings_calls.append(("set", dict(config)))
            self.settings.update(config)

        return types.SimpleNamespace(
            set=set_,
            get=lambda name: self.settings[name],
            is_compat_mode_preferred=lambda: preferred,
        )

    def _old_defaults(self) -> types.SimpleNamespace:
        def reset(name):
            def fn(value):
                self.settings_calls.append((f"{name}_reset", value))
                self.settings[name] = value

            return fn

        @contextlib.contextmanager
        def set_num_threads(n):  # 24.x: a context manager; calling it bare does nothing
            self.settings_calls.append(("set_num_threads entered", n))
            old = self.settings["num_threads"]
            self.settings["num_threads"] = n
            try:
                yield
            finally:
                self.settings["num_threads"] = old

        return types.SimpleNamespace(
            num_threads_reset=reset("num_threads"),
            task_size_reset=reset("task_size"),
            get_num_threads=lambda: self.settings["num_threads"],
            task_size=lambda: self.settings["task_size"],
            compat_mode=lambda: self.settings["compat_mode"] == CompatMode.ON,
            set_num_threads=set_num_threads,
        )

    @staticmethod
    def _driver(api: str, gds: bool | None) -> types.SimpleNamespace:
        def is_gds():
            if gds is None:
                raise RuntimeError("cuFile error: libcufile.so.0: cannot open shared object file")
            return gds

        if api == "new":
            return types.SimpleNamespace(get=lambda name: {"is_gds_available": is_gds}[name]())

        class DriverProperties:
            @property
            def is_gds_available(self):
                return is_gds()

        return types.SimpleNamespace(DriverProperties=DriverProperties)


class FakeDeviceBuffer:
    """Host memory that presents itself as device memory (``__cuda_array_interface__`` only)."""

    def __init__(self, nbytes: int, fill: int | None = None, offset: int = 0):
        self._mem = np.zeros(nbytes + offset + 4096, dtype=np.uint8)
        self.nbytes = nbytes
        self.offset = offset
        if fill is None:
            self.host[:] = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        else:
            self.host[:] = fill

    @property
    def host(self) -> np.ndarray:
        return self._mem[self.offset : self.offset + self.nbytes]

    @property
    def ptr(self) -> int:
        return self.host.__array_interface__["data"][0]

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }


def host_copy_of_fake_device(view) -> memoryview:
    """``_device_to_host`` for fake device memory (which is really host memory)."""
    return memoryview(ctypes.string_at(view.ptr, view.nbytes))
