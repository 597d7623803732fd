"""The sidecar process: a scan loop, a loop-lag monitor and the HTTP routes, on one asyncio
event loop.

NOTE [Sidecar concurrency]
1. One event loop serves HTTP and schedules the work. Nothing that touches the filesystem runs
   on it: the scan (metrics dir, spill roots, /proc/locks, /sys, statvfs, the quota ledger),
   the janitor and the /metrics collection each run as one call in a 2-thread executor. The
   loop only swaps in the results and formats /status.
2. aiofiles is not used: it would run the same calls in the same kind of executor, one await
   per call instead of one per scan. The loop's own delay is measured all the time (a 50 ms
   timer's overshoot, ``tba_sidecar_loop_lag_seconds``); docs/observability.md gives the figures
   with and without the executor (benchmarks/bench_sidecar.py lag).
3. The state a scrape reads (a :class:`~tba.sidecar.node.NodeSnapshot`) is built on the loop
   and never mutated afterwards, so a collection running in the executor needs no lock.
4. The executor does not make the loop immune: its thread holds the GIL while it runs Python
   code, and the loop gets it back within the switch interval (5 ms) only as long as nobody
   holds it longer. A full garbage collection does: ``import tba`` loads torch (~170,000
   objects), and a gen-2 pass over them, triggered by the many small objects a collection
   allocates, holds the GIL far longer than the switch interval. So :meth:`Sidecar.run` calls
   ``gc.freeze()`` once everything is imported: frozen objects are left out of every later
   pass, which then covers only what the sidecar itself allocated (benchmarks/bench_sidecar.py
   lag measures the loop lag of a /metrics collection with it).
5. Shutdown (SIGTERM, SIGINT): stop accepting, let requests in flight finish (up to
   ``shutdown_grace`` seconds), wait for a running scan to end, exit 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import signal
import time

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ..storage.spilldir import host_tag
from . import endurance, views
from .http import HttpServer, Request, Response
from .janitor import Janitor
from .jsonlog import event, loop_exception
from .node import NodeCollector
from .rankfiles import RankCollector, read_dir
from .settings import Settings, SidecarError, check_metrics_dir
from .spill import flock_holders, scan_root
from .views import LAG_BOUNDS, Device, Scan

__all__ = ["Sidecar"]

_LAG_TICK = 0.05


class Sidecar:
    """One node's sidecar. The constructor checks the metrics dir (:class:`SidecarError`);
    :meth:`run` serves until SIGTERM/SIGINT or ``stop``. Its state is read by
    :mod:`tba.sidecar.views` on the event loop."""

    def __init__(self, settings: Settings):
        self.s = settings
        check_metrics_dir(settings.metrics_dir, writable=settings.janitor)
        self.janitor = Janitor(settings.metrics_dir, enabled=settings.janitor)
        self.host = host_tag()
        self.started = time.time()
        self.scan: Scan | None = None
        self.scan_mono = 0.0
        self.scan_error = ""
        self.devices: dict[str, Device] = {}
        self.lag_window_max = 0.0  # since the last scan
        self.lag_last = 0.0  # the previous window's max
        self.lag_max = 0.0  # since start
        self.lag_ticks = 0
        self.lag_over = [0] * len(LAG_BOUNDS)  # ticks later than each bound
        self.scrapes = 0
        self.scrape_seconds = 0.0
        self.scan_wall = 0.0
        self.address: tuple[str, int] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(2, "tba-sidecar")
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Serve until ``stop`` is set, or SIGTERM/SIGINT. Returns the exit code (0).

        It calls ``gc.freeze()`` first (rule 4): objects alive at that point are never collected.
        """
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(loop_exception)  # JSON, never a plain-text traceback
        stop = stop or asyncio.Event()
        # Rule 4: what is loaded now lives as long as the process; keep it out of the GC.
        gc.collect()
        gc.freeze()
        try:  # a lease break (NOTE [Janitor safety] 1) must not kill us: SIGIO terminates
            signal.signal(signal.SIGIO, signal.SIG_IGN)
        except ValueError:
            pass  # not the main thread
        handled = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig, stop)
                handled.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread: the caller stops us through `stop`
        server = HttpServer(self._route, self.s.host, self.s.port)
        try:
            await self._scan_once()  # /healthz and /status are meaningful from the first request
            try:
                self.address = await server.start()
            except OSError as e:
                raise SidecarError(
                    f"cannot listen on {self.s.host}:{self.s.port}: {os.strerror(e.errno or 0)}. "
                    "Pick another --port (0 picks a free one) or --host."
                ) from None
            event(
                logging.INFO,
                "listening",
                host=self.address[0],
                port=self.address[1],
                url=f"http://{self.address[0]}:{self.address[1]}/metrics",
                metrics_dir=self.s.metrics_dir,
                spill_roots=list(self.s.spill_roots),
                interval=self.s.interval,
                ssd_tbw=self.s.ssd_tbw,
                janitor=self.s.janitor,
            )
            self._tasks = [
                asyncio.create_task(self._scan_loop(), name="scan"),
                asyncio.create_task(self._lag_loop(), name="lag"),
            ]
            await stop.wait()
            event(logging.INFO, "stopping", connections=server.connections)
            cancelled = await server.shutdown(self.s.shutdown_grace)
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            event(logging.INFO, "stopped", cancelled_connections=cancelled)
            return 0
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            self._executor.shutdown(wait=True)  # a scan in progress ends before we exit

    def _on_signal(self, sig: int, stop: asyncio.Event) -> None:
        event(logging.INFO, "signal", signal=signal.Signals(sig).name)
        stop.set()

    async def _lag_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(_LAG_TICK)
            lag = max(loop.time() - t0 - _LAG_TICK, 0.0)
            self.lag_window_max = max(self.lag_window_max, lag)
            self.lag_max = max(self.lag_max, lag)
            self.lag_ticks += 1
            for i, bound in enumerate(LAG_BOUNDS):
                if lag > bound:
                    self.lag_over[i] += 1

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.interval)
            await self._scan_once()

    async def _scan_once(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            scan = await loop.run_in_executor(self._executor, self._scan_blocking)
        except Exception as e:  # a scan bug is reported on /healthz, the loop keeps going
            self.scan_error = f"{type(e).__name__}: {e}"
            event(logging.ERROR, "scan_failed", error=self.scan_error)
            return
        self.scan_error = ""
        self.scan = scan
        self.scan_mono = loop.time()
        self.scan_wall = time.time()
        self._update_devices(scan, loop.time())
        self.lag_last, self.lag_window_max = self.lag_window_max, 0.0

    # -- the blocking part (executor) ------------------------------------------------------------
    def _scan_blocking(self) -> Scan:
        t0 = time.perf_counter()
        reading, problem = None, ""
        try:
            check_metrics_dir(self.s.metrics_dir, writable=self.s.janitor)
            reading = read_dir(self.s.metrics_dir)
        except SidecarError as e:
            problem = str(e)
        except OSError as e:
            problem = f"tba.sidecar: cannot read {self.s.metrics_dir}: {os.strerror(e.errno or 0)}"
        locks = flock_holders()
        roots = [scan_root(r, locks) for r in self.s.spill_roots]
        report = self.janitor.run(reading, roots)
        if report.removed:
            roots = [scan_root(r, flock_holders()) for r in self.s.spill_roots]
            if reading is not None:
                reading = read_dir(self.s.metrics_dir)
        disks = {r: endurance.disks_for_path(r) for r in self.s.spill_roots}
        sys_bytes: dict[str, int] = {}
        for found, _why in disks.values():
            for d in found:
                try:
                    sys_bytes[d] = endurance.sectors_written_bytes(d)
                except (OSError, IndexError, ValueError):
                    pass
        # reads /sys: stays in this thread, off the event loop
        tba_bytes = endurance.charge_by_disk(reading.device_bytes) if reading is not None else {}
        return Scan(
            reading, problem, roots, disks, sys_bytes, tba_bytes, report, time.perf_counter() - t0
        )

    def _update_devices(self, scan: Scan, now: float) -> None:
        for root, (found, _why) in scan.disks.items():
            for d in found:
                dev = self.devices.get(d)
                if dev is None:
                    dev = self.devices[d] = Device(
                        [],
                        endurance.RateWindow(self.s.rate_window),
                        endurance.RateWindow(self.s.rate_window),
                    )
                if root not in dev.roots:
                    dev.roots.append(root)
                if d in scan.sys_bytes:
                    dev.sys_bytes = scan.sys_bytes[d]
                    dev.sys_window.add(now, dev.sys_bytes)
                    dev.problem = ""
                else:
                    dev.problem = f"cannot read /sys/block/{d}/stat"
                dev.tba_bytes = scan.tba_bytes.get(d, 0.0)
                dev.tba_window.add(now, dev.tba_bytes)

    def health(self) -> tuple[bool, str]:
        scan = self.scan
        dead = [t for t in self._tasks if t.done()]
        if dead:
            exc = dead[0].exception() if not dead[0].cancelled() else None
            return False, f"the {dead[0].get_name()} task stopped: {exc!r}"
        if scan is None:
            return False, "no scan has completed yet" + (
                f": {self.scan_error}" if self.scan_error else ""
            )
        if self.scan_error:
            return False, f"the last scan failed: {self.scan_error}"
        age = asyncio.get_running_loop().time() - self.scan_mono
        if age > 3 * self.s.interval + 5:
            return False, (
                f"no scan for {age:.0f} s (interval {self.s.interval:g} s): a filesystem or /sys "
                "read is hanging"
            )
        if scan.metrics_problem:
            return False, scan.metrics_problem
        return True, "ok"

    # -- HTTP ------------------------------------------------------------------------------------
    async def _route(self, req: Request) -> Response:
        if req.method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD\n", headers={"Allow": "GET, HEAD"})
        if req.path == "/metrics":
            return await self._metrics(req)
        if req.path == "/healthz":
            ok, why = self.health()
            return Response(200 if ok else 503, f"{why}\n".encode(), headers=_NO_STORE)
        if req.path == "/status":
            body = json.dumps(views.finite(views.status(self)), indent=2, sort_keys=True) + "\n"
            return Response(200, body.encode(), "application/json", _NO_STORE)
        if req.path == "/":
            return Response(200, b"tba sidecar: /metrics /healthz /status\n")
        return Response(404, b"not found; try /metrics, /healthz or /status\n")

    async def _metrics(self, req: Request) -> Response:
        encoder, content_type = choose_encoder(req.headers.get("accept", ""))
        snapshot = views.snapshot(self)  # on the loop: rule 3
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()

        def collect() -> bytes:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(RankCollector(self.s.metrics_dir))
            registry.register(NodeCollector(snapshot))
            return encoder(registry)

        try:
            body = await loop.run_in_executor(self._executor, collect)
        except OSError as e:
            return Response(
                503, f"cannot read {self.s.metrics_dir}: {os.strerror(e.errno or 0)}\n".encode()
            )
        self.scrapes += 1
        self.scrape_seconds = time.perf_counter() - t0
        return Response(200, body, content_type)


_NO_STORE = {"Cache-Control": "no-store"}
