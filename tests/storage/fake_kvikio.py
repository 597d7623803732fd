"""A stand-in for the ``kvikio`` package that behaves like kvikio 26.10 where tba can tell.

``CuFile`` really opens the path it is given, twice as kvikio does (plain, and O_DIRECT when the
filesystem allows it), and really does ``pread``/``pwrite`` on it, so bytes round-trip through the
real slab files. What it copies from the real library (cpp/src/file_handle.cpp,
cpp/include/kvikio/detail/{posix_io,parallel_operation}.hpp; tests/storage/test_kvikio_real.py
checks the same behaviour against the real one):

- Argument errors raise at the call: a size larger than the buffer (ValueError), a negative
  offset (OverflowError), unknown open flags (ValueError), a path that does not open
  (RuntimeError "Unable to open file. ...").
- The I/O starts at submit, on threads: ``done()`` is False until it has ended, ``get()`` waits
  for it and works once (``std::future::get``); after it, ``done()`` raises ValueError.
- A request is split into tasks of ``task_size``, and the last task does its own part, then
  waits for the others in order: when one task fails, ``get()`` raises while later tasks may
  still be using the buffer.
- Host buffers take the POSIX path, which loops until every byte moved (never a short count)
  and raises at end of file. Reads use the O_DIRECT descriptor only when
  ``auto_direct_io_read`` is on (off by default), writes when ``auto_direct_io_write`` is (on),
  and only for the page-aligned part; ``paths`` records which one each piece took.
- Device buffers (:class:`FakeDeviceBuffer`) go through "cuFile" only when GDS is in use and the
  request is at least ``gds_threshold`` bytes; smaller ones are bounced through POSIX at once.
- Failures carry kvikio's texts: ``KvikIO failure at: <file>:<line>: POSIX error on pwrite: No
  space left on device``, ``... POSIX error on pread: EOF``, and for EBADF (a closed CuFile
  too) ``... POSIX error: Operation not permitted``.

Faults are switched on with attributes:

- ``raise_at_call``: an exception ``pread``/``pwrite`` raise at once (kvikio with no driver:
  ``is_host_memory`` fails before anything is queued);
- ``raise_at_get``: an exception the tasks that ``fail_when(op, offset, size)`` selects raise
  (all of them by default), so ``get()`` raises it;
- ``hold_tasks``: tasks that do not fail wait until something waits for them (a busy pool);
  :meth:`FakeKvikio.release` lets them all go;
- ``short``: ``short(op, offset, size) -> n``, the bytes a cuFile task really moves and reports
  (only cuFile returns short counts);
- ``corrupt_reads``: flip the first byte of every read (True), or of the reads at the offsets a
  predicate ``corrupt_reads(offset)`` selects.

Settings exist in two shapes: ``api="new"`` (25.04 and later: ``defaults.set/get``,
``cufile_driver.get``; ``direct_io=False`` gives a release before 26.02, without the
``auto_direct_io_*`` settings) and ``api="old"`` (24.x: ``num_threads_reset``,
``task_size_reset``, ``get_num_threads``, ``task_size()``, ``gds_threshold()``,
``compat_mode() -> bool``, ``DriverProperties``, and a ``set_num_threads`` context manager that
does nothing unless entered).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import mmap
import os
import threading
import types

import numpy as np

PAGE = 4096
_WHERE = "/__w/kvikio/kvikio/cpp/include/kvikio/detail/posix_io.hpp:90"


class CompatMode(enum.IntEnum):
    OFF = 0
    ON = 1
    AUTO = 2


def _open_flags(flags: str) -> int:
    """kvikio's open_fd_parse_flags: only the first one or two characters count."""
    if not flags:
        raise ValueError("KvikIO failure at: file_utils.cpp:130: Unknown file open flag")
    if flags[0] == "r":
        mode = os.O_RDWR if flags[1:2] == "+" else os.O_RDONLY
    elif flags[0] == "w":
        mode = (os.O_RDWR if flags[1:2] == "+" else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC
    elif flags[0] == "a":
        raise ValueError("KvikIO failure at: file_utils.cpp:141: Open flag 'a' isn't supported")
    else:
        raise ValueError("KvikIO failure at: file_utils.cpp:142: Unknown file open flag")
    return mode | os.O_CLOEXEC


def kvikio_failure(text: str) -> RuntimeError:
    return RuntimeError(f"KvikIO failure at: {_WHERE}: {text}")


def posix_error(op: str, code: int) -> RuntimeError:
    """The exception kvikio's POSIX path raises for a failed pread/pwrite."""
    if code == errno.EBADF:
        return kvikio_failure("POSIX error: Operation not permitted")
    return kvikio_failure(f"POSIX error on {op}: {os.strerror(code)}")


def _is_device(buf) -> bool:
    return getattr(buf, "__cuda_array_interface__", None) is not None


def _address_and_length(buf, size) -> tuple[int, int, memoryview | None]:
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        n = int(np.prod(cai["shape"])) * int(cai["typestr"][2:])
        return int(cai["data"][0]), n, None
    mv = memoryview(buf).cast("B")
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data), mv.nbytes, mv


