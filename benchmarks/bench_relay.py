"""L2L relay (tba.relay) against plain gradient accumulation: step time, memory by depth, and a
model larger than a memory cap.

    python benchmarks/bench_relay.py speed  [--repeats 5] [--micro-batch 8]   # W1, U=4
    python benchmarks/bench_relay.py memory [--depths 4,8,16] [--micro-batch 2]
    python benchmarks/bench_relay.py capped [--cap 640MiB] [--hidden 512] [--blocks auto]
    python benchmarks/bench_relay.py all    # the three, in that order; --json out.json

speed: the 6 blocks of W1 (tba.testing.GPT(W1): H=512, 8 heads, S=512, fp32) with U=4
micro-batches of ``--micro-batch`` sequences. One step of each mode in turn per round (disk
and CPU speed drift over minutes), medians over the rounds and per-round paired ratios against
"plain": ``(model(x_u, y_u) / 4).backward()`` for each micro-batch, then one AdamW step. Relay
modes (``--modes``): recompute (L2L: host EPS, layer inputs stashed in memory, recomputed in the
backward) and graph (each layer's autograd graph kept, no recompute), each also with
``workers=True`` (optimizer steps and weight copies on worker threads, overlapping compute); and
ssd (both SSD tiers, recompute) with overlap on and off (SSD reads ahead, or not).

memory: a child process per run (LD_PRELOAD of tcmalloc when installed, as docs/planning.md, "Memory
the process gives back", advises; in a memory cgroup of its own without a cap, when one can be made,
see bench_headroom.py), W1-sized blocks at each depth, U=4 micro-batches of ``--micro-batch``,
2 steps. Plain accumulation against the relay with eps="ssd", stash="ssd" (layers built one at a
time: the relay process never holds the whole model). Peak RSS (VmHWM), the RSS after
imports (the baseline), the cgroup's peak charge, and the relay's tracked peak_working_bytes.

capped: the relay (eps="ssd") on ``--blocks`` blocks of W1's shape with hidden size ``--hidden``
(default "auto": the fewest whose fp32 weights plus AdamW state are at least 2.1 times
``--cap``), in a child whose cgroup has memory.max (v1: limit_in_bytes)
= cap and no swap; 3 AdamW steps. Then plain accumulation of the same model (same per-layer
seeds, same batches) in an uncapped child. Losses and a SHA-256 of every layer's final
parameters must be equal. Needs a usable memory cgroup (else it says so and stops).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
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
TAG = "RELAY_RESULT "
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


# -- models shared by the children --------------------------------------------------------------
def layer_builders(depth: int, hidden: int, seq: int, heads: int, vocab: int):
    """Functions that build embed, ``depth`` W1-style blocks and the head, each from a seed of
    its own index, so that a relay (one layer at a time) and a plain model get the same init."""
    import torch
    import torch.nn as nn

    from tba.testing import Block, GPTConfig

    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=depth)

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)
            self.pos = nn.Embedding(seq, hidden)

        def forward(self, idx):
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_f = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, x):
            return self.head(self.ln_f(x))

    def make(i: int):
        torch.manual_seed(1000 + i)
        if i == 0:
            return Embed()
        return Head() if i == depth + 1 else Block(cfg)

    return [lambda i=i: make(i) for i in range(depth + 2)]


def cross_entropy(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(vocab: int, seq: int, batch: int, steps: int):
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(vocab, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rss_now() -> int:
    return _status_bytes("VmRSS")


def _rss_peak() -> int:
    """This process's own peak RSS. Not ru_maxrss: Linux carries that over fork and exec, so a
    child of a large parent reports the parent's peak."""
    return _status_bytes("VmHWM")


