"""The sidecar's cost: event-loop lag of its scans, and its memory over a long run.

    python benchmarks/bench_sidecar.py lag [--ranks 8,64,1000] [--repeats 20]
    python benchmarks/bench_sidecar.py rss [--steps 200] [--layers 6 --hidden 256 --seq 256
                                            --batch 4] [--scrape-every 0.5]

``lag``: a metrics dir with the files of N ranks (what tba.metrics writes: counters, the
histogram, live gauges), and one spill root. One scan (read the metrics dir, scan the spill
root and /proc/locks, find the devices, read /sys) and one /metrics collection are run
(inline) on the event loop itself, (executor) through ``run_in_executor``, and (freeze) through
``run_in_executor`` after ``gc.freeze()``, which is what the sidecar does
(NOTE [Sidecar concurrency] in tba/sidecar/app.py), while a 1 ms timer measures how late the
loop wakes up. Work time and the worst lag of each repeat: medians, and the maximum over --repeats.

``rss``: `tba sidecar` (subprocess) serving two training processes (tests/sidecar/_rank.py, a
small GPT with tba.Offloader and TBA_METRICS_DIR) for --steps steps each, scraped every
--scrape-every seconds (/metrics and /status); the sidecar's RSS is sampled every second.
Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _machine import machine_line  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.mmap_dict import MmapedDict, mmap_key  # noqa: E402

from tba.sidecar import endurance  # noqa: E402
from tba.sidecar.rankfiles import RankCollector, read_dir  # noqa: E402
from tba.sidecar.spill import flock_holders, scan_root  # noqa: E402


# -- lag ---------------------------------------------------------------------------------------
def _fill(metrics_dir: str, ranks: int) -> None:
    """Files shaped like tba.metrics' (same families and label sets) for ``ranks`` processes."""
    counters = [
        "tba_bytes_offloaded",
        "tba_bytes_reloaded",
        "tba_tensors_offloaded",
        "tba_dedup_hits",
        "tba_forwarded",
        "tba_sync_loads",
        "tba_stall_seconds",
    ]
    reasons = ["small", "group", "staging_full", "disk_full", "node_quota", "unsupported"]
    bounds = [
        "5e-05",
        "0.0001",
        "0.00025",
        "0.0005",
        "0.001",
        "0.0025",
        "0.005",
        "0.01",
        "0.025",
        "0.05",
        "0.1",
        "0.25",
        "0.5",
        "1.0",
        "2.5",
        "5.0",
        "10.0",
        "+Inf",
    ]
    for i in range(ranks):
        pid, rank = 4_000_000 + i, str(i % 8)
        c = MmapedDict(os.path.join(metrics_dir, f"counter_{pid}.db"))
        for name in counters:
            c.write_value(mmap_key(name, name + "_total", ["rank"], [rank], "h"), 1e9, 0)
        for r in reasons:
            k = mmap_key(
                "tba_tensors_kept", "tba_tensors_kept_total", ["rank", "reason"], [rank, r], "h"
            )
            c.write_value(k, 10, 0)
        for op in ("write", "read"):
            k = mmap_key(
                "tba_io_errors",
                "tba_io_errors_total",
                ["rank", "op", "errno"],
                [rank, op, "EIO"],
                "h",
            )
            c.write_value(k, 0, 0)
        k = mmap_key(
            "tba_device_bytes_written",
            "tba_device_bytes_written_total",
            ["rank", "device"],
            [rank, "vda"],
            "h",
        )
        c.write_value(k, 1e9, 0)
        c.close()
        h = MmapedDict(os.path.join(metrics_dir, f"histogram_{pid}.db"))
        for op in ("write", "read"):
            for b in bounds:
                k = mmap_key(
                    "tba_io_seconds",
                    "tba_io_seconds_bucket",
                    ["rank", "op", "le"],
                    [rank, op, b],
                    "h",
                )
                h.write_value(k, 5, 0)
            h.write_value(
                mmap_key("tba_io_seconds", "tba_io_seconds_sum", ["rank", "op"], [rank, op], "h"),
                1.5,
                0,
            )
        h.close()
        for mode, names in (
            (
                "livesum",
                ["tba_resident_bytes", "tba_staging_bytes_in_use", "tba_disk_bytes_in_use"],
            ),
            ("livemax", ["tba_keep_last"]),
        ):
            g = MmapedDict(os.path.join(metrics_dir, f"gauge_{mode}_{pid}.db"))
            for name in names:
                g.write_value(mmap_key(name, name, ["rank"], [rank], "h"), 1e6, 0)
            g.close()


def _work(metrics_dir: str, spill: str) -> float:
    t0 = time.perf_counter()
    read_dir(metrics_dir)
    scan_root(spill, flock_holders())
    for d in endurance.disks_for_path(spill)[0]:
        endurance.sectors_written_bytes(d)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RankCollector(metrics_dir))
    generate_latest(reg)
    return time.perf_counter() - t0


async def _measure(metrics_dir: str, spill: str, mode: str, repeats: int):
    loop = asyncio.get_running_loop()
    gc.unfreeze()  # each mode starts from the same heap
    if mode == "freeze":
        gc.collect()
        gc.freeze()
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        while not stop.is_set():
            t0 = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - t0 - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    durations, worst = [], []
    for _ in range(repeats):
        lags.clear()
        if mode != "inline":
            durations.append(await loop.run_in_executor(None, _work, metrics_dir, spill))
        else:
            durations.append(_work(metrics_dir, spill))
        await asyncio.sleep(0.02)  # let the ticker see the loop again
        worst.append(max(lags, default=0.0))
    stop.set()
    await task
    return statistics.median(durations), statistics.median(worst), max(worst)


