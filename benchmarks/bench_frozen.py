"""What recognising frozen weights' casts costs at pack (rule 5 of NOTE [Weight-derived tensors]).

    python benchmarks/bench_frozen.py [--repeats 20]

For each weight shape: ``cast`` is what autocast itself pays for the bf16 copy (``W.to``);
``match`` what pack adds the first time that copy is saved (sampled elements, then the full
bitwise comparison, and the recipe); ``again`` a second save of the same copy (remembered);
``lookalike`` a tensor of the same shape and dtype whose sampled elements differ. ``precheck``
is the test every other saved tensor without grad_fn pays while a model with frozen
parameters runs (a storage size looked up in a set), on a tensor that is not a candidate.
Medians, one thread. Not collected by pytest.
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

from tba.datapath.capture.derived import FrozenCasts  # noqa: E402

SHAPES = [(1024, 1024), (2816, 1024), (32000, 1024)]


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def first_save(frozen: FrozenCasts, model: nn.Module, t: torch.Tensor) -> float:
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
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_line("."))
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


if __name__ == "__main__":
    raise SystemExit(main())