def _view(ptr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") if n else memoryview(b"")


class _Task:
    """One task on kvikio's pool: a thread started at submit."""

    def __init__(self, kv: FakeKvikio, run, held: bool):
        self._run = run
        self._go = threading.Event()
        if not held:
            self._go.set()
        self.finished = threading.Event()
        self.value: int = 0
        self.error: BaseException | None = None
        kv._tasks.append(self)
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        self._go.wait()
        try:
            self.value = self._run()
        except BaseException as e:
            self.error = e
        finally:
            self.finished.set()

    def release(self) -> None:
        self._go.set()

    def wait(self) -> int:
        self._go.set()  # something waits for it: a held task runs now
        self.finished.wait()
        if self.error is not None:
            raise self.error
        return self.value


class FakeIOFuture:
    def __init__(self, task: _Task | None, ready: int | None = None):
        self._task = task
        self._ready = ready
        self._used = False

    def get(self) -> int:
        if self._used:
            raise RuntimeError("std::future_error: No associated state")
        self._used = True
        if self._task is None:
            return int(self._ready or 0)
        return self._task.wait()

    def done(self) -> bool:
        if self._used:  # get() took the shared state
            raise ValueError(
                "KvikIO failure at: libkvikio/include/kvikio/utils.hpp:173: The future object "
                "does not refer to a valid shared state."
            )
        return self._task is None or self._task.finished.is_set()


class FakeCuFile:
    def __init__(self, kv: FakeKvikio, path, flags: str = "r"):
        kv.calls.append(("CuFile", str(path), flags))
        if kv.open_error is not None:
            raise kv.open_error
        mode = _open_flags(flags)
        self.kv = kv
        self.path = str(path)
        self.flags = flags
        try:
            self.fd = os.open(self.path, mode, 0o644)
        except OSError as e:
            raise RuntimeError(
                "Unable to open file. Linux system/library function call error at: "
                f"/__w/kvikio/kvikio/cpp/src/file_utils.cpp:160: {os.strerror(e.errno or 0)}"
            ) from None
        self.fd_direct = -1
        s = kv.settings
        dio = s.get("auto_direct_io_read", False) or s.get("auto_direct_io_write", False)
        if not kv.preferred or dio:
            try:  # kvikio opens the file a second time with O_DIRECT, where the filesystem can
                self.fd_direct = os.open(self.path, (mode & ~os.O_TRUNC) | os.O_DIRECT)
            except OSError:
                self.fd_direct = -1
        self.closed = False
        kv.files.append(self)

    def pread(self, buf, size=None, file_offset=0, task_size=None) -> FakeIOFuture:
        return self._submit("pread", buf, size, file_offset, task_size)

    def pwrite(self, buf, size=None, file_offset=0, task_size=None) -> FakeIOFuture:
        return self._submit("pwrite", buf, size, file_offset, task_size)

    # -- kvikio's FileHandle::pread/pwrite ------------------------------------------------------
    def _submit(self, op, buf, size, offset, task_size) -> FakeIOFuture:
        kv = self.kv
        ptr, length, _keep = _address_and_length(buf, size)
        if size is not None and size > length:
            raise ValueError("Size is greater than the size of the buffer")
        size = length if size is None else int(size)
        if offset < 0:
            raise OverflowError("can't convert negative value to size_t")
        task_size = int(task_size) if task_size else int(kv.settings["task_size"])
        kv.requests.append((op, self.path, offset, size, task_size))
        if kv.raise_at_call is not None:
            raise kv.raise_at_call
        device = _is_device(buf)
        threshold = int(kv.settings["gds_threshold"])
        if device and size < threshold:  # kvikio bounces these through POSIX, synchronously
            if kv.raise_at_get is not None and kv.fail_when(op, offset, size):
                raise kv.raise_at_get  # so its failures raise at the call
            self._posix(op, ptr, size, offset, "posix-bounce")
            return FakeIOFuture(None, size)
        kind = ("posix-bounce" if kv.preferred else "cufile") if device else "posix"

        def part(p: int, n: int, at: int):
            def run() -> int:
                _keep  # noqa: B018 - the buffer stays alive while a task may use it
                if kv.raise_at_get is not None and kv.fail_when(op, at, n):
                    raise kv.raise_at_get
                if kind == "cufile":
                    return self._cufile(op, p, n, at)
                return self._posix(op, p, n, at, kind)

            return run, kv.raise_at_get is not None and kv.fail_when(op, at, n)

        def task(p: int, n: int, at: int) -> _Task:
            run, fails = part(p, n, at)
            return _Task(kv, run, held=kv.hold_tasks and not fails)

        if task_size >= size or size <= PAGE:  # kvikio's single-task guard
            return FakeIOFuture(task(ptr, size, offset))
        firsts = []
        pos = 0
        while size - pos > task_size:
            firsts.append(task(ptr + pos, task_size, offset + pos))
            pos += task_size
        own, fails = part(ptr + pos, size - pos, offset + pos)

        def last() -> int:  # kvikio's last task: its own part, then the others in order
            total = own()
            for t in firsts:
                total += t.wait()
            return total

        return FakeIOFuture(_Task(kv, last, held=kv.hold_tasks and not fails))

    def _cufile(self, op: str, ptr: int, n: int, at: int) -> int:
        kv = self.kv
        k = n if kv.short is None else kv.short(op, at, n)
        moved = max(0, min(k, n))  # what it reports may be nonsense; what it moves is not
        done = self._io(op, self.fd, _view(ptr, moved), at, "cufile") if moved else 0
        return k if kv.short is not None else done

    def _posix(self, op: str, ptr: int, n: int, at: int, kind: str) -> int:
        """posix_host_io: the page-aligned middle through O_DIRECT when allowed, the rest
        buffered, looping until done."""
        kv = self.kv
        setting = "auto_direct_io_read" if op == "pread" else "auto_direct_io_write"
        direct = self.fd_direct if kv.settings.get(setting, False) and kind == "posix" else -1
        pos = 0
        while pos < n:
            cur, left = at + pos, n - pos
            if direct == -1:
                k = self._io(op, self.fd, _view(ptr + pos, left), cur, f"{kind}-buffered")
            elif cur % PAGE:
                first = min(PAGE - cur % PAGE, left)
                k = self._io(op, self.fd, _view(ptr + pos, first), cur, f"{kind}-buffered")
            elif left < PAGE:
                k = self._io(op, self.fd, _view(ptr + pos, left), cur, f"{kind}-buffered")
            else:
                want = left - left % PAGE
                if (ptr + pos) % PAGE:  # kvikio bounces through a page-aligned buffer
                    bounce = mmap.mmap(-1, want)
                    view = memoryview(bounce)
                    if op == "pwrite":
                        view[:] = _view(ptr + pos, want)
                    k = self._io(op, direct, view, cur, f"{kind}-direct")
                    if op == "pread":
                        _view(ptr + pos, k)[:] = view[:k]
                    view.release()
                    bounce.close()
                else:
                    k = self._io(op, direct, _view(ptr + pos, want), cur, f"{kind}-direct")
            if op == "pread" and k == 0:
                raise kvikio_failure("POSIX error on pread: EOF")
            pos += k
        return n

    def _io(self, op: str, fd: int, view: memoryview, at: int, kind: str) -> int:
        kv = self.kv
        if self.closed:
            fd = -1
        try:
            done = os.pwrite(fd, view, at) if op == "pwrite" else os.preadv(fd, [view], at)
        except OSError as e:
            raise posix_error(op, e.errno or errno.EIO) from None
        kv.paths.append((op, at, len(view), kind))
        if op == "pread" and done:
            pick = kv.corrupt_reads
            if pick is True or (callable(pick) and pick(at)):
                view[0] ^= 0xFF
        return done

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            if self.fd_direct != -1:
                os.close(self.fd_direct)


class FakeKvikio(types.ModuleType):
    """A module object that answers like ``import kvikio`` would."""

    def __init__(
        self,
        *,
        version: str = "26.10.00",
        gds: bool | None = False,
        compat: str = "AUTO",
        api: str = "new",
        preferred: bool | None = None,
        direct_io: bool = True,
    ):
        super().__init__("kvikio")
        self.__version__ = version
        self.calls: list = []
        self.files: list[FakeCuFile] = []
        self.requests: list = []
        self.paths: list = []
        self.registered: list = []
        self.deregistered: list = []
        self.settings_calls: list = []
        self.open_error: BaseException | None = None
        self.raise_at_call: BaseException | None = None
        self.raise_at_get: BaseException | None = None
        self.fail_when = lambda op, offset, size: True
        self.hold_tasks = False
        self.short = None
        self.corrupt_reads = False
        self._tasks: list[_Task] = []
        self.CompatMode = CompatMode
        self.settings = {
            "num_threads": 1,
            "task_size": 4 << 20,
            "gds_threshold": 16 << 10,
            "compat_mode": CompatMode[compat],
        }
        if direct_io and api == "new":
            self.settings.update(auto_direct_io_read=False, auto_direct_io_write=True)
        if preferred is None:
            preferred = compat == "ON" or not gds
        self.preferred = preferred
        self.defaults = self._new_defaults(preferred) if api == "new" else self._old_defaults()
        self.cufile_driver = self._driver(api, gds)

    @property
    def pending(self) -> int:
        """Tasks that have not ended yet."""
        return sum(not t.finished.is_set() for t in self._tasks)

    def release(self) -> None:
        """Let every held task run, and wait for all of them."""
        for t in list(self._tasks):
            t.release()
        for t in list(self._tasks):
            t.finished.wait()

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
            for key, value in config.items():  # kvikio applies them in turn
                if key not in self.settings:
                    raise KeyError(key)
                self.settings[key] = value

        def get(name):
            return self.settings[name]

        return types.SimpleNamespace(
            set=set_,
            get=get,
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
            gds_threshold=lambda: self.settings["gds_threshold"],
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
