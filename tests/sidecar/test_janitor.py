"""The janitor on real leftovers: it removes a dead process's live gauges and empty spill
directory, and leaves alone a live process's files, a symlink and its target, a dead owner's
directory that holds files, another host's directory, and everything else in the roots."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

from tba.sidecar.janitor import Janitor
from tba.sidecar.rankfiles import read_dir
from tba.sidecar.spill import flock_holders, scan_root
from tba.storage.spilldir import host_tag

from ._support import SidecarProc, Writer, dead_pid, samples


def _tree(path: str) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, n), path))
    return out


def test_removes_dead_leftovers_and_nothing_else(tmp_path, metrics_dir, spill_root):
    host = host_tag()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("not tba's")
    target_dir = outside / "target-dir"
    target_dir.mkdir()

    with (
        Writer(metrics_dir, 0, 10, spill_root=spill_root) as live,
        Writer(metrics_dir, 1, 20) as dead,
    ):
        dead.exit()
        live_name = os.path.basename(live.spill_dir)
        # Made after the live writer started: its SpillDir would have swept the stale one.
        gone = dead_pid()
        stale = os.path.join(spill_root, f"{host}-{gone}-rank0")
        os.mkdir(stale, 0o700)  # what a SIGKILLed rank leaves: an empty directory
        keep = {
            # a symlink carrying a dead rank's name, to an empty directory: neither is touched
            f"{host}-{dead_pid()}-rank1": lambda p: os.symlink(target_dir, p),
            # a dead owner's directory that holds a file: refused, reported
            f"{host}-{dead_pid()}-rank2": lambda p: (os.mkdir(p), open(f"{p}/slab", "w").close()),
            # another host's directory (a shared filesystem): never ours to judge
            f"otherhost-{gone}-rank3": lambda p: os.mkdir(p),
            "unrelated": lambda p: open(p, "w").close(),
        }
        for name, make in keep.items():
            make(os.path.join(spill_root, name))
        # a live-gauge name of a dead pid that is a symlink to a file outside: refused
        link_pid = dead_pid()
        os.symlink(outside / "precious", os.path.join(metrics_dir, f"gauge_livesum_{link_pid}.db"))

        before_outside = _tree(str(outside))
        with SidecarProc(
            "--metrics-dir", metrics_dir, "--spill-dir", spill_root, "--interval", "0.2"
        ) as sc:
            sc.wait_scans(1)
            text = sc.metrics()
            status = sc.status()
            records = sc.records()
        # the live process's directory and files, untouched while it lives
        assert os.path.isdir(live.spill_dir)
        for n in (f"counter_{live.pid}.db", f"gauge_livesum_{live.pid}.db"):
            assert os.path.isfile(os.path.join(metrics_dir, n))

    assert not os.path.exists(stale)
    left = set(os.listdir(spill_root))
    assert set(keep) <= left and live_name not in left  # the live one closed its own dir
    assert os.path.islink(os.path.join(spill_root, f"{host}-{gone}-rank0")) is False
    assert _tree(str(outside)) == before_outside  # the symlinks' targets
    assert (outside / "precious").read_text() == "not tba's"
    assert os.path.islink(os.path.join(metrics_dir, f"gauge_livesum_{link_pid}.db"))
    assert f"counter_{dead.pid}.db" in os.listdir(metrics_dir)
    assert f"gauge_livesum_{dead.pid}.db" not in os.listdir(metrics_dir)

    assert samples(text, "tba_janitor_removed_total") == {
        frozenset({("kind", "metrics_file")}): 2.0,
        frozenset({("kind", "spill_dir")}): 1.0,
    }
    refused = {(r["kind"], r["path"]) for r in status["janitor"]["refused"]}
    assert refused == {
        ("metrics_file", os.path.join(metrics_dir, f"gauge_livesum_{link_pid}.db")),
        ("spill_dir", os.path.join(spill_root, next(k for k in keep if k.endswith("rank1")))),
        ("spill_dir", os.path.join(spill_root, next(k for k in keep if k.endswith("rank2")))),
    }
    assert samples(text, "tba_janitor_refused_total") == {
        frozenset({("kind", "metrics_file"), ("reason", "not_regular")}): 1.0,
        frozenset({("kind", "spill_dir"), ("reason", "symlink")}): 1.0,
        frozenset({("kind", "spill_dir"), ("reason", "not_empty")}): 1.0,
        frozenset({("kind", "spill_dir"), ("reason", "not_directory")}): 0.0,
    }
    removed = sorted(r["path"] for r in records if r["event"] == "janitor_removed")
    assert removed == sorted(
        [
            stale,
            os.path.join(metrics_dir, f"gauge_livemax_{dead.pid}.db"),
            os.path.join(metrics_dir, f"gauge_livesum_{dead.pid}.db"),
        ]
    )
    assert all(
        r["level"] == "info" and r["kind"] for r in records if r["event"] == "janitor_removed"
    )


def test_pauses_when_a_locked_dir_belongs_to_an_invisible_pid(metrics_dir, spill_root):
    """A lock held on a directory whose pid is dead from here is what a sidecar in another pid
    namespace sees: it must remove nothing, not even a dead rank's empty directory."""
    host = host_tag()
    locked = os.path.join(spill_root, f"{host}-{dead_pid()}-rank0")
    os.mkdir(locked, 0o700)
    fd = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    stale = os.path.join(spill_root, f"{host}-{dead_pid()}-rank1")
    os.mkdir(stale, 0o700)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by this (live) test process
        j = Janitor(metrics_dir)
        roots = [scan_root(spill_root, flock_holders())]
        report = j.run(read_dir(metrics_dir), roots)
        assert "shareProcessNamespace: true" in report.paused and locked in report.paused
        assert report.removed == [] and os.path.isdir(stale) and os.path.isdir(locked)
        (entry,) = [e for e in roots[0].entries if e.name == os.path.basename(locked)]
        assert entry.locked and entry.lock_pid == os.getpid() and entry.alive is True
    finally:
        os.close(fd)  # the lock goes with it
    roots = [scan_root(spill_root, flock_holders())]
    report = j.run(read_dir(metrics_dir), roots)
    assert report.paused == ""
    assert sorted(p for _, p in report.removed) == sorted([locked, stale])


