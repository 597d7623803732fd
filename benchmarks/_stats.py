"""How far a benchmark's headline ratio moves with this machine's noise."""

from __future__ import annotations

import math
import random
import statistics


def ratio_interval(pairs, rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentiles of median(x) / median(base) over ``rounds`` resamples of the
    (base, x) pairs (one pair per interleaved round), drawn with replacement: how far the
    headline ratio moves with the machine's noise (a step's time here varies by 10% or more
    with identical work)."""
    rng = random.Random(seed)
    got = []
    for _ in range(rounds):
        draw = [rng.choice(pairs) for _ in pairs]
        got.append(statistics.median(x for _, x in draw) / statistics.median(b for b, _ in draw))
    got.sort()
    return got[int(0.05 * rounds)], got[int(0.95 * rounds) - 1]


def paired_ratio(pairs) -> tuple[float, float]:
    """The geometric mean of x / base over the (base, x) pairs, and its standard error as a
    share (0.02: ±2%; 0.0 with fewer than two pairs). Each pair's drift cancels in its own
    ratio, so this resolves a small difference with fewer rounds than a ratio of medians, at the
    price of feeling an outlying round more."""
    logs = [math.log(x / b) for b, x in pairs]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(statistics.fmean(logs)), se
