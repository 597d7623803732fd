"""``tba bench``: how many bytes of saved tensors are resident over one training step.

It runs a few forward+backward steps of the test GPT (W1 by default: 6 blocks, H=512, 8 heads,
S=512, micro-batch 8) twice, without and with tba, and records for the last step of each the
bytes of saved tensors held in memory against the time since the step started:

- **none**: our own ``saved_tensors_hooks`` count each saved storage once (by identity) from its
  first pack until autograd drops the last handle to it (a weakref finalizer on the handle), the
  same rule as ``stats()["saved_bytes"]``: parameters and their views are not counted. These
  are events, exact to the microsecond.
- **tba**: a sampler thread calls ``off.stats()`` every ``interval`` seconds and keeps
  ``resident_bytes`` (staging, kept tensors and read-back buffers). Short spikes between two
  samples can be missed; the summary also shows tba's own exact ``peak_resident_bytes``.

Step times include the cost of the measuring itself (a few microseconds per saved tensor for
the baseline's hooks, one ``stats()`` call per sample for tba); ``benchmarks/bench_step.py``
is the place for step times.

With ``rss=True`` both modes also sample the process's resident set size, which includes the
model, gradients, temporaries, the staging arena and whatever the allocator keeps.

Nothing here is imported by ``import tba``; matplotlib is only needed to draw (``tba[plot]``).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .decide.keep import is_parameter_like

__all__ = [
    "BenchSettings",
    "SavedTensorMeter",
    "Trace",
    "run",
    "summary",
    "write_csv",
    "plot",
    "PlotUnavailable",
]

MiB = 1 << 20
MODES = ("none", "tba")
PLOT_HINT = "pip install 'tba[plot]'"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclasses.dataclass
class BenchSettings:
    layers: int = 6
    hidden: int = 512
    heads: int = 8
    seq: int = 512
    batch: int = 8
    vocab: int = 256
    steps: int = 2
    interval: float = 0.001  # seconds between samples
    rss: bool = False
    spill_dir: str | None = None
    seed: int = 0

    def describe(self) -> str:
        return (
            f"GPT {self.layers} layers, H={self.hidden}, {self.heads} heads, S={self.seq}, "
            f"micro-batch {self.batch}, fp32, CPU"
        )


@dataclasses.dataclass
class Trace:
    """One mode's last step: samples of resident saved-tensor bytes and the step's landmarks."""

    mode: str
    saved: list[tuple[float, int]]  # (seconds since step start, bytes of saved tensors)
    rss: list[tuple[float, int]]  # (seconds, process RSS bytes), when asked
    forward_end: float
    backward_end: float
    saved_bytes: int  # unique bytes saved in the step (parameters excluded)
    step_seconds: list[float]  # every step, the measured one last
    stats: dict[str, Any] | None = None  # tba's stats() after the step

    @property
    def peak(self) -> int:
        return max((b for _, b in self.saved), default=0)

    @property
    def peak_rss(self) -> int:
        return max((b for _, b in self.rss), default=0)


# -- the baseline's meter ----------------------------------------------------------------------
class _Saved:
    """What the meter's pack hook hands autograd: the tensor, and a target for a finalizer."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.tensor = t