def test_flock_holders_reads_proc_locks(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.fstat(fd)
        assert flock_holders()[(st.st_dev, st.st_ino)] == os.getpid()
    finally:
        os.close(fd)
    assert (st.st_dev, st.st_ino) not in flock_holders()


def test_no_janitor_reports_but_removes_nothing(metrics_dir, spill_root):
    stale = os.path.join(spill_root, f"{host_tag()}-{dead_pid()}-rank0")
    os.mkdir(stale, 0o700)
    with Writer(metrics_dir, 0, 10) as dead:
        dead.exit()
    before = sorted(os.listdir(metrics_dir))
    with SidecarProc(
        "--metrics-dir", metrics_dir, "--spill-dir", spill_root, "--interval", "0.2",
        "--no-janitor",
    ) as sc:  # fmt: skip
        sc.wait_scans(1)
        status = sc.status()
        text = sc.metrics()
    assert sorted(os.listdir(metrics_dir)) == before and os.path.isdir(stale)
    assert status["janitor"]["paused"] == "disabled (--no-janitor)"
    assert samples(text, "tba_janitor_paused") == {frozenset(): 1.0}
    ranks = {r["pid"]: r for r in status["ranks"]}
    assert ranks[dead.pid]["alive"] is False


def test_a_file_still_mapped_by_a_process_it_cannot_see_is_left_alone(metrics_dir, spill_root):
    """What a sidecar in another pid namespace meets: live gauges whose pid it sees as dead,
    mapped by a live process. The write-lease test keeps them; once unmapped, they go."""
    pid = dead_pid()
    name = f"gauge_livesum_{pid}.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, os.path.join(metrics_dir, name)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "ready\n"
        j = Janitor(metrics_dir)
        report = j.run(read_dir(metrics_dir), [scan_root(spill_root, flock_holders())])
        assert report.removed == [] and os.path.isfile(os.path.join(metrics_dir, name))
    finally:
        holder.stdin.close()
        holder.wait(30)
    report = j.run(read_dir(metrics_dir), [scan_root(spill_root, flock_holders())])
    assert report.removed == [("metrics_file", os.path.join(metrics_dir, name))]


# Maps the file like prometheus-client's MmapedDict, closes the fd, keeps the mapping.
HOLD = """
import sys
from prometheus_client.mmap_dict import MmapedDict, mmap_key
d = MmapedDict(sys.argv[1])
d.write_value(mmap_key("tba_resident_bytes", "tba_resident_bytes", ["rank"], ["0"], "h"), 1, 0)
d._f.close()
print("ready", flush=True)
sys.stdin.read()
"""
