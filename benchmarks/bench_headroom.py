"""Batch headroom on W1: the largest micro-batch that fits under a memory cap, without and with tba.

Each trial is a fresh child process that builds W1 (``tba.testing.GPT(W1)``), takes a random
batch of B sequences and runs forward+backward ``--steps`` times (default 3, the same for every
mode, so that max batches compare), with no optimizer, as bench_step does (the second step is
tba's steady state: it has a prefetch plan, and for ``TBA_KEEP_LAST=auto`` a keep decision; the
third is auto's first step on what it learnt, and a third step has killed per-block
checkpointing at a batch that fit two). "Fits" means the child exits 0, and for auto also that
no step's tba peak passed its budget; "does not fit" means the kernel OOM-killed it in its
cgroup, or torch raised an out-of-memory error (the output says in which step), or auto went
over its budget (a batch where nothing fits the budget the cap implies: it ran on the margin,
and at such a batch, 44, auto was OOM-killed in step 4 of a 5-step timing trial, 2026-12-04).
For each mode the batch size is searched exponentially (1, 2, 4, ...) and then by bisection;
the baseline (none) from ``--start``, the others from the baseline's result.

Modes: ``none`` (no tba), ``tba`` (tba as configured: TBA_POLICY=offload unless ``--env`` says
otherwise), ``checkpoint`` (no tba, every block under ``torch.utils.checkpoint``), ``auto`` (tba
with TBA_POLICY=auto and a TBA_MEMORY_BUDGET the cap implies, below), and ``keep``,
``offload`` (TBA_KEEP_LAST=0) and ``recompute`` (tba with that TBA_POLICY: auto's calibration
references, searchable too).

**auto's budget.** The budget bounds what tba accounts for (``peak_resident_bytes``; the
chooser's predicted peak also counts a recomputed block's tensors during its backward, which is
``peak_with_recompute_bytes``). The cap must also hold everything else: the model, its
gradients, the allocator's and torch's overhead, tba's own pools, transient backward buffers.
That "other" part is measured, not assumed: before the searches, each reference mode
(``--auto-refs``, default ``keep``, ``offload`` = TBA_POLICY=offload with TBA_KEEP_LAST=0, and
``recompute``) runs at the batch sizes of ``--auto-calibrate`` (default 16 and 32, near the
batches auto reaches under 1280 MiB: "other" is not linear in B) with no cap;
per trial ``other = peak charged - max over its steps of peak_with_recompute_bytes``, and a
least-squares line ``other = fixed + per_seq x B`` is fitted per reference. Then, per auto
trial at batch B: ``budget(B) = cap - max over the references of their other(B) -
--auto-margin`` (default 64 MiB), passed as TBA_MEMORY_BUDGET in bytes. The charge's peak and
tba's need not come at the same moment, so each subtraction is only a lower bound of "other" at
the charge's peak; the references cover the moments that matter: keep peaks at the end of the
forward, offload holds little all along (so its charge peak is mostly "other", which under
offload grows with B and levels off: 444, 564, 724, 787 MiB at B = 4, 10, 16, 24 with
tcmalloc, against 5 MiB per sequence under keep; read-back buffers in tba's pool, which
``peak_resident_bytes`` does not count once free, and backward's buffers), recompute peaks
while a block is recomputed. (Offload with adaptive keep is no reference: its tba peak is step
1's kept block, its charge peak another moment; with it in place of offload, other(11) came out
at 425 MiB where an all-offload auto trial measured 555 MiB.) The points, the lines, the
formula and each trial's budget are printed and written to the JSON
(``auto_budget``; ``budget`` per trial). ``--auto-fit`` skips the calibration with a line
(``FIXED,PER_SEQ``) or an earlier run's JSON file.

auto's trials run ``--steps`` steps too (``--auto-steps`` overrides that for auto alone; the
runs in BENCHMARKS.md before this default had 2 steps for the other modes and 3 for auto): step
1 runs as offload with no block kept (adaptive keep's first K is 0 when memory is bounded,
FIRST_K in tba/decide/adaptive.py), auto decides when step 2 starts, and step 3 runs on what it
learnt from step 2. With a TBA_MEMORY_BUDGET set, TBA_STAGING_FULL defaults to ``wait`` (NOTE
[Staging backpressure] in tba/datapath/capture/staging.py); before that, from batch 33 on, the
second of each block's two MLP tensors (132 MiB each; the 256 MiB staging holds one while it is
written) stayed resident all forward, and an auto trial at 33 was OOM-killed in step 1. The actions
each step ran with are printed per trial (one letter per block: k, o, r, or s for
recompute_offload), and a trial that does not fit says in which step it was killed.

**Time per sequence.** After the searches, each mode runs again at its max batch, under the cap,
``--time-rounds`` rounds (default 2; 0 skips it) with the modes in turn (the order rotates per
round): ``--time-warmup`` untimed steps (default 2) and ``--time-steps`` timed ones (default 3).
Seconds per sequence = the median of all timed steps / the batch. With tba, checkpoint and auto
among the modes, the output checks issue 16's item: auto's max batch at least checkpoint's, at a
time per sequence no worse than tba's at its own max batch.

How the cap is enforced (``--mechanism``, default ``auto``: the first that works):

- ``cgroup2``: a child cgroup of ours with ``memory.max`` = cap and ``memory.swap.max`` = 0;
  the trial's process is moved into it before it execs Python. OOM kills are read from
  ``memory.events``, the peak from ``memory.peak``.
- ``cgroup1``: the same with the v1 memory controller: ``memory.limit_in_bytes`` and
  ``memory.memsw.limit_in_bytes`` = cap (no swap), ``memory.swappiness`` = 0; OOM kills from
  ``memory.oom_control``, the peak from ``memory.max_usage_in_bytes``.
- ``rusage``: **no cap is enforced.** Every trial runs unconstrained and "fits" means its
  peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) stayed under the cap. Used only when no memory
  cgroup can be created; the output says so on every line that matters.

Calibration trials (``--calibrate``, auto's budget) run in a group with no limit.

RLIMIT_AS is not used: it limits virtual address space, and a torch process reserves far more
than it touches (VmSize about 2x VmHWM for W1 at batch 1 here: thread stacks, malloc arenas, the
staging pool before it is touched), so it would measure reservations rather than memory.

What the cgroup charges: the trial's anonymous memory (tensors, the model, gradients, tba's
staging pool and read-back buffers, the allocator's retained heap) and the page cache it
faults in. tba writes its spill files with O_DIRECT, so they add no page cache; the page cache
and dirty bytes charged to each trial's group are sampled every 50 ms and reported, so that
claim is checked on every run. Shared-library pages already cached by another process stay
charged to that process's cgroup, so the charge is below the child's RSS by roughly libtorch's
resident text.

    python benchmarks/bench_headroom.py                      # default cap, modes none,tba
    python benchmarks/bench_headroom.py --cap 6GiB --modes none,tba,checkpoint
    python benchmarks/bench_headroom.py --calibrate 4,8      # peak charge per mode, no cap
    python benchmarks/bench_headroom.py --env MALLOC_MMAP_THRESHOLD_=1048576 --json out.json
    # issue 16's headroom item: the four modes, auto's budget calibrated, timed at the max batch
    python benchmarks/bench_headroom.py --modes none,tba,checkpoint,auto \
        --env LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 --json headroom.json
    # auto's budget derivation alone, and auto at two batch sizes with no cap
    python benchmarks/bench_headroom.py --calibrate 16,32 --modes auto --cap 1280MiB

``--env`` sets a variable for every trial of every mode (e.g. a ``TBA_*`` setting, which only
tba trials read, or a glibc malloc tunable, which all read); ``--auto-env`` one for auto's
trials only (after ``--env``; auto sets TBA_POLICY and TBA_MEMORY_BUDGET itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20
GiB = 1 << 30
# Measured with --calibrate 4,8,12 (glibc malloc defaults): the baseline peaks at about 1190 MiB
# charged at batch 8 and grows by about 115 MiB per sequence, so it fits 8 and not 9 here.
DEFAULT_CAP = "1280MiB"
RESULT_TAG = "HEADROOM_RESULT "
STEP_TAG = "HEADROOM_STEP "
EXIT_TRIAL_OOM = 3  # the trial caught an out-of-memory error from torch or Python
MODES = ("none", "tba", "checkpoint", "auto")
# Trial modes that run tba, and the settings each sets over --env (tba: none, so TBA_POLICY=offload
# with adaptive keep by default). keep, offload (every block written from step 1 on) and recompute
# are the calibration references of auto's budget; they can be searched or calibrated too.
TBA_MODES: dict[str, dict[str, str]] = {
    "tba": {},
    "auto": {"TBA_POLICY": "auto"},
    "keep": {"TBA_POLICY": "keep"},
    "offload": {"TBA_POLICY": "offload", "TBA_KEEP_LAST": "0"},
    "recompute": {"TBA_POLICY": "recompute"},
}
TRIAL_MODES = (*MODES, "keep", "offload", "recompute")
# stats() after every step of a tba trial, and after the last
STEP_KEYS = (
    "saved_bytes",
    "peak_resident_bytes",
    "peak_with_recompute_bytes",
    "group_policy",
    "keep_last",
)
FINAL_KEYS = (
    "saved_bytes",
    "peak_resident_bytes",
    "peak_with_recompute_bytes",
    "bytes_offloaded",
    "tensors_kept",
    "kept_reasons",
    "sync_loads",
    "backend",
    "keep_last",
    "keep_decision",
    "group_policy",
    "policy_decision",
    "budget_decision",
)


# -- the trial (child process) -----------------------------------------------------------------
def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text
    )


def trial_main(mode: str, batch_size: int, steps: int, spill_root: str) -> int:
    """One trial: W1 at ``batch_size``, ``steps`` forward+backward steps; one result line.

    After each step it prints a step line (so the parent knows how far an OOM-killed trial got)
    and, for the modes that run tba, that step's ``stats()``: peaks, saved bytes, block actions.
    """
    out: dict = {"mode": mode, "batch": batch_size, "step_seconds": []}
    off = None
    try:
        import torch

        import tba
        from tba.testing import GPT, W1, random_batch

        torch.manual_seed(0)
        model = GPT(W1)
        batch = random_batch(W1, batch_size)
        model.checkpoint_blocks = mode == "checkpoint"
        if mode in TBA_MODES:  # the parent set TBA_POLICY (and TBA_MEMORY_BUDGET...) per mode
            off = tba.Offloader(tba.Config(spill_dir=spill_root))
            out["tba_steps"] = []
        for i in range(steps):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if off is not None:
                with off.step(model):
                    loss = model(*batch)
            else:
                loss = model(*batch)
            loss.backward()
            out["step_seconds"].append(time.perf_counter() - t0)
            del loss
            line = {"step": i + 1, "seconds": out["step_seconds"][-1]}
            if off is not None:
                st = off.stats()
                per = {k: st.get(k) for k in STEP_KEYS}
                out["tba_steps"].append(per)
                line.update(per)
            print(STEP_TAG + json.dumps(line), flush=True)
        out["ok"] = True
        if off is not None:
            st = off.stats()
            out["tba"] = {k: st.get(k) for k in FINAL_KEYS if k in st}
            out["tba_config"] = {
                k: str(v) for k, v in off.config.as_dict().items() if k != "spill_dir"
            }
    except BaseException as e:  # noqa: BLE001 - the trial reports any failure and its kind
        out["ok"] = False
        out["oom"] = _is_oom(e)
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        if off is not None:
            with contextlib.suppress(BaseException):
                off.close()
    out["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(RESULT_TAG + json.dumps(out), flush=True)
    if out["ok"]:
        return 0
    return EXIT_TRIAL_OOM if out["oom"] else 1


# -- memory caps -------------------------------------------------------------------------------
def _mounts() -> list[tuple[str, str, str]]:
    rows = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                rows.append((parts[1], parts[2], parts[3]))
    return rows


def _own_cgroup(controller: str | None) -> str | None:
    """Our path in the v2 hierarchy (controller None) or in the v1 ``controller`` hierarchy."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, ctrls, path = line.split(":", 2)
            if controller is None and hid == "0" and ctrls == "":
                return path
            if controller is not None and controller in ctrls.split(","):
                return path
    return None


