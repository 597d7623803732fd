"""What recognising frozen weights' casts costs at pack (rule 5 of NOTE [Weight-derived tensors]).

    python benchmarks/bench_frozen.py [--repeats 20]

For each weight shape: ``cast`` is what autocast itself pays for the bf16 copy (``W.to``);
``match`` what pack adds the first time that copy is saved (sampled elements, then the full
bitwise comparison, and the recipe); ``again`` a second save of the same copy (remembered);
``lookalike`` a tensor of the same shape and dtype whose sampled elements differ. ``precheck``
is the test every other saved tensor without grad_fn pays while a model with frozen
parameters runs (a storage size looked up in a set), on a tensor that is not a candidate.
Medians, one thread. ``--opcodes`` instead counts the Python bytecodes one pack hook call
executes (deterministic, so comparable between trees on a busy machine: it needs only
``tba.Offloader``), for tensors that require grad and for saved tensors without grad_fn (a
mask), with and without frozen parameters in the step's model. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _machine import machine_line  # noqa: E402
from torch import nn  # noqa: E402

import tba  # noqa: E402
from tba.datapath import hook  # noqa: E402

SHAPES = [(1024, 1024), (2816, 1024), (32000, 1024)]


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def first_save(frozen, model: nn.Module, t: torch.Tensor) -> float:
    """Microseconds to pack ``t`` with nothing remembered about it."""
    frozen.end()
    frozen.begin(model, frozenset())
    storage = t.untyped_storage()
    t0 = time.perf_counter()
    frozen.derived(t, storage)
    return (time.perf_counter() - t0) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--opcodes", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_line("."))
    if args.opcodes:
        return opcodes()
    from tba.datapath.capture.derived import FrozenCasts

    model = nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in SHAPES).requires_grad_(False)
    frozen = FrozenCasts()
    print(f"{'weight':<14}{'cast us':>10}{'match us':>10}{'again us':>10}{'lookalike us':>14}")
    for layer in model:
        w = layer.weight
        cast = w.detach().to(torch.bfloat16)
        other = torch.randn(w.shape).to(torch.bfloat16)
        t_cast = median_us(lambda w=w: w.to(torch.bfloat16), args.repeats)
        t_match = [first_save(frozen, model, cast) for _ in range(args.repeats)]
        storage = cast.untyped_storage()
        assert frozen.derived(cast, storage) is not None
        t_again = median_us(lambda c=cast, s=storage: frozen.derived(c, s), args.repeats)
        t_look = [first_save(frozen, model, other) for _ in range(args.repeats)]
        shape = "x".join(map(str, w.shape))
        row = f"{shape:<14}{t_cast:>10.0f}{statistics.median(t_match):>10.0f}"
        print(row + f"{t_again:>10.1f}{statistics.median(t_look):>14.1f}")
    frozen.begin(model, frozenset())
    plain = torch.randn(4096)
    storage = plain.untyped_storage()
    sizes = frozen.sizes
    grad = plain.requires_grad
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        _ = not grad and sizes and storage.nbytes() in sizes
    t1 = time.perf_counter()
    for _ in range(n):
        _ = grad
    t2 = time.perf_counter()
    per, loop = (t1 - t0) / n * 1e9, (t2 - t1) / n * 1e9
    print(f"precheck on a tensor that is not a candidate: {per - loop:.0f} ns (loop removed)")
    return 0


def opcodes() -> int:
    count, active = [0], [False]

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode" and active[0]:
            count[0] += 1
        return tracer

    real = hook.OffloadHooks.pack

    def pack(self, x):
        active[0] = True
        try:
            return real(self, x)
        finally:
            active[0] = False

    hook.OffloadHooks.pack = pack
    x = torch.randn(16384, requires_grad=True)
    masks = [torch.rand(16384) for _ in range(50)]
    frozen = nn.Linear(8, 8).requires_grad_(False)
    print(f"{'policy':<9}{'model':<8}{'saved':<6}{'opcodes/pack':>13}")
    for policy in ("keep", "offload"):
        for model in (None, frozen):
            for kind in ("grad", "mask"):
                cfg = tba.Config(
                    spill_dir=".", backend="memory", policy=policy, min_offload_bytes=1,
                    keep_last=0, environ={},
                )  # fmt: skip
                with tba.Offloader(cfg) as off:
                    count[0] = 0
                    sys.settrace(tracer)
                    with off.step(model):
                        h = x
                        for m in masks:
                            h = torch.sin(h) if kind == "grad" else h * m
                    sys.settrace(None)
                    packs = off.stats()["packs"]
                    h.sum().backward()
                name = "none" if model is None else "frozen"
                print(f"{policy:<9}{name:<8}{kind:<6}{count[0] / packs:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
