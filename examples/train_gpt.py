"""Train a GPT whose activations outgrow its weights four ways, side by side: no offload,
per-block activation checkpointing, tba at its defaults, and tba with a memory budget
(``TBA_MEMORY_BUDGET=0.25``: what a user who wants checkpointing's memory would set).

The four run in one process on copies of one model, each with its own AdamW, on the same
batches of this repository's own text. Their steps are interleaved (every round runs each
once, the order rotating), so that the machine's drift falls on all four alike. It prints:

- **peak resident**: the most bytes of saved tensors (what autograd keeps for backward,
  parameters excluded) held in memory at once during a step. For no offload and
  checkpointing, a saved-tensor hook counts each saved storage from its first save until it is
  freed, and for checkpointing also what backward recomputes; for tba it is
  ``stats()["peak_resident_bytes"]`` (kept tensors, staging and read-back buffers), the most
  over all of its steps. Not the process's RSS: that also holds the model, the optimizer, and
  whatever the allocator keeps.
- **step**: the median time of a training step (forward, backward, optimizer) over the timed
  rounds, after one warm-up round.
- **loss parity**: whether each one's losses, and its weights after the last step, are
  bit-identical to no offload's.

A last round, not timed, records memory over one step of each (tba's through ``stats()``
every few milliseconds) and plots the four curves (needs matplotlib: ``tba[plot]``).

    python examples/train_gpt.py [--rounds 5] [--spill-dir /var/tmp] [--out DIR] [--tiny]

tba's settings are its defaults, or your ``TBA_*`` environment (the header lists any that are
set); the spill files go to a fresh directory under ``--spill-dir``, removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

import tba
from tba.decide.keep import is_parameter_like
from tba.testing import GPT, GPTConfig, warm_cpu_math

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _machine import machine_line  # noqa: E402
from _stats import ratio_interval  # noqa: E402

# Long sequences on a narrow model: what a step saves for backward is many times its weights.
MODEL = GPTConfig(vocab=256, seq=1024, hidden=256, heads=4, layers=4)
BATCH = 2
TINY = GPTConfig(vocab=256, seq=64, hidden=64, heads=2, layers=2)
TINY_BATCH = 2
VARIANTS = ("none", "checkpoint", "tba", "tba_budget")
BUDGET = 0.25  # the budget row's TBA_MEMORY_BUDGET: a quarter of what no offload holds
LABELS = {
    "none": "no offload",
    "checkpoint": "checkpointing",
    "tba": "tba (defaults)",
    "tba_budget": f"tba (budget {BUDGET:g})",
}
TBA_ENV_LABEL = "tba (your TBA_*)"  # the row's name when TBA_* variables are set
GOAL = 1.05  # tba's step over no offload's, at most (issue 41)
PLOT_FILE = "memory.png"
MiB = 2**20


def corpus() -> torch.Tensor:
    """This repo's docs and sources as bytes: a corpus that is always there."""
    files = sorted(glob.glob(os.path.join(ROOT, "*.md"))) + sorted(
        glob.glob(os.path.join(ROOT, "tba", "**", "*.py"), recursive=True)
    )
    parts = []
    for name in files:
        with open(name, "rb") as f:
            parts.append(f.read())
    data = b"\n".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, cfg: GPTConfig, batch: int, steps: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(len(data) - cfg.seq - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + cfg.seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# -- what no offload and checkpointing hold --------------------------------------------------
class SavedBytes:
    """Bytes of saved-tensor storages alive, as events: each storage counts from the first time
    autograd saves it until it is freed (a finalizer on the storage). A finalizer can run inside
    any allocation, so it only appends to a deque; the counting happens at the next save or at
    :meth:`flush`."""

    def __init__(self, model: torch.nn.Module, clock: Callable[[], float]):
        self.clock = clock
        self.params = frozenset(p.untyped_storage()._cdata for p in model.parameters())
        self.live: dict[int, int] = {}  # storage cdata -> bytes
        self.resident = 0
        self.events: list[tuple[float, int]] = []  # (clock, bytes resident after the change)
        self._dead: deque[tuple[float, int]] = deque()

    def track(self, t: torch.Tensor) -> None:
        self.flush()  # a storage freed before this save may have left its address to this one
        if t.layout is not torch.strided or is_parameter_like(t, self.params):
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.resident += storage.nbytes()
        self.events.append((self.clock(), self.resident))
        weakref.finalize(storage, self._died, key)

    def _died(self, key: int) -> None:
        self._dead.append((self.clock(), key))

    def flush(self) -> None:
        while self._dead:
            when, key = self._dead.popleft()
            self.resident -= self.live.pop(key)
            self.events.append((when, self.resident))

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.track(t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    @property
    def peak(self) -> int:
        return max((b for _, b in self.events), default=0)


class _CountRecomputed(contextlib.AbstractContextManager):
    """Checkpointing's recompute context: an outer hook never sees what backward recomputes
    (torch's recomputation hook is innermost), so this one sits inside it, counts each tensor
    and hands it on to torch's hook unchanged."""

    def __init__(self, meter: SavedBytes):
        self.meter = meter
        self.hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self):
        # torch has no public way to read the hooks on top of the stack: here, torch's own
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            raise RuntimeError(
                f"train_gpt: under torch {torch.__version__}, checkpoint recomputes without a "
                "saved-tensor hook, which this demo counts checkpointing's memory through (as "
                "torch 2.13 has it); use torch 2.13"
            )
        pack, unpack = top

        def counted(t: torch.Tensor):
            self.meter.track(t)
            return pack(t)

        self.hooks = torch.autograd.graph.saved_tensors_hooks(counted, unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class Checkpointed(torch.nn.Module):
    """A block under ``torch.utils.checkpoint`` (non-reentrant): what a user does instead."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block
        self.meter: SavedBytes | None = None  # set for the recorded step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.meter is None:
            return checkpoint(self.block, x, use_reentrant=False)
        meter = self.meter
        return checkpoint(
            self.block,
            x,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), _CountRecomputed(meter)),
        )


# -- what tba holds --------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Reads ``read()`` every ``interval`` seconds until stopped: (clock, value) samples."""

    def __init__(self, read: Callable[[], int], clock: Callable[[], float], interval: float):
        super().__init__(name="demo-sampler", daemon=True)
        self.read, self.clock, self.interval = read, clock, interval
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((self.clock(), self.read()))
            self.done.wait(self.interval)

    def stop(self) -> list[tuple[float, int]]:
        self.done.set()
        self.join()
        self.samples.append((self.clock(), self.read()))
        return self.samples


# -- the four ways to train ------------------------------------------------------------------
class Variant:
    def __init__(self, name: str, base: GPT, spill_dir: str):
        self.name = name
        self.label = LABELS[name]
        self.model = copy.deepcopy(base)
        if name == "checkpoint":
            self.model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in self.model.blocks)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.off = None
        if name == "tba":
            self.off = tba.Offloader(tba.Config(spill_dir=spill_dir))
        elif name == "tba_budget":  # what a user who wants checkpointing's memory would set
            self.off = tba.Offloader(tba.Config(spill_dir=spill_dir, memory_budget=BUDGET))
        self.times: list[float] = []
        self.losses: list[float] = []
        self.peak = 0  # bytes of saved tensors resident, the most seen after the first step
        self.first_peak: int | None = None  # tba's first step (adaptive keep keeps a block then)
        self.trace_peak = 0  # the recorded step's
        self.written = 0  # bytes tba wrote in its last step
        self.trace: list[tuple[float, int]] = []  # (seconds into the recorded step, bytes)
        self.trace_end = 0.0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        if self.off is not None:
            with self.off.step(self.model):
                loss = self.model(x, y)
        else:
            loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        self.losses.append(loss.item())
        if self.off is not None:
            self.off.synchronize()  # outside the time: the last writes count once they land
            st = self.off.stats()
            if self.first_peak is None:
                self.first_peak = st["peak_resident_bytes"]
            else:
                self.peak = max(self.peak, st["peak_resident_bytes"])
            self.trace_peak = st["peak_resident_bytes"]
            self.written = st["bytes_offloaded"]
        return dt

    def recorded_step(self, x: torch.Tensor, y: torch.Tensor, interval: float) -> None:
        """One more step, untimed, recording the bytes resident against time."""
        clock = time.perf_counter
        if self.off is not None:
            sampler = Sampler(lambda: self.off.stats()["resident_bytes"], clock, interval)
            t0 = clock()
            sampler.start()
            self.step(x, y)
            points = sampler.stop()
        else:
            meter = SavedBytes(self.model, clock)
            blocks = [b for b in self.model.blocks if isinstance(b, Checkpointed)]
            for b in blocks:
                b.meter = meter
            t0 = clock()
            meter.events.append((t0, 0))
            with meter.hooks():
                self.step(x, y)
            meter.flush()
            for b in blocks:
                b.meter = None
            points = meter.events
            self.peak = self.trace_peak = meter.peak
        self.trace_end = clock() - t0
        self.trace = [(t - t0, b) for t, b in sorted(points)]

    def close(self) -> None:
        if self.off is not None:
            self.off.close()


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = list(a.parameters()), list(b.parameters())
    return len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))