class Cap:
    """How a trial's memory is capped. ``run`` returns (returncode, oom_killed, peak, extra)."""

    name = "rusage"
    enforced = False

    def __init__(self, cap: int | None):
        self.cap = cap

    def describe(self) -> str:
        return (
            "NOT ENFORCED: no memory cgroup usable; each trial runs unconstrained and 'fits' "
            "means its peak RSS (getrusage ru_maxrss) stayed under the cap"
        )

    @contextlib.contextmanager
    def group(self, capped: bool = True):
        yield None

    def wrap(self, argv: list[str], group) -> list[str]:
        return argv

    def read(self, group) -> dict:
        return {}

    def stat(self, group) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class CgroupCap(Cap):
    """A fresh child memory cgroup per trial (counters start at zero), removed afterwards."""

    enforced = True

    def __init__(self, cap: int | None, root: Path, version: int):
        super().__init__(cap)
        self.root = root  # our own cgroup directory: the trial groups nest inside it
        self.version = version
        self.name = f"cgroup{version}"
        self._n = 0

    def describe(self) -> str:
        if self.version == 2:
            how = "memory.max = cap, memory.swap.max = 0"
        else:
            how = "memory.limit_in_bytes = memory.memsw.limit_in_bytes = cap, swappiness 0"
        return f"cgroup v{self.version} memory controller, one child group per trial ({how})"

    @staticmethod
    def _write(path: Path, value) -> None:
        path.write_text(f"{value}\n")

    def make(self, capped: bool = True) -> Path:
        """A new group, limited to the cap (``capped``) or unlimited (a calibration trial)."""
        self._n += 1
        g = self.root / f"tba-headroom-{os.getpid()}-{self._n}"
        g.mkdir()
        cap = self.cap if capped else None
        try:
            limit = cap if cap is not None else "max"
            if self.version == 2:
                self._write(g / "memory.max", limit)
                if (g / "memory.swap.max").exists():
                    self._write(g / "memory.swap.max", 0)
            else:
                limit = cap if cap is not None else -1
                self._write(g / "memory.limit_in_bytes", limit)
                if (g / "memory.memsw.limit_in_bytes").exists():
                    self._write(g / "memory.memsw.limit_in_bytes", limit)
                if (g / "memory.swappiness").exists():
                    self._write(g / "memory.swappiness", 0)
        except OSError:
            self._remove(g)
            raise
        return g

    @staticmethod
    def _remove(g: Path) -> None:
        for _ in range(50):  # the killed child may take a moment to leave the group
            try:
                g.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove cgroup {g}", file=sys.stderr)

    @contextlib.contextmanager
    def group(self, capped: bool = True):
        g = self.make(capped)
        try:
            yield g
        finally:
            self._remove(g)

    def wrap(self, argv: list[str], group) -> list[str]:
        # The shell joins the group, then execs Python: everything the trial allocates is charged.
        script = 'echo $$ > "$0" || exit 97; exec "$@"'
        return ["/bin/sh", "-c", script, str(group / "cgroup.procs"), *argv]

    def _kv(self, path: Path) -> dict[str, int]:
        out = {}
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                k, _, v = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = int(v)
        return out

    def stat(self, group) -> dict[str, int]:
        """Page cache and anonymous memory charged now, in common names."""
        s = self._kv(group / "memory.stat")
        if self.version == 2:
            keys = {"anon": "anon", "file": "file", "dirty": "file_dirty"}
            keys["writeback"] = "file_writeback"
        else:
            keys = {"anon": "rss", "file": "cache", "dirty": "dirty", "writeback": "writeback"}
        return {k: s.get(v, 0) for k, v in keys.items()}

    def read(self, group) -> dict:
        if self.version == 2:
            ev = self._kv(group / "memory.events")
            peak_file = group / "memory.peak"
            oom_kills = ev.get("oom_kill", 0)
        else:
            ev = self._kv(group / "memory.oom_control")
            peak_file = group / "memory.max_usage_in_bytes"
            oom_kills = ev.get("oom_kill", 0)
        peak = None
        with contextlib.suppress(OSError, ValueError):
            peak = int(peak_file.read_text().split()[0])
        return {"oom_kills": oom_kills, "peak_charged_bytes": peak}


