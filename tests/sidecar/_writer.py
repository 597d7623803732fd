"""Run as a process: write prometheus-client multiprocess files the way a tba rank does
(counters, live gauges), then wait until stdin closes.

    python _writer.py METRICS_DIR RANK OFFLOADED_BYTES [SPILL_ROOT]

With SPILL_ROOT it also holds a real per-process spill directory (tba.storage.spilldir.SpillDir,
flock held) for its lifetime. Prints ``ready [spill dir]`` once everything is written.
"""

import os
import sys

metrics_dir, rank, offloaded = sys.argv[1], sys.argv[2], float(sys.argv[3])
os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before prometheus_client is imported

from prometheus_client import Counter, Gauge  # noqa: E402

Counter("tba_bytes_offloaded", "bytes", ["rank"]).labels(rank).inc(offloaded)
Counter("tba_device_bytes_written", "bytes", ["rank", "device"]).labels(rank, "vda").inc(offloaded)
Gauge("tba_resident_bytes", "bytes", ["rank"], multiprocess_mode="livesum").labels(rank).set(7)
Gauge("tba_keep_last", "k", ["rank"], multiprocess_mode="livemax").labels(rank).set(1)

spill = None
if len(sys.argv) > 4:
    from tba.storage.spilldir import SpillDir

    spill = SpillDir(sys.argv[4], int(rank))
print("ready", spill.path if spill else "", flush=True)
sys.stdin.read()
if spill is not None:
    spill.close()
