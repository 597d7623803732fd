"""The ``TBA_*`` settings a node suggests, each rule next to its numbers."""

from __future__ import annotations

from ..config import format_size
from ..host.memory import align_up
from .disk import _RAM_FS, _SLOW_FS
from .report import GIB, MIB, Recommendation
from .state import Run


def recommend(d: Run) -> list[Recommendation]:
    """The TBA_* settings this node suggests, each with the reason. Rules, one per setting:

    - TBA_SPILL_DIR: the checked directory when a backend works there and it is not RAM-backed.
    - TBA_BACKEND: exported only when auto falls back to ``buffered`` (O_DIRECT refused here),
      a property of the filesystem; pinning it makes the choice explicit. A fallback caused by a
      missing build or driver (native, kvikio) is fixable, so we print the fix instead of
      pinning a slower backend.
    - TBA_MAX_DISK_BYTES: 90% of the free space above TBA_MIN_FREE_BYTES (10% left for
      checkpoints and logs that grow during the run), divided by the ranks on this node
      (LOCAL_WORLD_SIZE, else one per CUDA device, else 1), because the quota is per process.
    - TBA_IO_THREADS (posix, buffered, kvikio) / TBA_IO_DEPTH (native): the smallest number of
      16 MiB reads in flight that reaches 90% of the best measured rate, but never below the
      default: offloaded tensors are often smaller than 16 MiB and need more requests in flight
      for the same rate, and an idle thread or ring slot costs almost nothing.
    - TBA_PREFETCH_BYTES: about 100 ms of reads at the measured rate, at least two groups
      (2 x TBA_GROUP_BYTES: one being consumed while the next is read), at most 1 GiB, rounded
      up to 32 MiB. It is host memory (pinned on CUDA) held during backward; more helps only if
      backward briefly outruns the disk. `tba plan` will size it from the model instead.
    """
    cfg, facts = d.cfg, d.facts
    out: list[Recommendation] = []
    sd, be, tp = facts["spill_dir"], facts["backend"], facts["throughput"]
    usable = be["name"] is not None and not any(c.status == "FAIL" for c in d.checks.values())

    # TBA_SPILL_DIR
    if not usable:
        out.append(Recommendation("TBA_SPILL_DIR", None, "no recommendation: see the FAIL above"))
    elif sd["fs_type"] in _RAM_FS:
        out.append(
            Recommendation(
                "TBA_SPILL_DIR",
                None,
                f"{cfg.spill_dir} is on {sd['fs_type']}, which frees no memory; pick a directory "
                "on a local NVMe drive and run tba doctor --spill-dir on it",
            )
        )
    else:
        free = format_size(sd["free_bytes"]) if sd["free_bytes"] is not None else "?"
        caveat = (
            f" (but {sd['fs_type']}: see the filesystem row)" if sd["fs_type"] in _SLOW_FS else ""
        )
        out.append(
            Recommendation(
                "TBA_SPILL_DIR",
                cfg.spill_dir,
                f"checked: {sd['fs_type']}, the {be['name']} backend works there, {free} "
                f"free{caveat}",
            )
        )

    # TBA_BACKEND
    if be["requested"] == "auto" and be["auto"] == "buffered":
        out.append(
            Recommendation(
                "TBA_BACKEND",
                "buffered",
                "auto falls back to buffered here because O_DIRECT fails; pinning it makes that "
                "explicit (unset it if you move TBA_SPILL_DIR to a drive with O_DIRECT)",
            )
        )
    elif be["auto"] is not None:
        fixable = []
        if facts["native"]["module"] and not facts["native"]["built"]:
            fixable.append("the native engine is not built (see its row for the fix)")
        elif facts["native"]["built"] and facts["io_uring"]["available"] is False:
            fixable.append("io_uring is unavailable (see its row)")
        kv = facts["kvikio"]
        if facts["cuda"]["available"] and kv["importable"] and kv["gds_available"] is False:
            fixable.append("kvikio has no GDS (needs the nvidia-fs driver and a supported drive)")
        if fixable:
            why = "; ".join(fixable)
            text = f"leave it at auto (picks {be['auto']} now): {why}; fix that rather than pin"
        else:
            text = f"leave it at auto: it picks {be['auto']} here with nothing to fall back from"
        if be["requested"] != "auto":
            text = f"you set {be['requested']}; auto would pick {be['auto']}"
        out.append(Recommendation("TBA_BACKEND", None, text))

    # TBA_MAX_DISK_BYTES
    if usable and sd["free_bytes"] is not None:
        ranks, ranks_from = _ranks_per_node(d)
        room = sd["free_bytes"] - cfg.min_free_bytes
        share = quota_for(sd["free_bytes"], cfg.min_free_bytes, ranks)
        now = f"; now {format_size(cfg.max_disk_bytes)}" if cfg.max_disk_bytes else ""
        if share >= 64 * MIB:
            out.append(
                Recommendation(
                    "TBA_MAX_DISK_BYTES",
                    _env_size(share, down=True),
                    f"per-process quota: {QUOTA_SHARE:.0%} of the {format_size(room)} free above "
                    f"TBA_MIN_FREE_BYTES, split over {_plural(ranks, 'rank')} on this node "
                    f"({ranks_from}){now}",
                )
            )
        else:
            out.append(
                Recommendation(
                    "TBA_MAX_DISK_BYTES",
                    None,
                    f"only {format_size(max(room, 0))} free above TBA_MIN_FREE_BYTES: too little "
                    "to offload to; free space first",
                )
            )

    # TBA_IO_THREADS / TBA_IO_DEPTH
    name = be["name"]
    native = name == "native"
    env, default = ("TBA_IO_DEPTH", 32) if native else ("TBA_IO_THREADS", 4)
    current = cfg.io_depth if native else cfg.io_threads
    sweep = {int(k): v for k, v in tp["read_sweep_gib_s"].items()}
    if name in ("memory", None):
        pass
    elif name == "buffered":
        out.append(
            Recommendation(env, None, "not measured: buffered reads partly hit the page cache")
        )
    elif len(sweep) < 2:
        out.append(
            Recommendation(
                env,
                None,
                f"not measured: the probe has {_plural(tp['extents'] or 0, 'extent')}; use "
                "--probe-bytes 128MiB or more to compare requests in flight",
            )
        )
    else:
        value, enough = in_flight_for(sweep, default)
        widest = max(sweep)
        more = (
            f"; still rising at {widest}, so more may help (benchmarks/bench_engine.py --threads)"
            if enough == widest
            else ""
        )
        now = (
            f"; now {current}"
            if cfg.sources["io_depth" if native else "io_threads"] != "default"
            else ""
        )
        out.append(
            Recommendation(
                env,
                str(value),
                f"with {enough} in flight, 16 MiB reads reach {SATURATION:.0%} of the best read "
                f"rate; kept at >= the default {default}, as smaller tensors need more in flight"
                f"{more}{now}",
            )
        )
    if name not in ("memory", None):
        other = "TBA_IO_THREADS" if native else "TBA_IO_DEPTH"
        used_by = "posix, buffered and kvikio backends" if native else "native engine"
        out.append(Recommendation(other, None, f"not used by {name} (only by the {used_by})"))

    # TBA_PREFETCH_BYTES
    rate = tp["read_gib_s"]
    if rate and name != "memory":
        value_b = prefetch_for(rate, cfg.group_bytes)
        bound = ""
        if value_b == 2 * cfg.group_bytes:
            bound = " (raised to the floor, 2 x TBA_GROUP_BYTES)"
        elif value_b == PREFETCH_CAP:
            bound = f" (capped at {format_size(PREFETCH_CAP)})"
        out.append(
            Recommendation(
                "TBA_PREFETCH_BYTES",
                _env_size(value_b),
                f"~{PREFETCH_SECONDS * 1000:.0f} ms of reads at the measured {rate:.2f} GiB/s"
                f"{bound}; host memory held during backward",
            )
        )
    return out