def _probe_group(cap: CgroupCap) -> str | None:
    """Create a group, move a short-lived child into it, remove it. None when that works."""
    try:
        with cap.group() as g:
            argv = cap.wrap([sys.executable, "-c", "pass"], g)
            rc = subprocess.run(argv, capture_output=True, timeout=60).returncode
            if rc != 0:
                return f"a child could not join {g} (exit {rc})"
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def open_cap(cap_bytes: int | None, mechanism: str) -> tuple[Cap, list[str]]:
    """The first usable mechanism (or the one asked for), and why the others were not used."""
    notes: list[str] = []
    mounts = _mounts()
    candidates: list[CgroupCap] = []
    if mechanism in ("auto", "cgroup2"):
        v2 = next((m for m, fs, _ in mounts if fs == "cgroup2"), None)
        own = _own_cgroup(None)
        if v2 is None or own is None:
            notes.append("cgroup2: no cgroup2 mount")
        else:
            root = Path(v2) / own.lstrip("/")
            ctrls = (root / "cgroup.subtree_control").read_text().split() if root.exists() else []
            if "memory" not in ctrls:
                have = (Path(v2) / "cgroup.controllers").read_text().split()
                notes.append(
                    f"cgroup2: the memory controller is not enabled for children of {root} "
                    f"(controllers on {v2}: {' '.join(have) or 'none'})"
                )
            else:
                candidates.append(CgroupCap(cap_bytes, root, 2))
    if mechanism in ("auto", "cgroup1"):
        v1 = next(
            (m for m, fs, opts in mounts if fs == "cgroup" and "memory" in opts.split(",")), None
        )
        own = _own_cgroup("memory")
        if v1 is None or own is None:
            notes.append("cgroup1: no v1 memory controller mounted")
        else:
            candidates.append(CgroupCap(cap_bytes, Path(v1) / own.lstrip("/"), 1))
    for c in candidates:
        why = _probe_group(c)
        if why is None:
            return c, notes
        notes.append(f"{c.name}: {why}")
    if mechanism not in ("auto", "rusage"):
        raise SystemExit(f"bench_headroom: --mechanism {mechanism} is not usable: {notes}")
    return Cap(cap_bytes), notes


# -- auto's budget ------------------------------------------------------------------------------
MIN_BUDGET = 1 * MiB  # TBA_MEMORY_BUDGET's least number of bytes


