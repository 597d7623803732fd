"""GPU benchmark: a ~1B-parameter Llama-shaped model in bf16, without tba, under its peers and
under several tba policies: the activation peak, step time, bytes moved, stall, what each policy
decided (and, for ``auto``, the step it predicted), and bit-exactness against no tba.

Built with plain torch only (RMSNorm, rotary embeddings, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP; no transformers, no network), so it runs on a
bare GPU machine. A step is forward + backward of one micro-batch (no optimizer: it moves no
activations). Modes (``--modes``, all by default):

- peers: ``none`` (no tba), ``checkpoint`` (``torch.utils.checkpoint``, non-reentrant, per
  block), ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``; on the CPU
  pin_memory=False, since pinning needs CUDA), ``torchtune`` (torchtune's
  ``OffloadActivations``, when it imports and runs here: else its row says why not);
- tba: ``tba`` (its defaults, ``TBA_*`` applied), ``auto@0.5`` and ``auto@0.35``
  (``TBA_POLICY=auto`` with a memory budget of that share of the activation peak of ``none``),
  ``recompute`` and ``selective`` (``TBA_POLICY``). Each tba mode has its own Offloader.

The activation peak of a mode is its ``torch.cuda.max_memory_allocated`` less the weights and
their gradients (on the CPU, without a device peak, that of ``none`` is measured by counting the
saved tensors instead, for the budgets). Order of work:

1. warm-up: ``--warmup`` steps per mode, ``none`` first (its peak sets auto's budgets); adaptive
   keep and the chooser decide after step 1;
2. exactness, under ``torch.use_deterministic_algorithms(True)``: no tba twice (the control),
   then each other mode, losses and gradients compared bit for bit. Without deterministic
   algorithms two runs of the same step differ on a GPU (seen on an H200: flash attention's and
   embedding's backward accumulate in a varying order), so a comparison there says nothing; if
   even the control differs, exactness is reported as not checkable rather than as a failure;
3. timing, with the default (nondeterministic) kernels: ``--steps`` rounds, one step of each
   mode in turn; the figures are medians, the peak the largest of the timed steps.

    python benchmarks/gpu/bench_gpu.py --json out.json [--seq 16384 --warmup 2 --steps 3]
    python benchmarks/gpu/bench_gpu.py --dry   # a tiny model on the CPU: checks the script

Model (--layers 16 --hidden 2048 --heads 16 --kv-heads 4 --ffn 5632 --vocab 32000): about
0.85 B parameters. ``--dry`` uses 2 layers of hidden 64 at sequence 128 (or ``--seq``) on
whatever device is there and is what CI runs (benchmarks/gpu/check.sh --dry).
:func:`acceptance` judges the figures against issue 40's targets; benchmarks/gpu/summarize.py
prints them in one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# cuBLAS is deterministic only with a fixed workspace, set before its first handle (the
# exactness check runs under torch.use_deterministic_algorithms)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import tba  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotary(seq: int, dim: int, device, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x, cos, sin):
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, h // heads
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.q = nn.Linear(h, h, bias=False)
        self.kv = nn.Linear(h, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(y).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self, layers, hidden, heads, kv_heads, ffn, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.hd = hidden // heads
        self.checkpointed = False  # the ``checkpoint`` mode: each block under checkpoint

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        cos, sin = rotary(tokens.shape[1], self.hd, x.device, x.dtype)
        for blk in self.blocks:
            if self.checkpointed:
                x = checkpoint(blk, x, cos, sin, use_reentrant=False)
            else:
                x = blk(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


PEERS = ("none", "checkpoint", "save_on_cpu", "torchtune")
TBA_MODES = {  # name: Config overrides on top of tba's defaults; "budget": share of none's peak
    "tba": {},
    "auto@0.5": {"policy": "auto", "budget": 0.5},
    "auto@0.35": {"policy": "auto", "budget": 0.35},
    "recompute": {"policy": "recompute"},
    "selective": {"policy": "selective"},
}
MODES = (*PEERS, *TBA_MODES)
COUNTERS = ("bytes_offloaded", "bytes_reloaded", "stall_seconds", "pack_stall_seconds")
LAST = ("sync_loads", "uploads_ahead", "uploads_at_unpack", "keep_last", "kept_reasons")
# which tier the last step's bytes took, and why a tier was off (NOTE [Host tier])
TIERS = ("host_tier", "host_tier_reason", "host_tier_bytes", "ssd_tier_bytes", "host_tier_refusals")


class Mode:
    """How one mode runs a step: ``off`` (a tba mode's Offloader) or ``ctx`` (a context the
    forward runs in); ``not_run``: why it cannot run here; ``note``: how it ran."""

    def __init__(self, name, ctx=None, off=None, not_run=None, note=None):
        self.name, self.ctx, self.off, self.not_run, self.note = name, ctx, off, not_run, note


def load_torchtune():
    """torchtune's ``OffloadActivations`` and how it was imported, or (None, why not).

    ``torchtune/__init__.py`` imports its datasets, models and generation packages, and with them
    Hugging Face ``datasets`` and its dependencies, which ``OffloadActivations`` does not use.
    When that import fails, ``torchtune.training`` is imported without running the package's
    ``__init__`` (the class is torchtune's own code either way); docs/gpu.md says what to carry.
    """
    try:
        from torchtune.training import OffloadActivations

        return OffloadActivations, "torchtune.training"
    except Exception as first:  # noqa: BLE001 - any import failure is a reason to report
        import importlib.util
        import types

        try:
            spec = importlib.util.find_spec("torchtune")
        except Exception:  # noqa: BLE001
            spec = None
        if spec is None or spec.origin is None:
            return None, f"torchtune not importable ({type(first).__name__}: {first})"
        for name in [n for n in sys.modules if n == "torchtune" or n.startswith("torchtune.")]:
            del sys.modules[name]  # what the failed import left half-built
        pkg = types.ModuleType("torchtune")
        pkg.__path__ = [os.path.dirname(spec.origin)]
        sys.modules["torchtune"] = pkg
        try:
            from torchtune.training import OffloadActivations
        except Exception as e:  # noqa: BLE001
            del sys.modules["torchtune"]
            return None, f"torchtune not importable ({type(e).__name__}: {e})"
        return OffloadActivations, "torchtune.training, without torchtune/__init__ (datasets)"


def torchtune_mode():
    cls, how = load_torchtune()
    if cls is None:
        return Mode("torchtune", not_run=how)
    version = getattr(sys.modules.get("torchtune"), "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("torchtune")
        except Exception:  # noqa: BLE001
            version = "?"
    try:
        ctx = cls()  # its defaults: pinned memory, a side stream; one for every step
    except Exception as e:  # noqa: BLE001 - e.g. it needs CUDA (it takes the CUDA streams)
        return Mode("torchtune", not_run=f"torchtune {version} cannot run here ({e!s:.200})")
    return Mode("torchtune", ctx=lambda: ctx, note=f"torchtune {version} via {how}")


class _Checkpointed:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.checkpointed = True

    def __exit__(self, *exc):
        self.model.checkpointed = False


def peer_mode(name, model, dev):
    if name == "checkpoint":
        return Mode(name, ctx=lambda: _Checkpointed(model))
    if name == "save_on_cpu":
        pin = dev.type == "cuda"
        note = None if pin else "pin_memory=False: pinning needs CUDA"
        return Mode(name, ctx=lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin), note=note)
    if name == "torchtune":
        return torchtune_mode()
    return Mode(name)  # none


def progress(msg: str) -> None:
    """A line on stderr as the run goes: a run cut short by its time limit still says how far it
    got and what each mode's steps took (the table comes only at the end)."""
    print(f"bench_gpu: {msg}", file=sys.stderr, flush=True)


def step(model, mode, tokens, targets, dev):
    """One forward + backward; returns (seconds, peak bytes allocated, loss, stats or None)."""
    model.zero_grad(set_to_none=True)
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    off = mode.off
    t0 = time.perf_counter()
    if off is not None:
        with off.step(model):
            loss = model(tokens, targets)
    elif mode.ctx is not None:
        with mode.ctx():
            loss = model(tokens, targets)
    else:
        loss = model(tokens, targets)
    loss.backward()
    sync(dev)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    stats = None
    if off is not None:
        off.synchronize()  # the step's last writes are counted once they land
        stats = off.stats()
    return dt, peak, loss.detach(), stats


def profile_step(model, mode, x, y, dev, top: int = 25) -> None:
    """One step of ``mode`` under cProfile (the training thread, where a launch-bound GPU step
    loses its time), its top functions by own time and by cumulative time on stderr."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    dt = step(model, mode, x, y, dev)[0]
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        text = "\n".join(line for line in buf.getvalue().splitlines() if line.strip())
        progress(f"profile of one {mode.name} step ({dt:.3f} s under cProfile), by {key}:\n{text}")


def grads_of(model, mode, x, y, dev):
    loss = step(model, mode, x, y, dev)[2]
    return [loss.clone(), *(p.grad.clone() for p in model.parameters())]


def exactness(model, modes, x, y, dev) -> dict:
    """Per mode but ``none``: True or False (bit-identical to no tba), or None when the control
    (no tba run twice) already differs; under deterministic algorithms (module docstring)."""
    torch.use_deterministic_algorithms(True)
    none = Mode("none")
    try:
        ref = grads_of(model, none, x, y, dev)
        control = all(map(torch.equal, ref, grads_of(model, none, x, y, dev)))
        out = {"deterministic_control": control}
        for mode in modes:
            if mode.name != "none":
                got = grads_of(model, mode, x, y, dev)
                out[mode.name] = all(map(torch.equal, ref, got)) if control else None
        return out
    except RuntimeError as e:  # an op without a deterministic implementation, or memory
        return {"deterministic_control": None, "error": str(e).splitlines()[0][:300]}
    finally:
        torch.use_deterministic_algorithms(False)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def decided(st: dict) -> str:
    """What the step's policy did to the blocks, in a few words; for ``auto`` also the step
    time its chooser predicted (from blocks timed on the device clock on a GPU) and how long it
    took to decide."""
    d = st.get("policy_decision", {})
    acts = d.get("actions")
    tiers = ""
    if st.get("host_tier") == "on":  # which tier the step's bytes took (NOTE [Host tier])
        host, ssd = st.get("host_tier_bytes", 0) >> 20, st.get("ssd_tier_bytes", 0) >> 20
        tiers = f"; host tier {host} / ssd {ssd} MiB"
    if acts:
        mix = ", ".join(f"{acts.count(a)} {a}" for a in ("keep", "offload", "recompute"))
        return (
            f"{mix} (predicted step {d['predicted_step_seconds']:.3f} s, "
            f"decided in {d.get('decision_seconds', 0.0):.2f} s){tiers}"
        )
    return f"{st['policy']}, keep_last {st['keep_last']}{tiers}"


def saved_peak(model, x, y) -> int:
    """The most bytes of saved tensors alive at once in a step without tba (the CPU's stand-in
    for the activation peak, which has no device counter there)."""
    from tba.bench import SavedTensorMeter

    meter = SavedTensorMeter(model)
    model.zero_grad(set_to_none=True)
    meter.reset()
    with meter.hooks():
        loss = model(x, y)
    meter.flush()
    peak = max(v for _, v in meter.events)
    loss.backward()
    return peak


def budget_of(share: float, activation_peak: int) -> int | float:
    """TBA_MEMORY_BUDGET for ``share`` of the activation peak: in bytes, or where that is below
    the 1 MiB tba accepts (the dry run's tiny model) the share itself, of tba's saved bytes."""
    nbytes = int(share * activation_peak)
    return nbytes if nbytes >= 1 << 20 else share


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="a tiny model: checks the script")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each mode)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=None, help="default 4096 (--dry: 128)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spill-dir", default=None, help="default: TBA_SPILL_DIR, else a temp dir")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--profile",
        default="",
        help="modes to profile after the timed rounds: one more step each under cProfile "
        "(the training thread only), its top functions printed on stderr; untimed",
    )
    a = ap.parse_args(argv)
    names = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or "none" not in names:
        ap.error(f"--modes takes 'none' and any of {', '.join(MODES)}; got {a.modes!r}")
    names = ["none", *(m for m in names if m != "none")]  # none first: its peak sets budgets
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.dry:
        a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab = 2, 64, 4, 2, 128, 256
        a.warmup, a.steps = min(a.warmup, 2), 1
    a.seq = a.seq or (128 if a.dry else 4096)
    dtype = torch.bfloat16 if dev.type == "cuda" or a.dry else torch.float32
    torch.manual_seed(0)
    model = Llama(a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab).to(dev, dtype)
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(dev)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    spill = a.spill_dir or os.environ.get("TBA_SPILL_DIR") or tempfile.mkdtemp(prefix="tba-gpu-")
    extra = {"min_offload_bytes": 1} if a.dry else {}
    modes = {m: peer_mode(m, model, dev) for m in names if m in PEERS}
    runs: dict[str, list] = {}
    base = {"activation_peak": 0, "from": ""}
    try:
        for _ in range(a.warmup):  # allocator, kernels; and none's peak for the budgets
            got = step(model, modes["none"], x, y, dev)
        base["activation_peak"] = max(0, got[1] - 2 * weights)  # weights and their gradients
        base["from"] = "max_memory_allocated of none less weights and gradients"
        if dev.type != "cuda":
            base["activation_peak"] = saved_peak(model, x, y)
            base["from"] = "saved tensors of none alive at once (no device peak on the CPU)"
        for m in names:
            if m in TBA_MODES:
                cfg = dict(TBA_MODES[m])
                share = cfg.pop("budget", None)
                if share is not None:
                    cfg["memory_budget"] = budget_of(share, base["activation_peak"])
                off = tba.Offloader(tba.Config(spill_dir=spill, **extra, **cfg))
                modes[m] = Mode(m, off=off)
        modes = {m: modes[m] for m in names}
        ready = [mode for mode in modes.values() if mode.not_run is None]
        for mode in ready:  # warm-up: slabs, adaptive keep, the chooser
            if mode.name != "none":
                for _ in range(a.warmup):
                    got = step(model, mode, x, y, dev)
            progress(f"{mode.name} warmed up: last step {got[0]:.3f} s")
        exact = exactness(model, ready, x, y, dev)
        progress("exactness checked")
        runs = {mode.name: [] for mode in ready}
        for i in range(a.steps):
            for mode in ready:
                runs[mode.name].append(step(model, mode, x, y, dev))
            progress(
                f"round {i + 1} of {a.steps}: "
                + ", ".join(f"{m} {r[-1][0]:.3f} s" for m, r in runs.items())
            )
        for mode in ready:
            if mode.name in a.profile.split(","):
                profile_step(model, mode, x, y, dev)
        offs = [mode.off for mode in ready if mode.off is not None]
        backend = offs[0].stats()["backend"] if offs else None
    finally:
        for mode in modes.values():
            if mode.off is not None:
                mode.off.close()
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dry": a.dry,
        "model": {
            "params": params,
            "layers": a.layers,
            "hidden": a.hidden,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "ffn": a.ffn,
            "vocab": a.vocab,
            "seq": a.seq,
            "batch": a.batch,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "weights_bytes": weights,
        "budget_base": base,
        "spill_dir": spill,
        "backend": backend,
        "warmup": a.warmup,
        "steps": a.steps,
        "exactness": exact,
        # tba's modes: a peer's (reported per row) is not tba's to fail
        "bit_exact": all(exact.get(m) is not False for m in runs if m in TBA_MODES)
        and "error" not in exact,
        "modes": {},
    }
    for m, mode in modes.items():
        if mode.not_run is not None:
            out["modes"][m] = {"not_run": mode.not_run}
            continue
        rs = runs[m]
        peak = max(r[1] for r in rs)
        r = {
            "step_seconds": statistics.median(r[0] for r in rs),
            "max_memory_allocated": peak,
            "activation_peak": max(0, peak - 2 * weights) if dev.type == "cuda" else None,
            "bit_exact": exact.get(m) if m != "none" else True,
        }
        if mode.note:
            r["note"] = mode.note
        if mode.off is not None:
            sts = [r[3] for r in rs]
            r.update({k: statistics.median(s[k] for s in sts) for k in COUNTERS})
            r.update({k: sts[-1][k] for k in LAST})
            r.update({k: sts[-1][k] for k in TIERS if k in sts[-1]})
            r["decided"] = decided(sts[-1])
            if m in TBA_MODES and "budget" in TBA_MODES[m]:
                r["memory_budget"] = budget_of(TBA_MODES[m]["budget"], base["activation_peak"])
            pred = sts[-1].get("policy_decision", {}).get("predicted_step_seconds")
            if pred is not None:
                r["predicted_step_seconds"] = pred
                r["prediction_error"] = pred / r["step_seconds"] - 1
        out["modes"][m] = r
    none = out["modes"]["none"]
    for r in out["modes"].values():
        if "not_run" in r:
            continue
        r["step_ratio"] = r["step_seconds"] / none["step_seconds"]
        act = none["activation_peak"]
        r["peak_ratio"] = r["activation_peak"] / act if act else None
    out["acceptance"] = acceptance(out)
    print(summary(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not out["bit_exact"]:
        print("bench_gpu: losses or gradients differ from no tba", file=sys.stderr)
        sys.exit(1)
    return out


# Issue 40's targets, per line: (what, how it is judged)
TARGETS = (
    "tba default: step <= 1.05x none, activation peak below save_on_cpu's",
    "recompute: step <= 1.00x checkpoint",
    "auto@0.5: step <= 1.10x none",
    "auto@0.35: step <= checkpoint's",
    "faster than save_on_cpu at an equal or lower peak (some tba mode)",
    "faster than torchtune at an equal or lower peak (some tba mode)",
    "auto@0.5: predicted step within 15% of measured",
    "auto@0.35: predicted step within 15% of measured",
)


def acceptance(out: dict) -> list[dict]:
    """Each target of :data:`TARGETS` judged from the measurements: ``ok`` True (pass), False
    (fail) or None (not judged: a mode did not run, or no device peak), and the figures."""
    modes = out["modes"]

    def ran(m):
        r = modes.get(m)
        return r if r is not None and "not_run" not in r else None

    def peak(m):
        r = ran(m)
        return None if r is None else r.get("activation_peak")

    def line(what, ok, detail):
        return {"target": what, "ok": ok, "detail": detail}

    def ratio(a, b, limit, what):
        ra, rb = ran(a), ran(b)
        if ra is None or rb is None:
            return line(what, None, f"{a if ra is None else b} did not run")
        x = ra["step_seconds"] / rb["step_seconds"]
        return line(what, x <= limit, f"{x:.3f}x {b}")

    got = []
    d, s = ran("tba"), ran("save_on_cpu")
    if d is None or s is None:
        got.append(line(TARGETS[0], None, f"{'tba' if d is None else 'save_on_cpu'} did not run"))
    else:
        x = d["step_ratio"]
        pd, ps = peak("tba"), peak("save_on_cpu")
        if pd is None or ps is None:
            got.append(line(TARGETS[0], None, f"{x:.3f}x none; no device peak"))
        else:
            detail = f"{x:.3f}x none; peak {pd / 2**30:.2f} vs {ps / 2**30:.2f} GiB"
            got.append(line(TARGETS[0], x <= 1.05 and pd < ps, detail))
    got.append(ratio("recompute", "checkpoint", 1.00, TARGETS[1]))
    got.append(ratio("auto@0.5", "none", 1.10, TARGETS[2]))
    got.append(ratio("auto@0.35", "checkpoint", 1.00, TARGETS[3]))
    for peer, what in (("save_on_cpu", TARGETS[4]), ("torchtune", TARGETS[5])):
        rp = ran(peer)
        if rp is None:
            why = modes.get(peer, {}).get("not_run", "not in --modes")
            got.append(line(what, None, f"{peer} not run: {why}"))
            continue
        pp = peak(peer)
        if pp is None:
            got.append(line(what, None, "no device peak"))
            continue
        better = [
            (m, modes[m]["step_seconds"])
            for m in TBA_MODES
            if ran(m) and peak(m) is not None and peak(m) <= pp
        ]
        faster = [(m, t) for m, t in better if t < rp["step_seconds"]]
        if faster:
            m, t = min(faster, key=lambda mt: mt[1])
            got.append(line(what, True, f"{m}: {t / rp['step_seconds']:.3f}x {peer}'s step"))
        else:
            got.append(
                line(what, False, f"none of {', '.join(m for m, _ in better) or 'no tba mode'}")
            )
    for m, what in (("auto@0.5", TARGETS[6]), ("auto@0.35", TARGETS[7])):
        r = ran(m)
        if r is None or "prediction_error" not in r:
            got.append(line(what, None, f"{m}: no prediction" if r else f"{m} did not run"))
            continue
        e = r["prediction_error"]
        detail = (
            f"predicted {r['predicted_step_seconds']:.3f} s, measured {r['step_seconds']:.3f} s"
        )
        got.append(line(what, abs(e) <= 0.15, f"{detail} ({e:+.0%})"))
    return got


def summary(out: dict, targets: bool = True) -> str:
    gib, mib = 1 << 30, 1 << 20
    m = out["model"]
    base = out.get("budget_base", {})
    lines = [
        f"{out['device']}, torch {out['torch']} (CUDA {out['cuda']}), backend {out['backend']}",
        f"model: {m['params'] / 1e9:.2f} B params, {m['layers']} layers, hidden {m['hidden']}, "
        f"seq {m['seq']} x batch {m['batch']}, {m['dtype']}"
        + (" (dry run: tiny model)" if out["dry"] else "")
        + f"; {out['warmup']} warm-up steps, median of {out['steps']} interleaved rounds",
        f"auto's budgets: shares of {base.get('activation_peak', 0) / mib:.1f} MiB "
        f"({base.get('from', '?')})",
        f"{'mode':<11} {'step s':>7} {'x none':>7} {'act peak GiB':>13} {'x none':>7} "
        f"{'out MiB':>8} {'back MiB':>8} {'stall s':>8}  exact  decided",
    ]
    for name, r in out["modes"].items():
        if "not_run" in r:
            lines.append(f"{name:<11} not run: {r['not_run']}")
            continue
        act = r.get("activation_peak")
        row = (
            f"{name:<11} {r['step_seconds']:>7.3f} {r['step_ratio']:>7.2f} "
            + (f"{act / gib:>13.2f} " if act is not None else f"{'n/a':>13} ")
            + (f"{r['peak_ratio']:>7.3f}" if r.get("peak_ratio") else f"{'':>7}")
        )
        ex = {True: "yes", False: "NO", None: "n/a"}[r["bit_exact"]]
        if "decided" in r:
            row += (
                f" {r['bytes_offloaded'] / mib:>8.1f} {r['bytes_reloaded'] / mib:>8.1f} "
                f"{r['stall_seconds']:>8.3f}  {ex:<5}  {r['decided']}"
            )
        elif name != "none":
            row += f" {'':>8} {'':>8} {'':>8}  {ex:<5}  {r.get('note', '')}"
        lines.append(row)
    ex = out["exactness"]
    if ex.get("deterministic_control") is None:
        lines.append(f"exactness not checkable: {ex.get('error', 'no result')}")
    elif not ex["deterministic_control"]:
        lines.append(
            "exactness not checkable: no tba differs from itself even with deterministic algorithms"
        )
    else:
        lines.append(
            "exact: losses and gradients bit-identical to no tba under "
            "deterministic algorithms (control: no tba twice, identical)"
        )
    if targets:
        dry = " (dry run: a tiny model on the CPU, not the targets' workload)" if out["dry"] else ""
        lines.append(f"targets (issue 40){dry}:")
        for t in out.get("acceptance", []):
            lines.append(f"  {VERDICT[t['ok']]}  {t['target']}: {t['detail']}")
    return "\n".join(lines)


VERDICT = {True: "pass", False: "FAIL", None: "n/a "}


if __name__ == "__main__":
    main()