def lag(args) -> None:
    print(machine_line(tempfile.gettempdir()))
    print(
        f"{'ranks':>6} {'files':>6} {'mode':>9} {'work ms':>8} {'lag ms (median)':>16} "
        f"{'lag ms (max)':>13}"
    )
    print("(the process has imported tba, hence torch, like the sidecar)")
    for n in args.ranks:
        base = tempfile.mkdtemp(prefix="tba-bench-sidecar-")
        try:
            metrics, spill = os.path.join(base, "m"), os.path.join(base, "s")
            os.mkdir(metrics)
            os.mkdir(spill)
            _fill(metrics, n)
            for mode in ("inline", "executor", "freeze"):
                work, med, worst = asyncio.run(_measure(metrics, spill, mode, args.repeats))
                print(
                    f"{n:>6} {4 * n:>6} {mode:>9} {work * 1e3:>8.2f} {med * 1e3:>16.2f} "
                    f"{worst * 1e3:>13.2f}"
                )
        finally:
            shutil.rmtree(base)


# -- rss ---------------------------------------------------------------------------------------
def _rss(pid: int) -> tuple[int, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def rss(args) -> None:
    base = tempfile.mkdtemp(prefix="tba-bench-sidecar-")
    metrics, spill = os.path.join(base, "metrics"), os.path.join(base, "spill")
    os.mkdir(metrics)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TBA_")}
    env["PYTHONPATH"] = str(REPO)
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tba.cli",
            "sidecar",
            "--port",
            "0",
            "--metrics-dir",
            metrics,
            "--spill-dir",
            spill,
            "--interval",
            str(args.interval),
            "--ssd-tbw",
            "3500",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    ranks: list[subprocess.Popen] = []
    try:
        port = None
        for line in sidecar.stderr:
            rec = json.loads(line)
            if rec["event"] == "listening":
                port = rec["port"]
                break
        threading.Thread(target=lambda: [None for _ in sidecar.stderr], daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        print(machine_line(base))
        samples: list[tuple[float, int]] = []
        start_rss = _rss(sidecar.pid)[0]
        t_start = time.monotonic()
        for rank in (0, 1):
            renv = dict(
                env,
                TBA_RANK=str(rank),
                TBA_METRICS_DIR=metrics,
                TBA_SPILL_DIR=spill,
                TBA_MIN_FREE_BYTES="0",
            )
            ranks.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(REPO / "tests/sidecar/_rank.py"),
                        "--out",
                        os.path.join(base, f"r{rank}.json"),
                        "--steps",
                        str(args.steps),
                        "--layers",
                        str(args.layers),
                        "--hidden",
                        str(args.hidden),
                        "--heads",
                        str(args.heads),
                        "--seq",
                        str(args.seq),
                        "--batch",
                        str(args.batch),
                    ],
                    env=renv,
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                )
            )
        scrapes = 0
        next_sample = 0.0
        while any(p.poll() is None for p in ranks):
            for path in ("/metrics", "/status"):
                with urllib.request.urlopen(url + path, timeout=30) as r:
                    r.read()
            scrapes += 1
            now = time.monotonic() - t_start
            if now >= next_sample:
                samples.append((now, _rss(sidecar.pid)[0]))
                next_sample = now + 1.0
            time.sleep(args.scrape_every)
        train_s = time.monotonic() - t_start
        codes = [p.wait() for p in ranks]
        time.sleep(2 * args.interval)  # the janitor reclaims the finished ranks' gauges
        with urllib.request.urlopen(url + "/status", timeout=30) as r:
            status = json.loads(r.read())
        end_rss, peak = _rss(sidecar.pid)
        stats = [json.loads(Path(base, f"r{r}.json").read_text()) for r in (0, 1)]
        tenth = next((b for t, b in samples if t >= train_s * 0.1), samples[0][1])
        print(
            f"2 ranks x {args.steps} steps (layers {args.layers}, hidden {args.hidden}, seq "
            f"{args.seq}, batch {args.batch}), exit codes {codes}, {train_s:.0f} s; "
            f"offloaded per rank: "
            + ", ".join(f"{s['sums']['bytes_offloaded'] / 2**30:.2f} GiB" for s in stats)
        )
        print(
            f"{scrapes} scrapes of /metrics + /status every {args.scrape_every} s; sidecar "
            f"scans every {args.interval} s"
        )
        print(
            f"sidecar RSS: before the ranks {start_rss / 2**20:.1f} MiB, at 10% of the run "
            f"{tenth / 2**20:.1f} MiB, after {end_rss / 2**20:.1f} MiB, peak {peak / 2**20:.1f} "
            "MiB"
        )
        lagd = status["sidecar"]["loop_lag_seconds"]
        over = ", ".join(f"> {float(b) * 1e3:.0f} ms: {n}" for b, n in lagd["ticks_over"].items())
        print(
            f"loop lag (50 ms timer overshoot): max over the run {lagd['max'] * 1e3:.1f} ms; "
            f"of {lagd['ticks']} ticks, {over}; janitor removed {status['janitor']['removed']}"
        )
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        sidecar.terminate()
        sidecar.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("lag")
    a.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 1000])
    a.add_argument("--repeats", type=int, default=20)
    r = sub.add_parser("rss")
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--layers", type=int, default=6)
    r.add_argument("--hidden", type=int, default=256)
    r.add_argument("--heads", type=int, default=8)
    r.add_argument("--seq", type=int, default=256)
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--scrape-every", type=float, default=0.5)
    r.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args(argv)
    (lag if args.what == "lag" else rss)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