class AutoBudget:
    """TBA_MEMORY_BUDGET for an auto trial at batch B: the cap less what the process holds
    besides the saved tensors tba accounts for, less a margin.

    ``lines`` maps a reference to (fixed, per_seq): the bytes charged at the trial's peak that
    are not tba's ``peak_with_recompute_bytes``, as a + b*B (see :func:`calibrate_budget`).
    other(B) is the largest of them at B; budget(B) = cap - other(B) - margin.
    """

    def __init__(self, cap: int, lines: dict[str, tuple[float, float]], margin: int, source: str):
        self.cap = cap
        self.lines = lines
        self.margin = margin
        self.source = source

    def other(self, b: int) -> tuple[float, str]:
        return max((f + p * b, ref) for ref, (f, p) in self.lines.items())

    def at(self, b: int) -> dict:
        other, ref = self.other(b)
        return {
            "batch": b,
            "cap_bytes": self.cap,
            "other_bytes": int(other),
            "other_from": ref,
            "margin_bytes": self.margin,
            "budget_bytes": int(self.cap - other - self.margin),
        }

    def formula(self) -> str:
        terms = [
            f"{f / MiB:.0f} MiB + {p / MiB:.2f} MiB x B ({ref})"
            for ref, (f, p) in self.lines.items()
        ]
        return (
            f"budget(B) = cap {self.cap / MiB:.0f} MiB - other(B) - margin "
            f"{self.margin / MiB:.0f} MiB, other(B) = max of: " + "; ".join(terms)
        )

    def as_dict(self) -> dict:
        return {
            "cap_bytes": self.cap,
            "margin_bytes": self.margin,
            "source": self.source,
            "lines": {
                ref: {"fixed_bytes": f, "bytes_per_sequence": p}
                for ref, (f, p) in self.lines.items()
            },
            "formula": self.formula(),
        }


def _charged(rec: dict) -> int | None:
    """The trial's peak charge: the cgroup's, else (rusage) its peak RSS."""
    return rec.get("peak_charged_bytes") or rec.get("ru_maxrss_bytes")


def _tba_peak(rec: dict) -> int | None:
    """tba's own peak over the trial's steps: resident saved bytes, a recomputed block's
    tensors during its backward included (``peak_with_recompute_bytes``)."""
    per = (rec.get("child") or {}).get("tba_steps") or []
    got = [x.get("peak_with_recompute_bytes") for x in per]
    got = [x for x in got if x is not None]
    return max(got) if got else None


def calibrate_budget(runner: Runner, cap: int, sizes: list[int], refs: list[str]) -> dict:
    """Run each reference (a tba mode: keep, offload, recompute) at ``sizes`` with no
    cap; per trial, other = peak charged - tba's peak (peak_with_recompute_bytes, max over the
    steps); fit other = a + b*B per reference by least squares. Sets ``runner.budget``."""
    print(
        f"auto: calibrating its budget: {', '.join(refs)} at batch {', '.join(map(str, sizes))}, "
        "no cap; other = peak charged - tba's peak resident (recompute's included)",
        flush=True,
    )
    points: dict[str, list[dict]] = {}
    lines: dict[str, tuple[float, float]] = {}
    for ref in refs:
        points[ref] = []
        for b in sizes:
            r = runner.trial(ref, b, capped=False, purpose="budget")
            charged, tpeak = _charged(r), _tba_peak(r)
            if r["verdict"] != "fits" or charged is None or tpeak is None:
                raise SystemExit(f"bench_headroom: budget calibration {ref} B={b}: {r['why']}")
            saved = ((r.get("child") or {}).get("tba_steps") or [{}])[-1].get("saved_bytes")
            points[ref].append(
                {
                    "batch": b,
                    "peak_charged_bytes": charged,
                    "tba_peak_bytes": tpeak,
                    "saved_bytes": saved,
                    "other_bytes": charged - tpeak,
                }
            )
        fit = _fit([(p["batch"], p["other_bytes"]) for p in points[ref]])
        lines[ref] = (fit["fixed_bytes"], fit["bytes_per_sequence"])
        for p in points[ref]:
            p["residual_bytes"] = p["other_bytes"] - (lines[ref][0] + lines[ref][1] * p["batch"])
    margin = _size(runner.args.auto_margin)
    runner.budget = AutoBudget(cap, lines, margin, f"calibrated at batch {sizes} ({refs})")
    print()
    print(f"{'reference':<11}{'batch':>6}{'charged':>10}{'tba peak':>10}{'saved':>10}{'other':>10}")
    for ref in refs:
        for p in points[ref]:
            print(
                f"{ref:<11}{p['batch']:>6}{_fmt_mib(p['peak_charged_bytes']):>10}"
                f"{_fmt_mib(p['tba_peak_bytes']):>10}{_fmt_mib(p['saved_bytes']):>10}"
                f"{_fmt_mib(p['other_bytes']):>10}"
            )
    print(runner.budget.formula())
    return {"points": points, **runner.budget.as_dict()}


def given_budget(runner: Runner, cap: int, text: str) -> dict:
    """--auto-fit FIXED,PER_SEQ: other(B) = FIXED + PER_SEQ x B, from an earlier calibration;
    or the JSON file of an earlier run: its calibrated lines (``auto_budget``)."""
    margin = _size(runner.args.auto_margin)
    if os.path.isfile(text):
        with open(text) as f:
            got = json.load(f)["auto_budget"]["lines"]
        lines = {
            k: (float(v["fixed_bytes"]), float(v["bytes_per_sequence"])) for k, v in got.items()
        }
    else:
        fixed, _, per = text.partition(",")
        lines = {"given": (float(_size(fixed)), float(_size(per)))}
    runner.budget = AutoBudget(cap, lines, margin, f"--auto-fit {text}")
    print(f"auto: {runner.budget.formula()}")
    return runner.budget.as_dict()


