"""Disk traffic without offloading: what I/O alone costs compute on this machine.

:class:`IoLoad` writes and reads a few 8 MiB extents in a loop through a tba backend
(O_DIRECT, the same engine tba picks), each direction paced by the backend's own bandwidth cap.
``bench_step.py --io-load`` runs the no-offload step with this load at the rates tba moved in
its previous step. On a VM whose virtual disk is served by the host's CPUs, that traffic slows
compute even though the guest spends almost no CPU on it; the ratio tba / (none + I/O) is then
tba's cost beyond the traffic itself.
"""

from __future__ import annotations

import threading

import tba
from tba.host.memory import aligned_empty, as_memoryview
from tba.storage import open_backend

CHUNK = 8 << 20


class IoLoad:
    def __init__(self, spill_dir: str, extents: int = 4):
        self.backend = open_backend(tba.Config(spill_dir=spill_dir))
        self.extents = [self.backend.allocate(CHUNK) for _ in range(extents)]
        if any(e is None for e in self.extents):
            raise RuntimeError("io load: no disk space for its extents")
        self.bufs = [as_memoryview(aligned_empty(CHUNK)) for _ in range(2)]
        for e in self.extents:  # every extent holds data before it is read
            self.backend.write(e, self.bufs[0]).result()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.moved = {"write": 0, "read": 0}

    def start(self, write_bps: float, read_bps: float) -> None:
        self._stop.clear()
        self.moved = {"write": 0, "read": 0}
        for op, bps, buf in (("write", write_bps, self.bufs[0]), ("read", read_bps, self.bufs[1])):
            if bps <= 0:
                continue
            self.backend.set_rate(op, int(bps))
            t = threading.Thread(target=self._loop, args=(op, buf), daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, op: str, buf: memoryview) -> None:
        i = 0
        while not self._stop.is_set():
            e = self.extents[i % len(self.extents)]
            if op == "write":
                self.backend.write(e, buf).result()
            else:
                self.backend.read(e, buf).result()
            self.moved[op] += CHUNK
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._threads.clear()

    def close(self) -> None:
        self.stop()
        for e in self.extents:
            self.backend.free(e)
        self.backend.close()
