"""End to end: two real training processes (tba.Offloader on a small GPT, TBA_METRICS_DIR set)
and `tba sidecar`, scraped over HTTP, by a real Prometheus server, and checked against the
deploy/ files.

The ranks stay alive after training (until teardown), so that their live gauges are there."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ._support import REPO, SidecarProc, env, sample_names, samples

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RANK_SCRIPT = Path(__file__).with_name("_rank.py")
DEPLOY = REPO / "deploy"

# The names issue 5 pins (dashboards and tests depend on them), each with a `rank` label.
PINNED_COUNTERS = {
    "tba_bytes_offloaded_total": "bytes_offloaded",
    "tba_bytes_reloaded_total": "bytes_reloaded",
    "tba_tensors_offloaded_total": "tensors_offloaded",
    "tba_dedup_hits_total": "dedup_hits",
    "tba_forwarded_total": "forwarded",
    "tba_sync_loads_total": "sync_loads",
    "tba_stall_seconds_total": "stall_seconds",
}
PINNED_OTHERS = (
    "tba_tensors_kept_total",
    "tba_io_seconds_bucket",
    "tba_io_seconds_sum",
    "tba_io_seconds_count",
    "tba_resident_bytes",
    "tba_staging_bytes_in_use",
    "tba_disk_bytes_in_use",
    "tba_keep_last",
    "tba_backend_info",
    "tba_io_errors_total",
    "tba_device_bytes_written_total",
)


class Node:
    def __init__(self, base: Path):
        self.metrics_dir = base / "metrics"
        self.spill = base / "spill"
        self.metrics_dir.mkdir()
        self.ranks: list[subprocess.Popen] = []
        self.stats: dict[str, dict] = {}
        for rank in (0, 1):
            out = base / f"rank{rank}.json"
            p = subprocess.Popen(
                [
                    sys.executable,
                    str(RANK_SCRIPT),
                    "--out",
                    str(out),
                    "--steps",
                    str(3 + rank),
                    "--wait",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env=env(
                    TBA_RANK=str(rank),
                    TBA_METRICS_DIR=str(self.metrics_dir),
                    TBA_SPILL_DIR=str(self.spill),
                    TBA_MIN_OFFLOAD_BYTES="16KiB",
                    TBA_KEEP_LAST="0",
                    TBA_SLAB_BYTES="16MiB",
                    TBA_STAGING_BYTES="32MiB",
                    TBA_MIN_FREE_BYTES="0",
                    TBA_NODE_MAX_DISK_BYTES="1GiB",
                ),
            )
            self.ranks.append(p)
        for rank, p in enumerate(self.ranks):
            line = p.stdout.readline()
            assert line == "trained\n", f"rank {rank} failed: {line!r}"
            self.stats[str(rank)] = json.loads((base / f"rank{rank}.json").read_text())
        self.sidecar = SidecarProc(
            "--metrics-dir",
            str(self.metrics_dir),
            "--spill-dir",
            str(self.spill),
            "--interval",
            "0.5",
            "--ssd-tbw",
            "3500",
        )
        self.sidecar.wait_scans(2)  # two samples behind the endurance rates

    def close(self) -> None:
        for p in self.ranks:
            if p.poll() is None:
                p.stdin.close()
        for p in self.ranks:
            p.wait(60)
        self.sidecar.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("node"))
    try:
        yield n
    finally:
        n.close()


def test_every_pinned_metric_for_both_ranks_and_totals_equal_stats(node):
    text = node.sidecar.metrics()
    names = sample_names(text)
    for name in [*PINNED_COUNTERS, *PINNED_OTHERS]:
        assert name in names, f"{name} missing from /metrics"
        ranks = {dict(k)["rank"] for k in samples(text, name)}
        assert ranks == {"0", "1"}, f"{name}: ranks {ranks}"
    for name, key in PINNED_COUNTERS.items():
        got = samples(text, name)
        for rank, st in node.stats.items():
            want = st["sums"][key]
            value = got[frozenset({("rank", rank)})]
            assert value == pytest.approx(want, rel=1e-9, abs=1e-12), (name, rank)
    assert node.stats["0"]["sums"]["bytes_offloaded"] > 0
    kept = samples(text, "tba_tensors_kept_total")
    for rank, st in node.stats.items():
        for labels, value in kept.items():
            d = dict(labels)
            if d["rank"] == rank:
                assert value == st["kept_reasons"].get(d["reason"], 0), (rank, d["reason"])
    backends = {dict(k)["rank"]: dict(k)["backend"] for k in samples(text, "tba_backend_info")}
    assert backends == {r: st["backend"] for r, st in node.stats.items()}


def test_status_shows_both_ranks_alive_and_the_node_quota(node):
    status = node.sidecar.status()
    alive = {r["pid"]: r for r in status["ranks"] if r["alive"]}
    for rank, st in node.stats.items():
        assert alive[st["pid"]]["ranks"] == [rank]
        assert alive[st["pid"]]["metrics_files"] >= 3
        (d,) = alive[st["pid"]]["spill_dirs"]
        assert d.startswith(str(node.spill) + "/") and d.endswith(f"-{st['pid']}-rank{rank}")
    (root,) = status["spill_roots"]
    quota = root["node_quota"]
    assert quota["available"] is True, quota
    assert quota["ledger"]["limit"] == 1 << 30
    assert {e["rank"] for e in quota["ledger"]["entries"] if e["alive"]} == {0, 1}
    text = node.sidecar.metrics()
    labels = frozenset({("root", str(node.spill))})
    assert samples(text, "tba_node_quota_limit_bytes") == {labels: float(1 << 30)}
    assert samples(text, "tba_node_quota_used_bytes")[labels] == quota["ledger"]["used_bytes"]
    assert status["janitor"]["removed"] == {"metrics_file": 0, "spill_dir": 0}


def _promql_names(expr: str) -> set[str]:
    return set(re.findall(r"\btba_[A-Za-z0-9_]+", expr))


def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = []
    for p in dash["panels"]:
        exprs += [t["expr"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            exprs.append(q["query"])
    return exprs


def test_dashboard_uses_only_names_a_real_scrape_emits(node):
    text = node.sidecar.metrics()
    emitted = sample_names(text)
    exprs = _dashboard_exprs()
    used = set().union(*map(_promql_names, exprs))
    assert len(used) >= 30  # every rank metric and every node gauge has a panel
    devices = node.sidecar.status()["devices"]
    for name in sorted(used):
        if name.startswith("tba_ssd_") and not devices:
            # No block device under the test's spill dir (tmpfs, overlay): the sidecar says so
            # and emits no endurance samples; the name must still be one it declares.
            assert f"# TYPE {name.removesuffix('_total')} " in text, name
            continue
        assert name in emitted, f"grafana-dashboard.json uses {name}, which /metrics never emits"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_a_real_prometheus_scrapes_both_ranks(node):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "the prometheus binary is not installed (Debian: apt-get install prometheus; "
            ".ci/run installs it)"
        )
    import yaml

    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "tba"]
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{node.sidecar.port}"]
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    cfg["global"]["scrape_interval"] = "1s"
    cfg["scrape_configs"] = [job]
    work = tempfile.mkdtemp(prefix="tba-prometheus-")
    port = _free_port()
    proc = None
    try:
        cfg_path = os.path.join(work, "prometheus.yml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(cfg, f)
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={cfg_path}",
                f"--storage.tsdb.path={work}/data",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 90
        result: list[dict] = []
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited {proc.returncode}: {proc.stderr.read()}")
            try:
                result = _query(port, "tba_bytes_offloaded_total")
            except OSError:
                result = []  # not listening yet
            if len(result) == 2:
                break
            time.sleep(0.5)
        by_rank = {r["metric"]["rank"]: float(r["value"][1]) for r in result}
        assert set(by_rank) == {"0", "1"}, result
        for rank, st in node.stats.items():
            assert by_rank[rank] == st["sums"]["bytes_offloaded"]
        assert {r["metric"]["job"] for r in result} == {"tba"}
        (up,) = _query(port, 'up{job="tba"}')
        assert up["value"][1] == "1"
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stderr.close()
        shutil.rmtree(work, ignore_errors=True)
    assert not os.path.exists(work)