# -- output ----------------------------------------------------------------------------------
def plot(variants: dict[str, Variant], title: str, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=110)
    ax = fig.add_subplot()
    colors = {"none": "tab:red", "checkpoint": "tab:green", "tba": "tab:blue"}
    colors["tba_budget"] = "tab:purple"
    for v in variants.values():
        xs = [t for t, _ in v.trace] + [v.trace_end]
        ys = [b / MiB for _, b in v.trace] + [v.trace[-1][1] / MiB]
        c = colors[v.name]
        label = f"{v.label}: peak {v.trace_peak / MiB:.1f} MiB"
        ax.plot(xs, ys, drawstyle="steps-post", color=c, lw=1.5, label=label)
        at = max(range(len(v.trace)), key=lambda i: v.trace[i][1])  # where the curve peaks
        px, py = v.trace[at][0], v.trace_peak / MiB  # tba's exact peak can fall between samples
        ax.plot([px], [py], "o", color=c)
        ax.annotate(f"{py:.0f} MiB", (px, py), xytext=(5, 3), textcoords="offset points", color=c)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the step started (forward, backward, optimizer)")
    ax.set_ylabel("MiB of saved tensors resident")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def verdict(
    med: dict[str, float], peak: dict[str, int], first_peak: int | None, who: str = "tba's default"
) -> str:
    """One line on where tba's default stands against the goal, from the measured figures."""
    ratio = med["tba"] / med["none"]
    fast = ratio <= GOAL
    small = peak["tba"] < peak["checkpoint"]
    diff = (peak["checkpoint"] - peak["tba"]) / MiB
    where = f"{abs(diff):.1f} MiB {'below' if diff > 0 else 'above'}" if diff else "equal to"
    line = (
        f"{'goal met' if fast and small else 'goal not met'}: {who} took {ratio:.3f}x "
        f"the step of no offload ({'within' if fast else 'over'} {GOAL}x), with a peak {where} "
        f"checkpointing's"
    )
    if first_peak is not None and first_peak >= peak["checkpoint"] > peak["tba"]:
        line += f" after its first step (which peaked at {first_peak / MiB:.1f} MiB)"
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (each runs all four)")
    ap.add_argument("--spill-dir", default="/var/tmp", help="where tba's temporary dir goes")
    ap.add_argument("--out", default=os.path.join(ROOT, "demo-out"), help="the plot's dir")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, for a quick check")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    cfg, batch = (TINY, TINY_BATCH) if args.tiny else (MODEL, BATCH)
    warm_cpu_math()  # losses are compared bit for bit (NOTE [First-call math])
    torch.manual_seed(0)
    base = GPT(cfg)
    data = corpus()
    rounds = 1 + args.rounds + 1  # a warm-up round, the timed ones, the recorded one
    steps = list(batches(data, cfg, batch, rounds))
    load = os.getloadavg()[0]
    spill = tempfile.mkdtemp(prefix="tba-demo-", dir=args.spill_dir)
    variants = {}
    try:
        variants = {name: Variant(name, base, spill) for name in VARIANTS}
        print(machine_line(spill))
        weights = sum(p.numel() * p.element_size() for p in base.parameters())
        print(
            f"GPT {cfg.layers} blocks, hidden {cfg.hidden}, {cfg.heads} heads, sequence "
            f"{cfg.seq}, batch {batch}, fp32, AdamW: weights {weights / MiB:.1f} MiB; tba "
            f"backend {variants['tba'].off.stats()['backend']}"
        )
        env = sorted(k for k in os.environ if k.startswith("TBA_"))
        print(f"tba settings: {'from ' + ', '.join(env) if env else 'the defaults'}")
        if env:
            variants["tba"].label = TBA_ENV_LABEL
        for r, (x, y) in enumerate(steps):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            line = []
            for name in order:
                v = variants[name]
                if r == rounds - 1:
                    v.recorded_step(x, y, interval=0.002)
                    continue
                dt = v.step(x, y)
                if r > 0:
                    v.times.append(dt)
                line.append(f"{name} {dt:.3f} s")
            what = "warm-up" if r == 0 else "recorded" if r == rounds - 1 else "timed"
            print(f"round {r} ({what}): {', '.join(line) or 'memory over one step'}", flush=True)
    finally:
        for v in variants.values():
            v.close()
        shutil.rmtree(spill, ignore_errors=True)

    none = variants["none"]
    med = {n: statistics.median(v.times) for n, v in variants.items()}
    peak = {n: v.peak for n, v in variants.items()}
    same = {
        n: v.losses == none.losses and weights_equal(v.model, none.model)
        for n, v in variants.items()
    }
    print()
    print(
        f"load average over 1 min: {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
        f"on {os.cpu_count()} cores (other processes make step times noisy)"
    )
    print(
        f"step: median of {args.rounds} timed rounds; peak resident: bytes of saved tensors in "
        f"memory at once (tba: from its second step on)"
    )
    head = ("", "step (s)", "vs none", "peak resident", "vs none", "written/step")
    print(f"{head[0]:<18}{head[1]:>9}{head[2]:>9}{head[3]:>16}{head[4]:>9}{head[5]:>14}")
    for n, v in variants.items():
        print(
            f"{v.label:<18}{med[n]:>9.3f}{med[n] / med['none']:>9.3f}"
            f"{peak[n] / MiB:>12.1f} MiB{peak[n] / max(1, peak['none']):>9.3f}"
            f"{v.written / MiB:>10.1f} MiB"
        )
    tba_first = variants["tba"].first_peak
    if tba_first is not None and tba_first != peak["tba"]:
        print(
            f"tba's first step peaked at {tba_first / MiB:.1f} MiB (adaptive keep keeps a block "
            f"while it measures)"
        )
    print(
        "losses and final weights bit-identical to no offload: "
        + ", ".join(f"{variants[n].label} {'yes' if same[n] else 'NO'}" for n in VARIANTS[1:])
    )
    pairs = list(zip(none.times, variants["tba"].times))
    lo, hi = ratio_interval(pairs)
    print(f"tba / no offload step, 90% interval over resampled rounds: {lo:.3f} to {hi:.3f}")
    who = "tba's default" if variants["tba"].label == LABELS["tba"] else "tba with your TBA_*"
    print(verdict(med, peak, tba_first, who))
    print(
        f"{variants['tba_budget'].label}: {med['tba_budget'] / med['none']:.3f}x the step of no "
        f"offload, {med['tba_budget'] / med['checkpoint']:.3f}x checkpointing's, at a peak of "
        f"{peak['tba_budget'] / MiB:.1f} MiB against checkpointing's {peak['checkpoint'] / MiB:.1f}"
    )
    title = f"GPT {cfg.layers}x{cfg.hidden}, sequence {cfg.seq}, batch {batch}: one step each"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "no plot: matplotlib is not installed. Install it with\n"
            f"  {sys.executable} -m pip install -e '{ROOT}[plot]'"
        )
    else:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, PLOT_FILE)
        plot(variants, title, path)
        print(f"memory over one step: {path}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
