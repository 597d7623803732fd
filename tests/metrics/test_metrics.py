"""Metrics (tba/metrics/__init__.py): real prometheus_client multiprocess files, read back the way
the sidecar reads them (MultiProcessCollector), and the in-process registry."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

import tba
from tba import metrics
from tba.testing import GPT, GPTConfig, random_batch

CFG = GPTConfig(vocab=64, seq=64, hidden=64, heads=4, layers=4)

# Pinned here, not taken from tba.metrics: dashboards and the sidecar depend on these names.
PINNED = {
    "tba_bytes_offloaded_total": {"rank"},
    "tba_bytes_reloaded_total": {"rank"},
    "tba_tensors_offloaded_total": {"rank"},
    "tba_tensors_kept_total": {"rank", "reason"},
    "tba_dedup_hits_total": {"rank"},
    "tba_host_tier_bytes_total": {"rank"},
    "tba_ssd_tier_bytes_total": {"rank"},
    "tba_forwarded_total": {"rank"},
    "tba_sync_loads_total": {"rank"},
    "tba_stall_seconds_total": {"rank"},
    "tba_io_errors_total": {"rank", "op", "errno"},
    "tba_io_seconds_bucket": {"rank", "op", "le"},
    "tba_io_seconds_sum": {"rank", "op"},
    "tba_io_seconds_count": {"rank", "op"},
    "tba_resident_bytes": {"rank"},
    "tba_staging_bytes_in_use": {"rank"},
    "tba_disk_bytes_in_use": {"rank"},
    "tba_keep_last": {"rank"},
    "tba_backend_info": {"rank", "backend", "reason"},
    "tba_device_bytes_written_total": {"rank", "device"},
}
# stats() key -> counter, for the counters that are sums of per-step numbers.
STEP_COUNTERS = {
    "bytes_offloaded": "tba_bytes_offloaded_total",
    "bytes_reloaded": "tba_bytes_reloaded_total",
    "tensors_offloaded": "tba_tensors_offloaded_total",
    "dedup_hits": "tba_dedup_hits_total",
    "host_tier_bytes": "tba_host_tier_bytes_total",
    "ssd_tier_bytes": "tba_ssd_tier_bytes_total",
    "forwarded": "tba_forwarded_total",
    "sync_loads": "tba_sync_loads_total",
    "stall_seconds": "tba_stall_seconds_total",
}


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(CFG)


@pytest.fixture
def mdir(tmp_path):
    return str(tmp_path / "metrics")


def scrape(path: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample in the multiprocess files of ``path``, as the sidecar would serve them."""
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=path)
    return samples_of(reg)


def samples_of(reg) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list] = {}
    for fam in reg.collect():
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if labels.items() <= lab.items())


def minus(after, before):
    """The registry is process-wide (every Offloader so far): what changed in between."""
    out = {}
    for name, series in after.items():
        old = {tuple(sorted(lab.items())): v for lab, v in before.get(name, [])}
        out[name] = [(lab, v - old.get(tuple(sorted(lab.items())), 0.0)) for lab, v in series]
    return out


def run_steps(off, model, steps: int, batch: int = 4) -> list[dict]:
    got = []
    for i in range(steps):
        x, y = random_batch(CFG, batch, seed=i)
        with off.step(model):
            loss = model(x, y)
        loss.backward()
        off.synchronize()  # its last writes are counted once they land (NOTE [Counted once])
        got.append(off.stats())
    return got


def assert_counters_match(samples, stats: list[dict], rank: str) -> None:
    for key, name in STEP_COUNTERS.items():
        want = sum(s[key] for s in stats)
        assert value(samples, name, rank=rank) == pytest.approx(want, rel=1e-9, abs=1e-12), name
    reasons: dict[str, int] = {}
    for s in stats:
        for r, n in s["kept_reasons"].items():
            reasons[r] = reasons.get(r, 0) + n
    for r, n in reasons.items():
        assert value(samples, "tba_tensors_kept_total", rank=rank, reason=r) == n, r
    assert value(samples, "tba_tensors_kept_total", rank=rank) == sum(
        s["tensors_kept"] for s in stats
    )
    assert value(samples, "tba_io_errors_total", rank=rank) == sum(s["io_errors"] for s in stats)