def child_main(spec: dict) -> int:
    """One run: plain accumulation or the relay; prints one result line."""
    import torch

    import tba
    from tba.relay import Layers, Relay, RelayConfig

    out: dict = {"spec": spec, "rss_after_imports": _rss_now()}
    builders = layer_builders(spec["depth"], spec["hidden"], spec["seq"], spec["heads"], 256)
    U, steps = spec["U"], spec["steps"]
    data = batches(256, spec["seq"], spec["micro"] * U, steps)
    losses, times = [], []
    if spec["what"] == "plain":
        layers = torch.nn.ModuleList(b() for b in builders)
        opt = torch.optim.AdamW(layers.parameters(), lr=1e-3)
        for x, y in data:
            t0 = time.perf_counter()
            total = None
            for xu, yu in zip(x.chunk(U), y.chunk(U)):
                h = xu
                for m in layers:
                    h = m(h)
                loss = cross_entropy(h, yu) / U
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(total.item())
        values = [[p.detach() for p in m.parameters()] for m in layers]
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in layers.parameters())
    else:
        storage = tba.Config(spill_dir=spec["spill"], slab_bytes="256MiB", environ={})
        relay = Relay(
            Layers(builders, cross_entropy),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            micro_batches=U,
            config=RelayConfig(
                eps=spec["eps"], stash=spec["stash"], max_pending_updates=spec.get("pending", 2)
            ),
            storage=storage,
        )
        for x, y in data:
            t0 = time.perf_counter()
            losses.append(relay.step(x, y).item())
            times.append(time.perf_counter() - t0)
        st = relay.stats()
        out["param_bytes"] = relay.param_bytes
        keys = ("peak_working_bytes", "eps_disk_bytes", "param_bytes", "backend")
        out["relay"] = {k: st[k] for k in keys}
        out["relay"]["peak_working_by_kind"] = st["peak_working_by_kind"]
        if spec.get("hash"):  # one layer in memory at a time: the model may exceed the cap
            out["sha256"] = [_digest(relay.parameters_of(i).values()) for i in range(len(builders))]
        relay.close(restore=False)
    out["peak_rss"] = _rss_peak()
    out["losses"] = [float(v).hex() for v in losses]
    out["step_seconds"] = times
    if spec.get("hash") and spec["what"] == "plain":
        out["sha256"] = [_digest(vs) for vs in values]
    print(TAG + json.dumps(out), flush=True)
    return 0


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


# -- running children in memory cgroups (bench_headroom's mechanism) -----------------------------
def run_child(spec: dict, cap, env: dict) -> dict:
    """Run one child in its own cgroup; its result, the cgroup's peak charge and the peak of
    its anonymous memory (sampled every 50 ms: the charge also counts shared-library pages
    that whichever process first read them pays for, which varies from run to run)."""
    argv = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)]
    peaks: dict[str, int] = {}
    with cap.group() as g:
        proc = subprocess.Popen(
            cap.wrap(argv, g), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        stop = threading.Event()

        def watch():
            while not stop.wait(0.05):
                for k, v in cap.stat(g).items():
                    peaks[k] = max(peaks.get(k, 0), v)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        stdout, stderr = proc.communicate()
        stop.set()
        w.join()
        info = cap.read(g)
    rec = {"returncode": proc.returncode, **info, "peak_anon_bytes": peaks.get("anon")}
    for line in stdout.splitlines():
        if line.startswith(TAG):
            rec.update(json.loads(line[len(TAG) :]))
    if proc.returncode != 0:
        rec["stderr_tail"] = stderr.strip().splitlines()[-5:]
    return rec


def child_env(tcmalloc: bool) -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if tcmalloc and os.path.exists(TCMALLOC):
        env["LD_PRELOAD"] = TCMALLOC
    return env


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.0f}"


# -- speed ---------------------------------------------------------------------------------------
SPEED_MODES = {
    "recompute": dict(recompute=True),
    "recompute, workers": dict(recompute=True, workers=True),
    "graph": dict(recompute=False),
    "graph, workers": dict(recompute=False, workers=True),
    "ssd": dict(recompute=True, eps="ssd", stash="ssd"),
    "ssd, no overlap": dict(recompute=True, eps="ssd", stash="ssd", overlap=False),
}
# What overlap saves: (mode with it, the same mode without it)
OVERLAPS = {
    "optimizer steps on a worker (recompute)": ("recompute, workers", "recompute"),
    "optimizer steps on a worker (graph)": ("graph, workers", "graph"),
    "SSD reads ahead": ("ssd", "ssd, no overlap"),
}