def time_at_max(runner: Runner, res: dict, modes: list[str]) -> dict:
    """Each mode at its max batch, under the cap, ``--time-rounds`` rounds with the modes in
    turn (the order rotates per round): ``--time-warmup`` steps, then ``--time-steps`` timed
    ones. Seconds per sequence = the median timed step / the batch."""
    a = runner.args
    todo = [m for m in modes if (res["modes"][m].get("max_batch") or 0) > 0]
    out: dict = {
        m: {"batch": res["modes"][m]["max_batch"], "timed_steps": [], "rounds": []} for m in todo
    }
    print(
        f"timing at the max batch: {a.time_rounds} rounds, {a.time_warmup} warm-up + "
        f"{a.time_steps} timed steps per trial, modes in turn, under the cap",
        flush=True,
    )
    for r in range(a.time_rounds):
        order = todo[r % len(todo) :] + todo[: r % len(todo)] if todo else []
        for m in order:
            b = out[m]["batch"]
            rec = runner.trial(m, b, a.time_warmup + a.time_steps, purpose=f"time {r + 1}")
            steps = ((rec.get("child") or {}).get("step_seconds") or [])[a.time_warmup :]
            ok = rec["verdict"] == "fits"
            out[m]["rounds"].append(
                {
                    "verdict": rec["verdict"],
                    "why": rec["why"],
                    "step_seconds": steps,
                    "median": statistics.median(steps) if ok and steps else None,
                }
            )
            if ok:
                out[m]["timed_steps"].extend(steps)
    for m in todo:
        med = statistics.median(out[m]["timed_steps"]) if out[m]["timed_steps"] else None
        out[m]["median_step_seconds"] = med
        out[m]["seconds_per_sequence"] = None if med is None else med / out[m]["batch"]
    return out


# tba.plan.render.LETTERS, and u(ser); written out because this parent process does not import
# tba (nor torch)
_LETTERS = {"keep": "k", "offload": "o", "recompute": "r", "recompute_offload": "s", "user": "u"}


def _actions(policy) -> str:
    """A step's block actions, one letter each: k(eep), o(ffload), r(ecompute),
    s (recompute_offload), u(ser)."""
    return "".join(_LETTERS.get(x, "?") for x in policy) if policy else "-"


def over_budget(rec: dict) -> str:
    """Why an auto trial that ran under the cap is still no fit: a step whose tba peak passed
    the budget it was given (nothing fits that budget at this batch, NOTE [Nothing fits]; it
    ran on the margin, and a longer run was OOM-killed there, 2026-12-04). "" when it kept it."""
    budget = (rec.get("budget") or {}).get("budget_bytes")
    per = (rec.get("child") or {}).get("tba_steps") or []
    if rec["mode"] != "auto" or budget is None:
        return ""
    for i, x in enumerate(per, 1):
        peak = x.get("peak_with_recompute_bytes") or 0
        if peak > budget:
            return (
                f"over its budget in step {i}: tba peak {peak / MiB:.0f} MiB > "
                f"{budget / MiB:.0f} MiB"
            )
    return ""


