"""`tba sidecar` serving real prometheus-client multiprocess files over real HTTP, and the
janitor reclaiming a dead writer's live gauges (tests/sidecar/_writer.py plays the ranks)."""

from __future__ import annotations

import os

from ._support import SidecarProc, Writer, samples


def test_serves_every_rank_and_drops_only_dead_live_gauges(metrics_dir, spill_root):
    with Writer(metrics_dir, 0, 100) as live, Writer(metrics_dir, 1, 200) as dead:
        dead.exit()
        dead_files = sorted(n for n in os.listdir(metrics_dir) if n.endswith(f"_{dead.pid}.db"))
        assert dead_files == [
            f"counter_{dead.pid}.db",
            f"gauge_livemax_{dead.pid}.db",
            f"gauge_livesum_{dead.pid}.db",
        ]
        live_files = sorted(n for n in os.listdir(metrics_dir) if n.endswith(f"_{live.pid}.db"))
        with SidecarProc(
            "--metrics-dir", metrics_dir, "--spill-dir", spill_root, "--interval", "0.2"
        ) as sc:
            sc.wait_scans(1)
            text = sc.metrics()
            status = sc.status()
            removed = [r for r in sc.records() if r["event"] == "janitor_removed"]

        # Counters of both ranks, the dead one's included: totals must not drop.
        assert samples(text, "tba_bytes_offloaded_total") == {
            frozenset({("rank", "0")}): 100.0,
            frozenset({("rank", "1")}): 200.0,
        }
        # Live gauges: the live rank only (livesum/livemax drop the pid label).
        assert samples(text, "tba_resident_bytes") == {frozenset({("rank", "0")}): 7.0}
        assert samples(text, "tba_keep_last") == {frozenset({("rank", "0")}): 1.0}
        assert samples(text, "tba_janitor_removed_total") == {
            frozenset({("kind", "metrics_file")}): 2.0,
            frozenset({("kind", "spill_dir")}): 0.0,
        }
        # On disk: the dead writer's counter file stays, its gauges are gone; the live one's
        # files are all there.
        left = sorted(os.listdir(metrics_dir))
        assert f"counter_{dead.pid}.db" in left
        assert not [n for n in left if n.startswith("gauge_") and n.endswith(f"_{dead.pid}.db")]
        assert set(live_files) <= set(left)
        assert sorted(r["path"] for r in removed) == [
            os.path.join(metrics_dir, f"gauge_livemax_{dead.pid}.db"),
            os.path.join(metrics_dir, f"gauge_livesum_{dead.pid}.db"),
        ]
        ranks = {r["pid"]: r for r in status["ranks"]}
        assert ranks[live.pid]["alive"] is True and ranks[live.pid]["ranks"] == ["0"]
        assert ranks[dead.pid]["alive"] is False and ranks[dead.pid]["ranks"] == ["1"]
        assert samples(text, "tba_sidecar_ranks") == {
            frozenset({("state", "alive")}): 1.0,
            frozenset({("state", "dead")}): 1.0,
        }


def test_status_and_node_gauges_describe_the_spill_root(metrics_dir, spill_root):
    with SidecarProc(
        "--metrics-dir",
        metrics_dir,
        "--spill-dir",
        spill_root,
        "--interval",
        "0.2",
        "--ssd-tbw",
        "3500",
    ) as sc:
        sc.wait_scans(2)  # two samples: a write rate exists
        status = sc.status()
        text = sc.metrics()
    (root,) = status["spill_roots"]
    assert root["root"] == spill_root and root["problem"] == ""
    vfs = os.statvfs(spill_root)
    assert root["size_bytes"] == vfs.f_blocks * vfs.f_frsize
    assert abs(root["free_bytes"] - vfs.f_bavail * vfs.f_frsize) < 1 << 30
    assert samples(text, "tba_spill_fs_size_bytes") == {
        frozenset({("root", spill_root)}): float(root["size_bytes"])
    }
    assert root["node_quota"]["available"] is False  # no rank set TBA_NODE_MAX_DISK_BYTES
    assert status["healthy"] is True and status["health"] == "ok"
    if not root["devices"]:  # tmpfs or overlay under tmp_path: the reason is given instead
        assert root["device_problem"]
        return
    for dev in status["devices"]:
        assert dev["rated_tbw"] == 3500.0
        assert dev["rate_window_seconds"] > 0
        assert dev["bytes_written_per_day"] >= 0
        assert dev["projected_days_left"] is None or dev["projected_days_left"] > 0
        labels = frozenset({("device", dev["device"])})
        assert samples(text, "tba_ssd_rated_endurance_bytes")[labels] == 3.5e15
        assert labels in samples(text, "tba_ssd_projected_days_left")
        assert samples(text, "tba_ssd_sys_bytes_written_total")[labels] > 0


def test_healthz_turns_503_when_the_metrics_dir_goes_away(metrics_dir, spill_root):
    with SidecarProc(
        "--metrics-dir", metrics_dir, "--spill-dir", spill_root, "--interval", "0.2"
    ) as sc:
        assert sc.get("/healthz")[0] == 200
        os.rmdir(metrics_dir)
        sc.wait_scans(1)
        code, _, body = sc.get("/healthz")
        assert code == 503
        assert body.decode() == (
            f"tba.sidecar: metrics dir {metrics_dir} does not exist. Create it (mkdir -p) and "
            "point both the training processes' TBA_METRICS_DIR and the sidecar's "
            "--metrics-dir at it.\n"
        )
        code, _, body = sc.get("/metrics")
        assert (
            code == 503
            and body == f"cannot read {metrics_dir}: No such file or directory\n".encode()
        )
        os.mkdir(metrics_dir)
        sc.wait_scans(1)
        assert sc.get("/healthz")[:3:2] == (200, b"ok\n")


def test_a_symlinked_spill_root_is_reported_and_never_entered(tmp_path, metrics_dir):
    from tba.storage.spilldir import host_tag

    from ._support import dead_pid

    real = tmp_path / "real"
    real.mkdir()
    leftover = real / f"{host_tag()}-{dead_pid()}-rank0"
    leftover.mkdir()  # would be reclaimed under a real root
    link = tmp_path / "link"
    link.symlink_to(real)
    with SidecarProc(
        "--metrics-dir", metrics_dir, "--spill-dir", str(link), "--interval", "0.2"
    ) as sc:
        sc.wait_scans(2)
        (root,) = sc.status()["spill_roots"]
    assert root["problem"] == (
        f"{link} is a symbolic link; tba never follows symlinks in spill roots: point "
        "--spill-dir/TBA_SPILL_DIR at the real directory"
    )
    assert leftover.is_dir()