def speed(args) -> dict:
    import copy

    import torch

    import tba
    from tba.relay import Relay, RelayConfig, layers_of
    from tba.testing import GPT, W1, random_batch

    U = 4
    torch.manual_seed(0)
    base = GPT(W1)
    x, y = random_batch(W1, args.micro_batch * U)
    plain = copy.deepcopy(base)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    spill = tempfile.mkdtemp(prefix="tba-relay-", dir=args.spill_dir)
    storage = tba.Config(spill_dir=spill)
    chosen = [m for m in args.modes.split(",") if m] if args.modes else list(SPEED_MODES)
    relays = {
        name: Relay(
            layers_of(copy.deepcopy(base)),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
            micro_batches=U,
            config=RelayConfig(**SPEED_MODES[name]),
            storage=storage,
        )
        for name in chosen
    }
    del base

    def plain_step() -> float:
        total = None
        for xu, yu in zip(x.chunk(U), y.chunk(U)):
            loss = plain(xu, yu) / U
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()

    modes = ["plain", *relays]
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}  # user+system seconds, all threads
    losses: dict[str, list[float]] = {m: [] for m in modes}
    stats: dict[str, list[dict]] = {m: [] for m in relays}
    for r in range(args.warmup + args.repeats):
        for m in modes:
            c0, t0 = _cpu_seconds(), time.perf_counter()
            loss = plain_step() if m == "plain" else relays[m].step(x, y).item()
            dt, dc = time.perf_counter() - t0, _cpu_seconds() - c0
            losses[m].append(loss)
            if r >= args.warmup:
                times[m].append(dt)
                cpu[m].append(dc)
                if m != "plain":
                    stats[m].append(relays[m].stats())
            print(f"  round {r} {m:<22} {dt:7.2f} s  (cpu {dc:6.2f} s)", flush=True)
    for relay in relays.values():
        relay.close(restore=False)
    with contextlib.suppress(OSError):
        os.rmdir(spill)
    med = {m: statistics.median(v) for m, v in times.items()}
    med_cpu = {m: statistics.median(v) for m, v in cpu.items()}
    res: dict = {
        "median_cpu_seconds": med_cpu,
        "cpu_over_plain": {m: med_cpu[m] / med_cpu["plain"] for m in relays},
        "rounds": {"wall": times, "cpu": cpu},
        "workload": f"W1 blocks (6), U={U} micro-batches of {args.micro_batch}",
        "median_seconds": med,
        "over_plain": {m: med[m] / med["plain"] for m in relays},
        "over_plain_paired": {
            m: statistics.median(a / b for a, b in zip(times[m], times["plain"])) for m in relays
        },
        "losses_equal_plain": {m: losses[m] == losses["plain"] for m in relays},
        "overlap_saves": {
            what: 1 - med[on] / med[off]
            for what, (on, off) in OVERLAPS.items()
            if on in med and off in med
        },
        "overlap_saves_paired": {
            what: 1 - statistics.median(a / b for a, b in zip(times[on], times[off]))
            for what, (on, off) in OVERLAPS.items()
            if on in med and off in med
        },
        "stalls": {
            m: {
                k: statistics.median(s[k] for s in stats[m])
                for k in ("fetch_wait_seconds", "update_wait_seconds", "update_seconds")
            }
            for m in relays
        },
        "peak_working_bytes": {m: max(s["peak_working_bytes"] for s in stats[m]) for m in relays},
    }
    print()
    print(f"{res['workload']}, {args.repeats} interleaved rounds (+{args.warmup} warm-up)")
    print(
        f"{'mode':<24}{'median (s)':>11}{'/ plain':>9}{'paired':>8}{'cpu / plain':>12}"
        "  loss = plain, stalls (s)"
    )
    for m in modes:
        if m == "plain":
            print(f"{m:<24}{med[m]:>11.2f}{1:>9.3f}{1:>8.3f}{1:>12.3f}")
            continue
        s = res["stalls"][m]
        print(
            f"{m:<24}{med[m]:>11.2f}{res['over_plain'][m]:>9.3f}"
            f"{res['over_plain_paired'][m]:>8.3f}{res['cpu_over_plain'][m]:>12.3f}"
            f"  {res['losses_equal_plain'][m]}, fetch "
            f"{s['fetch_wait_seconds']:.3f}, update wait {s['update_wait_seconds']:.3f} "
            f"(optimizer {s['update_seconds']:.3f})"
        )
    for what, saved in res["overlap_saves"].items():
        paired = res["overlap_saves_paired"][what]
        print(f"{what}: saves {saved * 100:.1f}% of the step (paired {paired * 100:.1f}%)")
    return res