# -- the parent ---------------------------------------------------------------------------------
class Runner:
    def __init__(self, args, cap: Cap, spill_root: str):
        self.args = args
        self.cap = cap
        self.spill_root = spill_root
        self.env = dict(os.environ)
        self.env.update(args.env)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, self.env.get("PYTHONPATH", "")) if p
        )
        self.trials: list[dict] = []
        self.budget: AutoBudget | None = None  # auto's budget per batch, once calibrated

    def steps_for(self, mode: str) -> int:
        """Steps of a search or calibration trial: --steps, and --auto-steps (when given) for
        auto."""
        if mode == "auto" and self.args.auto_steps:
            return self.args.auto_steps
        return self.args.steps

    def trial(
        self, mode: str, b: int, steps: int | None = None, capped: bool = True, purpose: str = ""
    ) -> dict:
        """One child process at batch ``b``: under the cap (``capped``) or in an unlimited
        group (calibration), ``steps`` steps (default: :meth:`steps_for`)."""
        steps = steps or self.steps_for(mode)
        env = dict(self.env)
        rec: dict = {"mode": mode, "batch": b, "steps": steps, "capped": capped}
        if purpose:
            rec["purpose"] = purpose
        if TBA_MODES.get(mode):
            env.update(TBA_MODES[mode])
            rec["tba_env"] = dict(TBA_MODES[mode])
        if mode == "auto":
            env.update(self.args.auto_env)
            if self.budget is None:
                raise RuntimeError("bench_headroom: auto needs its budget calibrated first")
            got = self.budget.at(b)
            rec["budget"] = got
            if got["budget_bytes"] < MIN_BUDGET:
                rec.update(returncode=None, wall_seconds=0.0, verdict="no")
                rec["why"] = (
                    f"not run: the budget the cap implies is {got['budget_bytes'] / MiB:.0f} MiB "
                    f"(below {MIN_BUDGET / MiB:.0f} MiB, TBA_MEMORY_BUDGET's least): the rest of "
                    "the process alone is predicted to fill the cap"
                )
                self.trials.append(rec)
                self._log(rec)
                return rec
            env["TBA_MEMORY_BUDGET"] = str(got["budget_bytes"])
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--_trial",
            mode,
            str(b),
            "--steps",
            str(steps),
            "--spill-dir",
            self.spill_root,
        ]
        timeout = self.args.trial_timeout or max(180.0, 20.0 * b * steps)
        limit = self.cap.cap if capped else None
        t0 = time.perf_counter()
        peaks: dict[str, int] = {}
        with self.cap.group(capped) as g:
            proc = subprocess.Popen(
                self.cap.wrap(argv, g),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            stop = threading.Event()

            watchdog = []

            def watch():
                # cgroup: the page cache and dirty bytes charged to the trial, over time.
                # rusage: nothing stops the trial, so kill it once its RSS passes the cap.
                while not stop.wait(0.05):
                    for k, v in self.cap.stat(g).items():
                        peaks[k] = max(peaks.get(k, 0), v)
                    if not self.cap.enforced and limit is not None:
                        rss = _rss_of(proc.pid)
                        if rss is not None and rss > limit:
                            watchdog.append(rss)
                            proc.kill()
                            return

            w = threading.Thread(target=watch, daemon=True)
            w.start()
            timed_out = False
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                stdout, stderr = proc.communicate()
            stop.set()
            w.join()
            info = self.cap.read(g)
        rec["returncode"] = proc.returncode
        rec["wall_seconds"] = time.perf_counter() - t0
        rec.update(info)
        rec["max_charged"] = peaks
        child = None
        done = []
        for line in stdout.splitlines():
            if line.startswith(RESULT_TAG):
                child = json.loads(line[len(RESULT_TAG) :])
            elif line.startswith(STEP_TAG):
                done.append(json.loads(line[len(STEP_TAG) :]))
        rec["steps_done"] = len(done)
        if child is not None:
            rec["child"] = child
            rec["ru_maxrss_bytes"] = child.get("ru_maxrss_bytes")
        elif done:  # killed: what the steps it finished said
            rec["child"] = {
                "step_seconds": [d["seconds"] for d in done],
                "tba_steps": [{k: d.get(k) for k in STEP_KEYS} for d in done if "saved_bytes" in d],
            }
        killed_in = f" in step {len(done) + 1} of {steps}"
        if watchdog:
            rec["ru_maxrss_bytes"] = rec.get("ru_maxrss_bytes") or watchdog[0]
            rec["verdict"] = "no"
            rec["why"] = f"RSS {watchdog[0] / MiB:.0f} MiB above the cap{killed_in}: killed"
            rec["why"] += " (not enforced)"
        elif timed_out:
            rec["verdict"], rec["why"] = "no", f"timed out after {timeout:.0f} s (thrashing?)"
        elif proc.returncode == 0 and child is not None and child.get("ok"):
            rss = child.get("ru_maxrss_bytes") or 0
            if not self.cap.enforced and limit is not None and rss > limit:
                rec["verdict"], rec["why"] = "no", "peak RSS above the cap (not enforced)"
            else:
                rec["verdict"], rec["why"] = "fits", over_budget(rec)
                if rec["why"]:  # auto's budget is a bound: luck under the cap is no fit
                    rec["verdict"] = "no"
        elif proc.returncode == -9 and (info.get("oom_kills", 0) > 0 or not self.cap.enforced):
            rec["verdict"], rec["why"] = "no", f"OOM-killed in its cgroup{killed_in}"
        elif proc.returncode == EXIT_TRIAL_OOM:
            rec["verdict"] = "no"
            rec["why"] = f"out of memory{killed_in}: {child.get('error', '')}"
        else:
            tail = (stderr or "").strip().splitlines()[-5:]
            rec["verdict"] = "error"
            rec["why"] = f"exit {proc.returncode}: " + " | ".join(tail)
        self.trials.append(rec)
        self._log(rec)
        return rec

    def _log(self, rec: dict) -> None:
        child = rec.get("child") or {}
        steps = child.get("step_seconds") or []
        peak = rec.get("peak_charged_bytes")
        rss = rec.get("ru_maxrss_bytes")
        extra = []
        if rec.get("budget"):
            extra.append(f"budget {rec['budget']['budget_bytes'] / MiB:.0f} MiB")
        if peak is not None:
            extra.append(f"peak charged {peak / MiB:7.0f} MiB")
        if rss:
            extra.append(f"peak RSS {rss / MiB:7.0f} MiB")
        if steps:
            extra.append("steps " + ", ".join(f"{s:.1f}" for s in steps) + " s")
        per = child.get("tba_steps") or []
        if per:
            extra.append(
                "tba peak "
                + ", ".join(_fmt_mib(x.get("peak_with_recompute_bytes")) for x in per)
                + f" of saved {_fmt_mib(per[-1].get('saved_bytes'))}"
            )
        if rec["mode"] in ("auto", "recompute"):
            acts = [_actions(x.get("group_policy")) for x in per]
            if acts:
                extra.append("blocks " + " | ".join(acts))
        else:
            keep = (child.get("tba") or {}).get("keep_last")
            if keep is not None:
                extra.append(f"keep_last {keep}")
        if rec["why"]:
            extra.append(rec["why"])
        label = rec["mode"] + (f" [{rec['purpose']}]" if rec.get("purpose") else "")
        print(
            f"  {label:<11} B={rec['batch']:<4} {rec['verdict']:<6} "
            f"{rec['wall_seconds']:6.1f} s  " + "; ".join(extra),
            flush=True,
        )

    def search(self, mode: str, start: int) -> dict:
        """Largest B that fits: doubling from ``start``, then bisection (assumes monotony)."""
        lo, hi = 0, None  # largest B known to fit, smallest B known not to
        found: dict[int, dict] = {}
        b = max(1, min(start, self.args.max_batch))
        while hi is None:
            r = found[b] = self.trial(mode, b)
            if r["verdict"] == "error":
                return {"max_batch": None, "error": r["why"], "trials": list(found.values())}
            if r["verdict"] == "fits":
                lo = b
                if b >= self.args.max_batch:
                    break
                b = min(2 * b, self.args.max_batch)
            else:
                hi = b
        while hi is not None and hi - lo > 1:
            b = (lo + hi) // 2
            r = found[b] = self.trial(mode, b)
            if r["verdict"] == "error":
                return {"max_batch": None, "error": r["why"], "trials": list(found.values())}
            if r["verdict"] == "fits":
                lo = b
            else:
                hi = b
        return {
            "max_batch": lo,
            "first_failing_batch": hi,
            "at_max": found.get(lo),
            "trials": [found[k] for k in sorted(found)],
        }


def _rss_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def _size(text: str) -> int:
    from tba.config import parse_size

    return parse_size(text)


def _env_pair(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return k, v


def _dirty_tree() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            check=False,
        )
        return [line[3:] for line in out.stdout.splitlines()]
    except OSError:
        return []


def _fmt_mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", default=DEFAULT_CAP, help=f"memory cap (default {DEFAULT_CAP})")
    ap.add_argument(
        "--modes",
        default="none,tba",
        help="comma-separated: none, tba, checkpoint, auto (and keep, recompute: tba's policies)",
    )
    ap.add_argument(
        "--mechanism",
        choices=("auto", "cgroup2", "cgroup1", "rusage"),
        default="auto",
        help="how the cap is enforced (default: the first usable cgroup, else rusage)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=3,
        help="forward+backward steps per trial, every mode (default 3: auto's step 1 runs as "
        "offload, auto decides before step 2, step 3 runs on what it learnt from step 2)",
    )
    ap.add_argument(
        "--auto-steps",
        type=int,
        default=None,
        help="steps per auto trial, when they should differ from --steps (default: --steps)",
    )
    ap.add_argument(
        "--auto-calibrate",
        default="16,32",
        metavar="B,B,...",
        help="batch sizes of auto's budget calibration (default 16,32; no cap)",
    )
    ap.add_argument(
        "--auto-refs",
        default="keep,offload,recompute",
        help="tba modes whose non-tba memory calibrates auto's budget (default all three)",
    )
    ap.add_argument(
        "--auto-fit",
        metavar="FIXED,PER_SEQ|JSON",
        help="skip the calibration: other(B) = FIXED + PER_SEQ x B (sizes, e.g. 300MiB,20MiB), "
        "or the lines calibrated in an earlier run's --json file",
    )
    ap.add_argument(
        "--auto-margin",
        default="64MiB",
        help="safety margin taken off auto's budget (default 64MiB)",
    )
    ap.add_argument(
        "--time-rounds",
        type=int,
        default=2,
        help="rounds of timed trials at each mode's max batch (default 2; 0: none)",
    )
    ap.add_argument("--time-warmup", type=int, default=2, help="untimed steps per timed trial")
    ap.add_argument("--time-steps", type=int, default=3, help="timed steps per timed trial")
    ap.add_argument(
        "--start",
        type=int,
        default=1,
        help="first batch size of the baseline's search (the other modes start at its result)",
    )
    ap.add_argument("--max-batch", type=int, default=256, help="stop searching above this")
    ap.add_argument("--trial-timeout", type=float, default=0, help="seconds (0: by batch size)")
    ap.add_argument("--spill-dir", default="/var/tmp", help="root of the spill dir (local disk)")
    ap.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--auto-env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a variable for auto's trials only, after --env (e.g. TBA_KEEP_LAST=0)",
    )
    ap.add_argument(
        "--calibrate",
        metavar="B,B,...",
        help="no search: run each mode at these batch sizes with no cap and report the peaks",
    )
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--_trial", nargs=2, metavar=("MODE", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._trial:
        mode, b = args._trial
        return trial_main(mode, int(b), args.steps, args.spill_dir)

    from _machine import machine_line

    args.env = dict(args.env)
    args.auto_env = dict(args.auto_env)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in TRIAL_MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {TRIAL_MODES}")
    refs = [m for m in args.auto_refs.split(",") if m]
    if any(m not in TBA_MODES or m == "auto" for m in refs):
        ap.error(f"--auto-refs: tba modes other than auto ({refs})")
    cap_bytes = None if args.calibrate else _size(args.cap)
    cap, notes = open_cap(cap_bytes, args.mechanism)
    machine = machine_line(args.spill_dir)
    dirty = _dirty_tree()
    print(machine)
    if dirty:
        print(f"working tree has uncommitted changes in: {', '.join(dirty)}")
    print(
        f"cap: {'none (calibration)' if cap_bytes is None else args.cap}, "
        f"mechanism {cap.name}: {cap.describe()}"
    )
    for n in notes:
        print(f"  not used: {n}")
    if not cap.enforced:
        print("!" * 100)
        print("!! WARNING: the cap is NOT enforced; results compare peak RSS with the cap.")
        print("!" * 100)
    if args.env:
        print(f"trial environment: {' '.join(f'{k}={v}' for k, v in args.env.items())}")
    if args.auto_env:
        print(f"auto's trials also: {' '.join(f'{k}={v}' for k, v in args.auto_env.items())}")

    spill_root = tempfile.mkdtemp(prefix="tba-headroom-", dir=args.spill_dir)
    runner = Runner(args, cap, spill_root)
    res: dict = {
        "workload": "W1 (tba.testing.W1), forward+backward, no optimizer",
        "steps_per_trial": args.steps,
        "auto_steps_per_trial": runner.steps_for("auto") if "auto" in modes else None,
        "mechanism": cap.name,
        "mechanism_detail": cap.describe(),
        "cap_enforced": cap.enforced,
        "mechanisms_not_used": notes,
        "env": args.env,
        "auto_env": args.auto_env,
        "machine": machine,
        "dirty_files": dirty,
    }
    try:
        if "auto" in modes:  # its budget first: every auto trial needs it
            budget_cap = _size(args.cap)
            if args.auto_fit:
                res["auto_budget"] = given_budget(runner, budget_cap, args.auto_fit)
            else:
                sizes = [int(x) for x in args.auto_calibrate.split(",") if x]
                res["auto_budget"] = calibrate_budget(runner, budget_cap, sizes, refs)
            print()
        if args.calibrate:
            sizes = [int(x) for x in args.calibrate.split(",") if x]
            res["calibration"] = {m: [runner.trial(m, b) for b in sizes] for m in modes}
            print()
            print(
                f"{'mode':<12}{'batch':>6}{'peak charged':>14}{'peak RSS':>12}"
                f"{'last step (s)':>15}{'tba peak':>10}{'budget':>10}"
            )
            for m in modes:
                for r in res["calibration"][m]:
                    steps = (r.get("child") or {}).get("step_seconds") or [None]
                    st = "-" if steps[-1] is None else f"{steps[-1]:.2f}"
                    bud = (r.get("budget") or {}).get("budget_bytes")
                    print(
                        f"{m:<12}{r['batch']:>6}{_fmt_mib(r.get('peak_charged_bytes')):>14}"
                        f"{_fmt_mib(r.get('ru_maxrss_bytes')):>12}{st:>15}"
                        f"{_fmt_mib(_tba_peak(r)):>10}{_fmt_mib(bud):>10}"
                    )
        else:
            res["cap_bytes"] = cap_bytes
            res["cap"] = args.cap
            res["modes"] = {}
            for m in modes:
                # the baseline searches from --start; the others from the baseline's result,
                # which they are expected to reach (bisection goes down if they do not)
                base = res["modes"].get("none", {}).get("max_batch")
                start = args.start if m == "none" or not base else base
                print(f"searching {m} from batch {start} ...", flush=True)
                res["modes"][m] = runner.search(m, start)
                res["modes"][m]["fit"] = _linear_fit(res["modes"][m]["trials"])
            if args.time_rounds > 0:
                print()
                res["timing"] = time_at_max(runner, res, modes)
            _report(res, modes)
    finally:
        cap.close()
        shutil.rmtree(spill_root, ignore_errors=True)
    file_max = max((r.get("max_charged", {}).get("file", 0) for r in runner.trials), default=0)
    dirty_max = max((r.get("max_charged", {}).get("dirty", 0) for r in runner.trials), default=0)
    res["max_page_cache_charged_bytes"] = file_max
    res["max_dirty_charged_bytes"] = dirty_max
    if cap.enforced:
        print(
            f"page cache charged to any trial (sampled every 50 ms): at most {file_max / MiB:.1f} "
            f"MiB, dirty at most {dirty_max / MiB:.1f} MiB"
        )
    if args.json:
        res["all_trials"] = runner.trials
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _linear_fit(trials: list[dict]) -> dict | None:
    """Least squares of the peak charge against B over the trials that fit: a + b*B."""
    pts = [
        (t["batch"], t["peak_charged_bytes"])
        for t in trials
        if t["verdict"] == "fits" and t.get("peak_charged_bytes")
    ]
    if len({b for b, _ in pts}) < 2:
        return None
    return _fit(pts)