class SavedTensorMeter:
    """Counts the bytes of saved tensors autograd holds, over time, without moving them.

    Each distinct storage counts once, from its first pack until the last handle returned for
    it dies. Deaths are timestamped by the finalizer and accounted at the next pack or
    :meth:`flush` (a finalizer can run inside any allocation, so it only appends to a deque).
    """

    def __init__(
        self, model: torch.nn.Module | None = None, clock: Callable[[], float] | None = None
    ):
        self.clock = clock or time.perf_counter
        self.param_storages: frozenset[int] = frozenset()
        if model is not None:
            self.param_storages = frozenset(
                p.untyped_storage()._cdata
                for p in (*model.parameters(), *model.buffers())
                if p.layout is torch.strided
            )
        self.live: dict[int, list[int]] = {}  # storage cdata -> [nbytes, live handles]
        self.resident = 0
        self.saved_bytes = 0  # unique bytes packed since reset()
        self.events: list[tuple[float, int]] = []  # (clock, resident after the change)
        self._dead: collections.deque = collections.deque()
        self._seen: set[int] = set()

    def reset(self) -> None:
        """Start a new step: forget the events and the per-step unique count (not the live)."""
        self.flush()
        self.events = [(self.clock(), self.resident)]
        self.saved_bytes = 0
        self._seen = set()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        self.flush()
        if t.layout is not torch.strided or is_parameter_like(t, self.param_storages):
            return t  # held by the model anyway (the rule tba's saved_bytes uses)
        storage = t.untyped_storage()
        cdata = storage._cdata
        rec = self.live.get(cdata)
        if rec is None:
            nbytes = storage.nbytes()
            rec = self.live[cdata] = [nbytes, 0]
            self.resident += nbytes
            self.events.append((self.clock(), self.resident))
        rec[1] += 1
        if cdata not in self._seen:  # saved_bytes counts a storage once per step, like tba's
            self._seen.add(cdata)
            self.saved_bytes += rec[0]
        h = _Saved(t)
        weakref.finalize(h, self._died, cdata)
        return h

    @staticmethod
    def _unpack(h: Any) -> torch.Tensor:
        return h.tensor if isinstance(h, _Saved) else h

    def _died(self, cdata: int) -> None:
        self._dead.append((self.clock(), cdata))  # atomic; accounted by flush()

    def flush(self) -> None:
        dead = self._dead
        while dead:
            when, cdata = dead.popleft()
            rec = self.live.get(cdata)
            if rec is None:  # pragma: no cover - every death follows its pack
                continue
            rec[1] -= 1
            if rec[1] == 0:
                del self.live[cdata]
                self.resident -= rec[0]
                self.events.append((when, self.resident))


# -- sampling ----------------------------------------------------------------------------------
def _rss_reader() -> Callable[[], int] | None:
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    os.close(fd)

    def read() -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * page

    return read


class _Sampler(threading.Thread):
    """Calls each reader every ``interval`` seconds and keeps (clock, value) per reader."""

    def __init__(self, readers: dict[str, Callable[[], int]], interval: float, clock):
        super().__init__(name="tba-bench-sampler", daemon=True)
        self.readers = readers
        self.interval = interval
        self.clock = clock
        self.samples: dict[str, list[tuple[float, int]]] = {k: [] for k in readers}
        self._stop_evt = threading.Event()

    def sample(self) -> None:
        now = self.clock()
        for name, read in self.readers.items():
            self.samples[name].append((now, read()))

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.sample()
            self._stop_evt.wait(self.interval)

    def __enter__(self) -> _Sampler:
        if self.readers:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.readers:
            self._stop_evt.set()
            self.join()
            self.sample()  # the value at the end


def _tba_resident(off: Any) -> Callable[[], int]:
    """``off.stats()["resident_bytes"]``. stats() first accounts the handles autograd dropped
    since tba's last pack or unpack; the bare ``off.index.resident`` counter lags until then
    (a backward that unpacks only kept tensors would show a flat line)."""
    return lambda: off.stats()["resident_bytes"]


# -- running -----------------------------------------------------------------------------------
def _build(s: BenchSettings):
    from .testing import GPT, GPTConfig, random_batch

    cfg = GPTConfig(vocab=s.vocab, seq=s.seq, hidden=s.hidden, heads=s.heads, layers=s.layers)
    torch.manual_seed(s.seed)
    return GPT(cfg), random_batch(cfg, s.batch, seed=s.seed)


def _one_step(model, batch, ctx, readers, interval, clock):
    """Forward and backward once; returns (t0, forward end, backward end, samples)."""
    model.zero_grad(set_to_none=True)
    with _Sampler(readers, interval, clock) as sampler:
        t0 = clock()
        with ctx():
            loss = model(*batch)
        t_fwd = clock()
        loss.backward()
        t_bwd = clock()
        del loss
        time.sleep(min(0.05, max(5 * interval, 0.005)))  # let the curve settle after backward
    return t0, t_fwd, t_bwd, sampler.samples