# -- memory by depth -----------------------------------------------------------------------------
def memory(args, cap_factory) -> dict:
    cap, notes = cap_factory(None)
    env = child_env(tcmalloc=True)
    spill = tempfile.mkdtemp(prefix="tba-relay-", dir=args.spill_dir)
    rows = []
    try:
        for depth in args.depths:
            for what in ("plain", "relay"):
                spec = dict(
                    what=what,
                    depth=depth,
                    hidden=512,
                    seq=512,
                    heads=8,
                    micro=args.micro_batch,
                    U=4,
                    steps=2,
                    spill=spill,
                    eps="ssd",
                    stash="ssd",
                )
                rec = run_child(spec, cap, env)
                rows.append(rec)
                print(
                    f"  depth {depth:>2} {what:<5} exit {rec['returncode']}, peak RSS "
                    f"{_mib(rec.get('peak_rss'))} MiB, charged "
                    f"{_mib(rec.get('peak_charged_bytes'))} MiB",
                    flush=True,
                )
    finally:
        cap.close()
        with contextlib.suppress(OSError):
            os.rmdir(spill)
    res: dict = {
        "mechanism": cap.describe(),
        "mechanisms_not_used": notes,
        "allocator": "tcmalloc (LD_PRELOAD)" if "LD_PRELOAD" in env else "glibc (no tcmalloc)",
        "runs": rows,
    }
    print()
    print(
        f"W1-sized blocks, U=4 micro-batches of {args.micro_batch}, 2 AdamW steps; "
        f"{res['allocator']}; {cap.describe()}"
    )
    print(
        f"{'depth':>5} {'mode':<6}{'peak RSS':>10}{'baseline':>10}{'peak-base':>10}"
        f"{'anon':>7}{'charged':>9}{'tracked':>9}  (MiB)"
    )
    for r in rows:
        work = r["peak_rss"] - r["rss_after_imports"] if "peak_rss" in r else None
        tracked = (r.get("relay") or {}).get("peak_working_bytes")
        print(
            f"{r['spec']['depth']:>5} {r['spec']['what']:<6}{_mib(r.get('peak_rss')):>10}"
            f"{_mib(r.get('rss_after_imports')):>10}{_mib(work):>10}"
            f"{_mib(r.get('peak_anon_bytes')):>7}{_mib(r.get('peak_charged_bytes')):>9}"
            f"{_mib(tracked):>9}"
        )
    for what in ("plain", "relay"):
        mine = [r for r in rows if r["spec"]["what"] == what and "peak_rss" in r]
        for key, label in (
            ("peak_rss", "peak RSS"),
            ("peak_anon_bytes", "peak anon (cgroup, sampled)"),
            ("peak_charged_bytes", "peak charged (cgroup)"),
        ):
            vals = [r[key] for r in mine if r.get(key)]
            if len(vals) == len(args.depths):
                spread = max(vals) / min(vals) - 1
                res.setdefault("spread", {})[f"{what} {label}"] = spread
                print(
                    f"{what} {label}: max/min - 1 over depths {args.depths} = {spread * 100:.1f}%"
                )
        work = [r["peak_rss"] - r["rss_after_imports"] for r in mine]
        if len(work) == len(args.depths):
            spread = max(work) / min(work) - 1
            res.setdefault("spread", {})[f"{what} peak-baseline"] = spread
            print(f"{what} peak RSS - baseline: max/min - 1 = {spread * 100:.1f}%")
    return res