def _fit(pts: list[tuple[int, float]]) -> dict:
    """Least squares y = a + b*x over at least two distinct x."""
    n = len(pts)
    if len({x for x, _ in pts}) < 2:
        raise SystemExit(f"bench_headroom: a line needs two distinct batch sizes, got {pts}")
    mx = sum(b for b, _ in pts) / n
    my = sum(y for _, y in pts) / n
    slope = sum((b - mx) * (y - my) for b, y in pts) / sum((b - mx) ** 2 for b, _ in pts)
    return {"fixed_bytes": my - slope * mx, "bytes_per_sequence": slope, "points": n}


def _report(res: dict, modes: list[str]) -> None:
    enforced = res["cap_enforced"]
    print()
    steps = f"{res['steps_per_trial']} steps per trial"
    if res.get("auto_steps_per_trial") not in (None, res["steps_per_trial"]):
        steps += f" ({res['auto_steps_per_trial']} for auto)"
    print(
        f"W1 max micro-batch under a {res['cap']} cap ({res['mechanism']}"
        f"{'' if enforced else ', NOT ENFORCED: peak RSS compared with the cap'}), {steps}"
    )
    print(
        f"{'mode':<12}{'max batch':>10}{'fails at':>10}{'peak charged':>14}{'peak RSS':>11}"
        f"{'last step':>11}{'s/seq':>8}  tba"
    )
    for m in modes:
        r = res["modes"][m]
        if r.get("max_batch") is None:
            print(f"{m:<12}  error: {r.get('error')}")
            continue
        at = r.get("at_max") or {}
        child = at.get("child") or {}
        steps = child.get("step_seconds") or []
        step = steps[-1] if steps else None
        fails = r.get("first_failing_batch")
        t = child.get("tba") or {}
        tinfo = ""
        if t:
            tinfo = (
                f"keep_last {t.get('keep_last')}, peak_resident "
                f"{_fmt_mib(t.get('peak_resident_bytes'))} "
                f"of saved {_fmt_mib(t.get('saved_bytes'))}"
            )
        if at.get("budget"):
            per = child.get("tba_steps") or []
            tinfo = (
                f"budget {_fmt_mib(at['budget']['budget_bytes'])}, tba peak "
                f"{_fmt_mib(_tba_peak(at))} of saved {_fmt_mib(t.get('saved_bytes'))}, blocks "
                + " | ".join(_actions(x.get("group_policy")) for x in per)
            )
        step_s = "-" if step is None else f"{step:.2f}"
        per_seq = "-" if step is None or not r["max_batch"] else f"{step / r['max_batch']:.3f}"
        print(
            f"{m:<12}{r['max_batch']:>10}{'-' if fails is None else fails:>10}"
            f"{_fmt_mib(at.get('peak_charged_bytes')):>14}{_fmt_mib(at.get('ru_maxrss_bytes')):>11}"
            f"{step_s:>11}{per_seq:>8}  {tinfo}"
        )
    for m in modes:
        fit = res["modes"][m].get("fit")
        if fit:
            print(
                f"  {m}: peak charged ~ {fit['fixed_bytes'] / MiB:.0f} MiB + "
                f"{fit['bytes_per_sequence'] / MiB:.1f} MiB x batch (least squares over "
                f"{fit['points']} fitting trials)"
            )
    if res.get("auto_budget"):
        print(f"  auto: {res['auto_budget']['formula']}")
    base = res["modes"].get("none", {}).get("max_batch")
    for m in modes:
        if m == "none":
            continue
        got = res["modes"][m].get("max_batch")
        if base and got is not None:
            res.setdefault("ratios", {})[f"{m}/none"] = got / base
            print(f"max batch {m} / none: {got} / {base} = {got / base:.2f}x")
        elif base == 0:
            print(f"max batch {m} / none: the baseline does not fit batch 1 under this cap")
    timing = res.get("timing")
    if timing:
        print()
        print(
            "time per sequence at the max batch (under the cap; median of the timed steps of "
            "all rounds; per round: its median)"
        )
        print(f"{'mode':<12}{'batch':>6}{'step (s)':>10}{'s/seq':>8}  rounds")
        for m in modes:
            t = timing.get(m)
            if not t:
                continue
            med = t.get("median_step_seconds")
            sps = t.get("seconds_per_sequence")
            rounds = ", ".join(
                f"{x['median']:.2f}" if x["median"] is not None else f"{x['verdict']} ({x['why']})"
                for x in t["rounds"]
            )
            print(
                f"{m:<12}{t['batch']:>6}{'-' if med is None else f'{med:.2f}':>10}"
                f"{'-' if sps is None else f'{sps:.3f}':>8}"
                f"  {rounds}"
            )
    _acceptance(res, modes)


