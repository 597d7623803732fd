"""``tba sidecar``: one process per node serving every rank's metrics, health and status, and
reclaiming what dead ranks leave behind. It never sits in the data path.

- ``/metrics``: the ranks' prometheus-client multiprocess files (``TBA_METRICS_DIR``), merged,
  plus node gauges (:mod:`tba.sidecar.node`): spill filesystems, SSD endurance, the janitor,
  the sidecar itself.
- ``/healthz``: 200 ``ok``, or 503 and the reason.
- ``/status``: JSON: ranks seen (pid, host, alive), spill roots (usage, free space, devices,
  node quota ledger), devices and endurance figures, janitor counts.

Start it with ``tba sidecar`` (:mod:`tba.cli`); in code::

    import asyncio
    from tba.sidecar import Settings, Sidecar
    asyncio.run(Sidecar(Settings(metrics_dir="/run/tba/metrics", spill_roots=("/nvme/tba",))).run())
"""

from __future__ import annotations

from typing import Any

from .settings import DEFAULT_PORT, Settings, SidecarError

__all__ = ["DEFAULT_PORT", "Settings", "Sidecar", "SidecarError"]


def __getattr__(name: str) -> Any:
    # The server (asyncio, prometheus_client's collectors) loads only when it is used, so that
    # building the `tba` command line stays cheap.
    if name == "Sidecar":
        from .app import Sidecar

        return Sidecar
    raise AttributeError(f"module 'tba.sidecar' has no attribute {name!r}")