def test_every_pinned_metric_is_written_with_the_rank_label(make_offloader, model, mdir):
    off = make_offloader(metrics_dir=mdir, rank=3, min_offload_bytes="16KiB")
    stats = run_steps(off, model, 2)
    assert sum(s["kept_reasons"].get("small", 0) for s in stats) > 0
    samples = scrape(mdir)
    for name, labels in PINNED.items():
        series = [lab for lab, _ in samples.get(name, []) if lab.get("rank") == "3"]
        assert series, f"{name} is missing for rank 3"
        assert all(set(lab) == labels for lab in series), (name, series)
    info = [(lab, v) for lab, v in samples["tba_backend_info"] if lab["rank"] == "3" and v]
    st = off.stats()  # the reason may change (buffers registered): the metric follows it
    assert info == [({"rank": "3", "backend": st["backend"], "reason": st["backend_reason"]}, 1)]
    device = [lab["device"] for lab, _ in samples["tba_device_bytes_written_total"]]
    assert device == [metrics.spill_device(off.backend.spill_path)]
    assert value(samples, "tba_keep_last", rank="3") == off.stats()["keep_last"]
    # One series per rank (no pid label): the gauges are live* and aggregate over processes.
    assert all("pid" not in lab for lab, _ in samples["tba_resident_bytes"])
    names = sorted(os.listdir(mdir))
    pid = os.getpid()
    assert names == sorted(
        f"{p}_{pid}.db" for p in ("counter", "histogram", "gauge_livesum", "gauge_livemax")
    )


def test_counters_equal_the_sums_of_stats(make_offloader, model, mdir):
    before = samples_of(metrics.registry())
    off = make_offloader(metrics_dir=mdir, rank=1, min_offload_bytes="16KiB", keep_last=1)
    stats = run_steps(off, model, 4)
    samples = scrape(mdir)
    assert_counters_match(samples, stats, "1")
    assert value(samples, "tba_bytes_offloaded_total", rank="1") > 0
    writes = value(samples, "tba_io_seconds_count", rank="1", op="write")
    reads = value(samples, "tba_io_seconds_count", rank="1", op="read")
    use = off.backend.usage()
    assert (writes, reads) == (use["writes"], use["reads"]) and writes > 0
    assert value(samples, "tba_device_bytes_written_total", rank="1") == use["bytes_written"]
    # The in-process registry sees the same numbers.
    assert_counters_match(minus(samples_of(metrics.registry()), before), stats, "1")
    # Steps whose entries are all gone are forgotten: tracking does not grow with the run.
    run_steps(off, model, 3)
    assert len(off.metrics._steps) <= 2


def test_two_graphs_alive_at_once_are_each_counted_whole(make_offloader, model, mdir):
    """Gradient accumulation: step 1's backward runs after step 2 started; its reloads and
    forwards still land in the counters."""
    off = make_offloader(metrics_dir=mdir, prefetch_bytes="1MiB")
    x, y = random_batch(CFG, 4)
    with off.step(model):
        first = model(x, y)
    st1 = off._last
    with off.step(model):
        second = model(x[:2], y[:2])
    st2 = off._last
    off.synchronize()  # written, so backward reads both steps back from disk
    (first + second).backward()
    off.synchronize()
    del first, second
    third = run_steps(off, model, 1)  # a new step settles 1 and 2
    assert st1.bytes_reloaded > 0 and st2.bytes_reloaded > 0
    stats = [st1.snapshot(0), st2.snapshot(0), *third]
    samples = scrape(mdir)
    assert_counters_match(samples, stats, "0")
    assert off.metrics._steps[0][0] is off._last  # 1 and 2 settled