# -- beyond the memory cap -----------------------------------------------------------------------
def capped(args, cap_factory) -> dict:
    from tba.config import parse_size

    cap_bytes = parse_size(args.cap)
    cap, notes = cap_factory(cap_bytes)
    if not cap.enforced:
        cap.close()
        print(f"capped: no memory cgroup can be made here ({'; '.join(notes)}); not run")
        return {"run": False, "why": notes}
    free, free_notes = cap_factory(None)
    h = args.hidden
    per_block = 4 * (12 * h * h + 13 * h)  # fp32 qkv, proj, fc1, fc2 with biases, 2 LayerNorms
    blocks = (
        int(args.blocks) if args.blocks != "auto" else -(-int(2.1 * cap_bytes / 3) // per_block)
    )
    env = child_env(tcmalloc=args.tcmalloc)
    spill = tempfile.mkdtemp(prefix="tba-relay-", dir=args.spill_dir)
    common = dict(
        depth=blocks,
        hidden=args.hidden,
        seq=args.seq,
        heads=8,
        micro=1,
        U=2,
        steps=3,
        hash=True,
        spill=spill,
        eps="ssd",
        stash="ssd",
        pending=args.pending,
    )
    try:
        relay = run_child({**common, "what": "relay"}, cap, env)
        plain = run_child({**common, "what": "plain"}, free, env)
    finally:
        cap.close()
        free.close()
        with contextlib.suppress(OSError):
            os.rmdir(spill)
    s = args.seq
    weights = plain.get("param_bytes") or 0  # counted, by the plain run (which always ends)
    res = {
        "cap_bytes": cap_bytes,
        "mechanism": cap.describe(),
        "weights_bytes": weights,
        "weights_and_adamw_bytes": 3 * weights,
        "over_cap": 3 * weights / cap_bytes,
        "relay": {
            k: relay.get(k)
            for k in (
                "returncode",
                "peak_charged_bytes",
                "oom_kills",
                "peak_rss",
                "step_seconds",
                "relay",
                "stderr_tail",
            )
        },
        "plain": {
            k: plain.get(k)
            for k in (
                "returncode",
                "peak_charged_bytes",
                "peak_rss",
                "step_seconds",
                "stderr_tail",
            )
        },
        "losses_equal": relay.get("losses") == plain.get("losses") and bool(relay.get("losses")),
        "params_equal": relay.get("sha256") == plain.get("sha256") and bool(relay.get("sha256")),
        "allocator": "tcmalloc (LD_PRELOAD)" if "LD_PRELOAD" in env else "glibc",
    }
    print()
    print(
        f"{blocks} blocks (H={args.hidden}) + embed + head, seq {s}, U=2 micro-batches of 1, "
        f"3 AdamW steps; {res['allocator']}"
    )
    print(
        f"fp32 weights {_mib(weights)} MiB; with AdamW state {_mib(3 * weights)} MiB = "
        f"{res['over_cap']:.2f}x the {args.cap} cap ({cap.describe()})"
    )
    r = res["relay"]
    print(
        f"relay (eps=ssd, stash=ssd), capped: exit {r['returncode']}, peak charged "
        f"{_mib(r['peak_charged_bytes'])} MiB, OOM kills {r['oom_kills']}, steps "
        + ", ".join(f"{t:.1f}" for t in r["step_seconds"] or [])
        + " s"
    )
    p = res["plain"]
    print(
        f"plain accumulation, uncapped: exit {p['returncode']}, peak charged "
        f"{_mib(p['peak_charged_bytes'])} MiB"
    )
    print(
        f"losses equal: {res['losses_equal']}; every layer's parameters equal (SHA-256): "
        f"{res['params_equal']}"
    )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=("speed", "memory", "capped", "all"))
    ap.add_argument("--repeats", type=int, default=5, help="speed: measured rounds")
    ap.add_argument("--warmup", type=int, default=1, help="speed: unmeasured rounds first")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch (speed: 8, W1's; memory: 2)",
    )
    ap.add_argument("--depths", default="4,8,16", help="memory: block counts")
    ap.add_argument("--modes", default="", help="speed: relay modes (default: all)")
    ap.add_argument("--cap", default="640MiB", help="capped: the memory cap")
    ap.add_argument("--hidden", type=int, default=512, help="capped: hidden size of the blocks")
    ap.add_argument("--blocks", default="auto", help="capped: block count, or auto")
    ap.add_argument("--seq", type=int, default=16, help="capped: sequence length")
    ap.add_argument("--pending", type=int, default=2, help="capped: max_pending_updates")
    ap.add_argument(
        "--tcmalloc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capped: LD_PRELOAD tcmalloc in the children (when installed)",
    )
    ap.add_argument("--spill-dir", default="/var/tmp", help="root of the spill dir (local disk)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        return child_main(json.loads(args._child))
    if args.what is None:
        ap.error("choose speed, memory, capped or all")
    args.depths = [int(d) for d in args.depths.split(",") if d]

    from _machine import machine_line
    from bench_headroom import open_cap

    def cap_factory(cap_bytes):
        return open_cap(cap_bytes, "auto")

    machine = machine_line(args.spill_dir)
    print(machine)
    res: dict = {"machine": machine}
    if args.what in ("speed", "all"):
        args.micro_batch = args.micro_batch or 8
        res["speed"] = speed(args)
        args.micro_batch = None
    if args.what in ("memory", "all"):
        args.micro_batch = args.micro_batch or 2
        res["memory"] = memory(args, cap_factory)
    if args.what in ("capped", "all"):
        res["capped"] = capped(args, cap_factory)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