# The numbers behind the rules in recommend's docstring.
QUOTA_SHARE = 0.9  # of the free space above TBA_MIN_FREE_BYTES
SATURATION = 0.9  # "enough" requests in flight reach this share of the best read rate
PREFETCH_SECONDS = 0.1  # read-ahead covers this much time at the measured read rate
PREFETCH_CAP = GIB
PREFETCH_STEP = 32 * MIB


def quota_for(free: int, min_free: int, ranks: int) -> int:
    """Per-process TBA_MAX_DISK_BYTES: QUOTA_SHARE of the room above the floor, per rank."""
    return max(0, int((free - min_free) * QUOTA_SHARE)) // max(1, ranks)


def in_flight_for(sweep: dict[int, float], default: int) -> tuple[int, int]:
    """(recommended, enough): enough = fewest requests in flight within SATURATION of the best
    measured rate; recommended = at least ``default``."""
    best = max(sweep.values())
    enough = min(w for w, r in sweep.items() if r >= SATURATION * best)
    return max(default, enough), enough


def prefetch_for(read_gib_s: float, group_bytes: int) -> int:
    """TBA_PREFETCH_BYTES: PREFETCH_SECONDS of reads, within [2 groups, PREFETCH_CAP]."""
    raw = align_up(int(read_gib_s * GIB * PREFETCH_SECONDS), PREFETCH_STEP)
    return min(PREFETCH_CAP, max(2 * group_bytes, raw))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks_per_node(d: Run) -> tuple[int, str]:
    v = d.variables.get("LOCAL_WORLD_SIZE", "")
    if v.strip().isdigit() and int(v) > 0:
        return int(v), "LOCAL_WORLD_SIZE"
    n = d.facts["cuda"]["device_count"]
    if n > 0:
        return n, "one per CUDA device"
    return 1, "no LOCAL_WORLD_SIZE, no GPU"


def _env_size(n: int, down: bool = False) -> str:
    """A size as a TBA_* value: whole GiB when exact (or when rounding down), else whole MiB."""
    if n >= GIB and (n % GIB == 0 or down):
        return f"{n // GIB}GiB"
    return f"{n // MIB}MiB"