def test_failed_writes_and_reads_count_io_errors(make_offloader, model, mdir):
    def failing(real, err):
        def call(*args):
            raise OSError(err, os.strerror(err))

        return call

    off = make_offloader(metrics_dir=mdir, backend="posix", prefetch_bytes="1MiB")
    off.backend._pwrite = failing(os.pwrite, errno.EIO)
    stats = run_steps(off, model, 1)
    assert stats[0]["io_errors"] > 0
    samples = scrape(mdir)
    assert value(samples, "tba_io_errors_total", op="write", errno="EIO") == stats[0]["io_errors"]
    assert value(samples, "tba_io_seconds_count", op="write") == 0  # failed I/Os are not timed
    assert_counters_match(samples, stats, "0")

    off.backend._pwrite = os.pwrite
    x, y = random_batch(CFG, 4)
    with off.step(model):
        loss = model(x, y)
        off.synchronize()
        off.backend._preadv = failing(os.preadv, errno.EIO)
    with pytest.raises(tba.StorageError, match="EIO"):
        loss.backward()
    st = off.stats()
    assert st["io_errors"] >= 1
    samples = scrape(mdir)
    assert value(samples, "tba_io_errors_total", op="read", errno="EIO") == st["io_errors"]


def test_in_process_registry_without_a_metrics_dir(make_offloader, model):
    before = samples_of(metrics.registry())
    off = make_offloader(rank=7)
    stats = run_steps(off, model, 2)
    text = generate_latest(metrics.registry()).decode()
    assert 'tba_bytes_offloaded_total{rank="7"} ' in text
    assert 'tba_io_seconds_bucket{le="+Inf",op="write",rank="7"} ' in text
    assert_counters_match(minus(samples_of(metrics.registry()), before), stats, "7")
    # Nothing goes to prometheus_client's default registry.
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("tba_")]


def test_two_offloaders_of_one_process_share_the_series(tmp_path, model, mdir):
    kw = dict(min_offload_bytes=1, min_free_bytes=0, slab_bytes="16MiB", keep_last=0, environ={})
    kw.update(spill_dir=str(tmp_path / "spill"), metrics_dir=mdir, rank=2, backend="posix")
    a = tba.Offloader(tba.Config(**kw))
    b = tba.Offloader(tba.Config(**kw))
    try:
        x, y = random_batch(CFG, 4)
        with a.step(model):
            la = model(x, y)
        with b.step(model):
            lb = model(x, y)
        a.synchronize()  # writes are counted once they land (NOTE [Counted once])
        b.synchronize()
        # stats() samples the gauges: resident bytes still change after the step ends, as
        # writes land and free what they held (the read-ahead takes only part of them)
        both = a.stats()["bytes_offloaded"] + b.stats()["bytes_offloaded"]
        samples = scrape(mdir)
        assert value(samples, "tba_bytes_offloaded_total", rank="2") == both
        resident = value(samples, "tba_resident_bytes", rank="2")
        assert resident == a.index.resident + b.index.resident > 0
        info = [v for lab, v in samples["tba_backend_info"] if lab["rank"] == "2"]
        assert info == [1.0]  # same backend and reason: one series, still 1
        (la + lb).backward()
    finally:
        a.close()
    b.stats()  # gauges are sampled at step boundaries and on stats()
    samples = scrape(mdir)
    assert value(samples, "tba_resident_bytes", rank="2") == b.index.resident
    b.close()
    samples = scrape(mdir)
    assert value(samples, "tba_backend_info", rank="2") == 0
    assert value(samples, "tba_bytes_offloaded_total", rank="2") == both  # counters stay


