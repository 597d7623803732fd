"""The node quota shared fairly (NOTE [Node quota] 6 in tba/storage/nodequota.py): four real
processes, each with a posix backend under one spill root and one TBA_NODE_MAX_DISK_BYTES."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tba.errors import ConfigError
from tba.storage import open_backend
from tba.storage.nodequota import LEDGER_NAME, read_ledger

MIB = 1 << 20

# A rank that, from ``start`` to ``end`` (unix times), repeatedly allocates 256 KiB extents until
# it holds ``want`` bytes or is refused, holds them 20 ms (a forward and backward), frees them
# all, and records (time, bytes held) per cycle.
RANK = textwrap.dedent(
    """
    import json, sys, time
    from tba.config import Config
    from tba.storage import open_backend
    root, rank, limit, want = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    b = open_backend(Config(spill_dir=root, backend="posix", slab_bytes="1MiB", rank=rank,
                            min_free_bytes=0, node_max_disk_bytes=limit, environ={}))
    print("READY", flush=True)
    start, end = map(float, sys.stdin.readline().split())
    time.sleep(max(0.0, start - time.time()))
    cycles = []
    while time.time() < end:
        got = []
        while len(got) * (256 << 10) < want and (ext := b.allocate(256 << 10)) is not None:
            got.append(ext)
        cycles.append((time.time(), len(got) * (256 << 10)))
        time.sleep(0.02)
        for ext in got:
            b.free(ext)
        time.sleep(0.005)
    print(json.dumps(cycles), flush=True)
    sys.stdin.readline()  # stay alive (holding a ledger entry) until every rank is done
    b.close()
    """
)


@pytest.mark.slow  # ~5 s of cycles, and four interpreters importing torch (posix backend)
@pytest.mark.integration
def test_four_ranks_get_their_fair_share(tmp_path):
    """Ranks 0 and 1 start alone and get half the node quota each (the idle ranks' shares are
    lent to them); ranks 2 and 3 then start, and from then on every rank holds at least a
    quarter in every cycle: what was lent is given back, nobody starves.

    Tolerance: one slab (1 MiB) under the share. A rank gives back whole empty slabs only, and
    grows in slabs, so a share that is not a multiple of the slab size, or a rank that still
    has an extent in a slab, can leave a rank up to one slab short."""
    root = str(tmp_path / "spill")
    limit, slab = 8 * MIB, MIB
    want = 6 * MIB  # every rank wants more than any share
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), root, str(r), str(limit), str(want)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        t0 = time.time() + 0.2
        late, end = t0 + 1.5, t0 + 4.5
        for r, p in enumerate(procs):
            p.stdin.write(f"{t0 if r < 2 else late} {end}\n")
            p.stdin.flush()
        cycles = [json.loads(p.stdout.readline()) for p in procs]
        led = read_ledger(root)  # every rank still alive, each holding its last cycle's slabs
        for p in procs:
            p.stdin.write("done\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    def held(rank: int, lo: float, hi: float) -> list[int]:
        return [n for t, n in cycles[rank] if lo <= t < hi]

    alone = {r: held(r, t0 + 0.5, late) for r in (0, 1)}  # 0.5 s to settle
    together = {r: held(r, late + 1.0, end) for r in range(4)}
    assert all(len(c) >= 5 for c in [*alone.values(), *together.values()]), cycles
    least = {f"rank {r} alone": min(c) / MIB for r, c in alone.items()}
    least |= {f"rank {r} of 4": min(c) / MIB for r, c in together.items()}
    share = {k: (limit // 2 if "alone" in k else limit // 4) / MIB for k in least}
    short = {k: v for k, v in least.items() if v < share[k] - slab / MIB}
    assert short == {}, f"least MiB held in a cycle {least}; shares {share}"
    assert led["version"] == 2 and led["used_bytes"] <= limit
    assert all(e["wants"] > t0 for e in led["entries"])  # each was refused: it wanted more
    assert read_ledger(root)["entries"] == []


def test_an_idle_holder_gives_back_to_a_rank_that_asks(make_cfg, tmp_path):
    """A backend that took the whole node quota and freed everything, then stopped: nothing
    of its own triggers a give-back, so its tba-node-quota thread must, within about a
    second of the other's refusal. (Two backends of one process are two ledger entries.)"""
    cfg = make_cfg(backend="posix", node_max_disk_bytes="4MiB")
    with open_backend(cfg) as a, open_backend(cfg) as b:
        held = [a.allocate(MIB) for _ in range(4)]
        for ext in held:
            a.free(ext)  # nobody wants space yet: a keeps its four empty slabs
        assert a.usage()["slab_bytes"] == 4 * MIB
        assert b.allocate(MIB) is None and b.refusal == "node_quota"  # b now wants space
        deadline = time.monotonic() + 5
        got = []
        while len(got) < 3 and time.monotonic() < deadline:
            ext = b.allocate(MIB)
            if ext is None:
                time.sleep(0.05)
            else:
                got.append(ext)
        assert len(got) == 2  # b's share, half of the node quota; the third is refused
        assert a.usage()["slab_bytes"] == 2 * MIB and b.usage()["slab_bytes"] == 2 * MIB
        assert read_ledger(str(tmp_path / "spill"))["used_bytes"] == 4 * MIB


def test_a_version_1_ledger_is_read_and_a_newer_one_refused(make_cfg, tmp_path):
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    ledger = root / LEDGER_NAME
    ledger.write_text('{"version": 1, "limit": 4194304, "entries": []}\n')
    os.chmod(ledger, 0o600)
    cfg = make_cfg(backend="posix", node_max_disk_bytes="4MiB")
    with open_backend(cfg) as b:
        assert b.allocate(MIB) is not None
        led = read_ledger(str(root))
        assert led["version"] == 2 and [e["wants"] for e in led["entries"]] == [0]
    ledger.write_text('{"version": 3, "limit": 1, "entries": []}\n')
    with pytest.raises(ConfigError, match=r"has format version 3; this tba reads versions 1 to 2"):
        open_backend(cfg)
    assert read_ledger(str(root))["version"] == 3  # reported, never rewritten
    assert json.loads(ledger.read_text())["version"] == 3