def _acceptance(res: dict, modes: list[str]) -> None:
    """Issue 16's item, when auto ran with tba and checkpoint: auto's max batch at least
    checkpoint's, at a time per sequence no worse than tba's at its own max batch."""
    if not {"auto", "tba", "checkpoint"} <= set(modes):
        return
    got = {m: res["modes"][m].get("max_batch") for m in ("auto", "tba", "checkpoint")}
    checks = {}
    if got["auto"] is not None and got["checkpoint"] is not None:
        checks["max batch auto >= checkpoint"] = (
            got["auto"] >= got["checkpoint"],
            f"{got['auto']} vs {got['checkpoint']}",
        )
    timing = res.get("timing") or {}
    sa = (timing.get("auto") or {}).get("seconds_per_sequence")
    st = (timing.get("tba") or {}).get("seconds_per_sequence")
    if sa is not None and st is not None:
        checks["s/seq auto <= tba (each at its max batch)"] = (
            sa <= st,
            f"{sa:.3f} vs {st:.3f} ({sa / st:.3f}x)",
        )
    res["acceptance"] = {k: {"pass": ok, "detail": d} for k, (ok, d) in checks.items()}
    for k, (ok, d) in checks.items():
        print(f"issue 16: {k}: {'PASS' if ok else 'FAIL'} ({d})")


if __name__ == "__main__":
    raise SystemExit(main())
