"""The sidecar does not grow with the number of scrapes and scans (a light version of
`benchmarks/bench_sidecar.py rss`, which serves a 200-step two-rank training run)."""

from __future__ import annotations

import pytest

from ._support import SidecarProc, Writer

pytestmark = pytest.mark.slow


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_rss_is_flat_over_many_scrapes_and_scans(metrics_dir, spill_root):
    with (
        Writer(metrics_dir, 0, 1, spill_root=spill_root),
        Writer(metrics_dir, 1, 2),
        SidecarProc(
            "--metrics-dir",
            metrics_dir,
            "--spill-dir",
            spill_root,
            "--interval",
            "0.1",
            "--ssd-tbw",
            "3500",
        ) as sc,
    ):

        def burst(scrapes: int, scans: int) -> int:
            """Scrape /metrics and /status until both counts are reached; return the scans."""
            start = sc.status()["janitor"]["runs"]
            done = runs = 0
            while done < scrapes or runs < scans:
                sc.metrics()
                runs = sc.status()["janitor"]["runs"] - start
                done += 1
            return runs

        burst(100, 5)  # warm-up: caches, the executor's threads, the allocator's arenas
        before = _rss(sc.proc.pid)
        runs = burst(400, 20)
        after = _rss(sc.proc.pid)
    print(f"RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB over 400+ scrapes, {runs} scans")
    assert after - before < 2 << 20, f"RSS grew by {(after - before) / 2**20:.2f} MiB"


def _torch_mapped(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def test_the_sidecar_does_not_load_torch(metrics_dir, spill_root):
    with SidecarProc("--metrics-dir", metrics_dir, "--spill-dir", spill_root) as sc:
        sc.metrics()
        sc.status()
        assert not _torch_mapped(sc.proc.pid)
        rss = _rss(sc.proc.pid)
    print(f"sidecar RSS {rss / 2**20:.1f} MiB")
    assert rss < 100 << 20  # measured 28.6 MiB; with torch it was ~222 MiB