def _rel(points: list[tuple[float, int]], t0: float) -> list[tuple[float, int]]:
    """Seconds since ``t0``; what came before ``t0`` collapses to its last value, at 0."""
    before = [v for t, v in points if t < t0]
    head = [(0.0, before[-1])] if before else []
    return head + [(t - t0, v) for t, v in points if t >= t0]


def run_none(s: BenchSettings, model=None, batch=None) -> Trace:
    if model is None:
        model, batch = _build(s)
    clock = time.perf_counter
    meter = SavedTensorMeter(model, clock)
    rss = _rss_reader() if s.rss else None
    readers = {"rss": rss} if rss else {}
    times = []
    for _ in range(s.steps):
        meter.reset()
        t0, t_fwd, t_bwd, samples = _one_step(model, batch, meter.hooks, readers, s.interval, clock)
        meter.flush()
        times.append(t_bwd - t0)
    return Trace(
        mode="none",
        saved=_rel(meter.events, t0),
        rss=_rel(samples.get("rss", []), t0),
        forward_end=t_fwd - t0,
        backward_end=t_bwd - t0,
        saved_bytes=meter.saved_bytes,
        step_seconds=times,
    )


def run_tba(s: BenchSettings, model=None, batch=None, config=None) -> Trace:
    from . import Config, Offloader

    if model is None:
        model, batch = _build(s)
    if config is None:
        config = Config(spill_dir=s.spill_dir) if s.spill_dir else Config()
    clock = time.perf_counter
    rss = _rss_reader() if s.rss else None
    times = []
    with Offloader(config) as off:
        readers = {"saved": _tba_resident(off)}
        if rss:
            readers["rss"] = rss
        for _ in range(s.steps):
            t0, t_fwd, t_bwd, samples = _one_step(
                model, batch, lambda: off.step(model), readers, s.interval, clock
            )
            times.append(t_bwd - t0)
        stats = off.stats()
    return Trace(
        mode="tba",
        saved=_rel(samples["saved"], t0),
        rss=_rel(samples.get("rss", []), t0),
        forward_end=t_fwd - t0,
        backward_end=t_bwd - t0,
        saved_bytes=stats["saved_bytes"],
        step_seconds=times,
        stats=stats,
    )


def _run_mode(mode: str, s: BenchSettings, config=None, model=None, batch=None) -> Trace:
    if mode == "none":
        return run_none(s, model, batch)
    return run_tba(s, model, batch, config)


def run(
    s: BenchSettings,
    config=None,
    progress: Callable[[str], None] | None = None,
    isolate: bool | None = None,
) -> dict[str, Trace]:
    """Both modes: ``{"none": Trace, "tba": Trace}``.

    In-process by default: one model, one batch, the modes one after the other. With
    ``isolate`` (the default when ``s.rss``), each mode runs in a fresh spawned process, so
    neither inherits the other's heap, threads or staging arena: the process RSS of one mode
    says nothing about the other otherwise.
    """
    if s.hidden % s.heads:
        raise ValueError(f"hidden ({s.hidden}) must be a multiple of heads ({s.heads})")
    if isolate is None:
        isolate = s.rss
    out: dict[str, Trace] = {}
    if isolate:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        for mode in MODES:
            if progress:
                progress(f"{mode}: {s.steps} step(s) of {s.describe()}, in a fresh process")
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                out[mode] = pool.submit(_run_mode, mode, s, config).result()
        return out
    model, batch = _build(s)
    for mode in MODES:
        if progress:
            progress(f"{mode}: {s.steps} step(s) of {s.describe()}")
        out[mode] = _run_mode(mode, s, config, model, batch)
    return out