def test_metrics_dir_is_created_0700(make_offloader, tmp_path):
    path = tmp_path / "a" / "b"
    make_offloader(metrics_dir=str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_a_bad_metrics_dir_is_a_config_error(make_offloader, tmp_path, spill_dir):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(tba.ConfigError, match=r"TBA_METRICS_DIR: .*/file exists and is not a dir"):
        make_offloader(metrics_dir=str(afile))
    with pytest.raises(tba.ConfigError, match=r"TBA_METRICS_DIR: cannot create .*/file/sub: Not a"):
        make_offloader(metrics_dir=str(afile / "sub"))
    planted = tmp_path / "planted"
    planted.mkdir()
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, planted / f"counter_{os.getpid()}.db")
    with pytest.raises(tba.ConfigError, match=r"cannot create .*/counter_\d+\.db: Too many levels"):
        make_offloader(metrics_dir=str(planted))
    assert target.read_text() == "keep"
    assert os.listdir(spill_dir) == []  # the backend made before the metrics was closed
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(tba.ConfigError, match=r"TBA_METRICS_DIR: .*/ro is not writable"):
            make_offloader(metrics_dir=str(ro))


def test_spill_device_names_a_disk():
    name = metrics.spill_device("/")
    st = os.stat("/")
    if os.path.exists(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"):
        assert name in os.listdir("/sys/block")  # a whole disk, never a partition
    assert metrics.spill_device("/proc") == "unknown"
    assert metrics.spill_device("/no/such/path") == "unknown"


CHILD = textwrap.dedent(
    """
    import json, os, sys, torch, tba
    from prometheus_client import Counter
    from tba.testing import GPT, GPTConfig, random_batch
    mine = Counter("user_requests", "the application's own metric")
    mine.inc()
    cfg = GPTConfig(vocab=64, seq=64, hidden=64, heads=4, layers=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    off = tba.Offloader(tba.Config(min_offload_bytes=1, min_free_bytes=0, slab_bytes="16MiB"))
    out = {"pid": os.getpid(), "bytes_offloaded": 0, "forwarded": 0}
    for i in range(2):
        x, y = random_batch(cfg, 4, seed=i)
        with off.step(model):
            loss = model(x, y)
        loss.backward()
        off.synchronize()  # the step's writes have landed: its counts are final
        st = off.stats()
        for k in ("bytes_offloaded", "forwarded"):
            out[k] += st[k]
    if sys.argv[1] == "close":
        off.close()
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.integration
@pytest.mark.parametrize("end", ["close", "exit"])
def test_another_process_reads_a_ranks_files(tmp_path, end):
    """A rank in its own process, next to the user's own multiprocess metrics: tba writes only
    to TBA_METRICS_DIR; its counters outlive it, mark_process_dead removes its gauges."""
    user_dir, tba_dir = tmp_path / "user", tmp_path / "tba"
    user_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TBA_", "PROMETHEUS_", "RANK"))}
    env.update(
        PYTHONPATH=os.getcwd(),
        PROMETHEUS_MULTIPROC_DIR=str(user_dir),
        TBA_METRICS_DIR=str(tba_dir),
        TBA_SPILL_DIR=str(tmp_path / "spill"),
        RANK="5",
    )
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    done = subprocess.run(
        [sys.executable, str(script), end], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    user = scrape(str(user_dir))
    assert value(user, "user_requests_total") == 1
    assert not [n for n in user if n.startswith("tba_")]
    samples = scrape(str(tba_dir))
    assert "user_requests_total" not in samples
    assert value(samples, "tba_bytes_offloaded_total", rank="5") == got["bytes_offloaded"] > 0
    assert value(samples, "tba_forwarded_total", rank="5") == got["forwarded"]
    assert [lab for lab, _ in samples["tba_resident_bytes"]] == [{"rank": "5"}]
    mark_process_dead(got["pid"], str(tba_dir))  # what the sidecar's janitor does
    samples = scrape(str(tba_dir))
    assert "tba_resident_bytes" not in samples and "tba_backend_info" not in samples
    assert value(samples, "tba_bytes_offloaded_total", rank="5") == got["bytes_offloaded"]