# -- output ------------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def summary(traces: dict[str, Trace], s: BenchSettings) -> str:
    none, tb = traces["none"], traces["tba"]
    st = tb.stats or {}
    lines = [
        f"tba bench: {s.describe()}; step {s.steps} of {s.steps} shown",
        f"{'mode':<6}{'step (s)':>10}{'forward (s)':>13}{'peak resident':>16}"
        f"{'saved_bytes':>14}" + (f"{'peak RSS':>12}" if s.rss else ""),
    ]
    for t in (none, tb):
        lines.append(
            f"{t.mode:<6}{t.step_seconds[-1]:>10.3f}{t.forward_end:>13.3f}"
            f"{_mib(t.peak):>16}{_mib(t.saved_bytes):>14}"
            + (f"{_mib(t.peak_rss):>12}" if s.rss else "")
        )
    lines.append(
        f"none: counted by saved-tensor hooks (exact); tba: stats()['resident_bytes'] every "
        f"{s.interval * 1000:g} ms; tba's own peak_resident_bytes "
        f"{_mib(st.get('peak_resident_bytes', 0))}"
    )
    if none.peak:
        ref = max(tb.peak, st.get("peak_resident_bytes", 0))
        lines.append(f"tba peak / baseline peak: {ref / none.peak:.3f}")
    if st:
        lines.append(
            f"tba: backend {st.get('backend')}, offloaded {_mib(st.get('bytes_offloaded', 0))}, "
            f"reloaded {_mib(st.get('bytes_reloaded', 0))}, kept {st.get('tensors_kept', 0)} "
            f"tensors {dict(st.get('kept_reasons', {}))}, sync_loads {st.get('sync_loads', 0)}"
        )
    return "\n".join(lines)


def write_csv(traces: dict[str, Trace], path: str) -> None:
    """Long format, ``mode,kind,seconds,bytes``. Kinds: ``saved`` and ``rss`` (samples),
    ``forward_end`` and ``backward_end`` (times, no bytes), ``saved_bytes`` (the step's unique
    saved bytes, no time)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "kind", "seconds", "bytes"])
        for t in traces.values():
            for sec, b in t.saved:
                w.writerow([t.mode, "saved", f"{sec:.6f}", b])
            for sec, b in t.rss:
                w.writerow([t.mode, "rss", f"{sec:.6f}", b])
            w.writerow([t.mode, "forward_end", f"{t.forward_end:.6f}", ""])
            w.writerow([t.mode, "backward_end", f"{t.backward_end:.6f}", ""])
            w.writerow([t.mode, "saved_bytes", "", t.saved_bytes])


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib: {PLOT_HINT}") from e


def _steps(points: list[tuple[float, int]], end: float) -> tuple[list[float], list[float]]:
    xs = [t for t, _ in points]
    ys = [b / MiB for _, b in points]
    if points and xs[-1] < end:
        xs.append(end)
        ys.append(ys[-1])
    return xs, ys


def plot(traces: dict[str, Trace], s: BenchSettings, path: str) -> None:
    """Both modes' resident saved-tensor bytes on one figure (PNG, or what ``path`` names)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.6), dpi=110)
    ax = fig.add_subplot()
    colors = {"none": "tab:red", "tba": "tab:blue"}
    end = max(t.backward_end for t in traces.values()) * 1.02
    for t in traces.values():
        c = colors.get(t.mode, "black")
        xs, ys = _steps(t.saved, end)
        label = "no offload" if t.mode == "none" else "tba"
        ax.plot(
            xs,
            ys,
            drawstyle="steps-post",
            color=c,
            lw=1.6,
            label=f"{label}: saved tensors resident (peak {t.peak / MiB:.0f} MiB)",
        )
        if t.rss:
            xr, yr = _steps(t.rss, end)
            ax.plot(
                xr,
                yr,
                color=c,
                lw=0.8,
                ls="--",
                alpha=0.7,
                label=f"{label}: process RSS (peak {t.peak_rss / MiB:.0f} MiB)",
            )
        y = 0.98 if t.mode == "none" else 0.55
        for x, ls, what in (
            (t.forward_end, ":", "forward end"),
            (t.backward_end, "-.", "backward end"),
        ):
            ax.axvline(x, color=c, ls=ls, lw=1)
            ax.annotate(
                f"{label} {what}",
                (x, y),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=7,
                color=c,
                va="top",
                ha="right",
                xytext=(-2, 0),
                textcoords="offset points",
            )
    ax.set_xlim(0, end)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since step start")
    if any(t.rss for t in traces.values()):
        ax.set_ylabel("MiB resident (solid: saved tensors, dashed: process RSS)")
    else:
        ax.set_ylabel("MiB of saved tensors resident")
    ax.set_title(f"{s.describe()}\nlast of {s.steps} steps", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
