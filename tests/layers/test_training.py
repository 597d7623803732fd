"""A W1-shaped model converted with each option trains like the stock one (20 Adam steps).

Model: pre-LN causal transformer, 2 blocks, H=64, 4 heads, S=32, batch 4, GELU (or SiLU) MLP,
explicit-math attention. Task: continue arithmetic progressions mod 64 (learnable in context).
Tolerances on the final loss against stock, same init and data:
  * exact options (TempoGELU, TempoLayerNorm, fused attention without dropout): 1e-3;
  * options that change the gradient (ReGELU2, ReSiLU2), the parameterization (MS norms: the
    optimizer then trains W diag(gamma) instead of W and gamma), or the dropout masks (fused
    attention with p > 0): 0.1, about 4% of the final loss (observed gaps: 0.02 to 0.05).
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import tba.layers as L

from ._support import TinyGPT

STEPS = 20


def batch(step: int):
    gen = torch.Generator().manual_seed(step % 4)
    start = torch.randint(0, 64, (4, 1), generator=gen)
    stride = torch.randint(1, 8, (4, 1), generator=gen)
    seq = (start + stride * torch.arange(33)) % 64
    return seq[:, :-1], seq[:, 1:]


def base_model(p: float, act: str) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(p=p, act=act)


def train(model: TinyGPT) -> list[float]:
    torch.manual_seed(1)  # same dropout RNG stream for every run
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.cache
def stock_losses(p: float, act: str) -> tuple[float, ...]:
    return tuple(train(base_model(p, act)))


CONFIGS = [
    # (id, dropout p, activation, convert kwargs, fused attention, tolerance)
    ("tempo-gelu", 0.0, "gelu", {"gelu": "tempo"}, False, 1e-3),
    ("tempo-norm", 0.0, "gelu", {"norm": "tempo"}, False, 1e-3),
    ("fused-attention", 0.0, "gelu", {}, True, 1e-3),
    ("all-exact", 0.0, "gelu", {"gelu": "tempo", "norm": "tempo"}, True, 1e-3),
    ("regelu2", 0.0, "gelu", {"gelu": "regelu2"}, False, 0.1),
    ("resilu2", 0.0, "silu", {"silu": "resilu2"}, False, 0.1),
    ("ms-norm", 0.0, "gelu", {"norm": "ms"}, False, 0.1),
    ("fused-dropout", 0.1, "gelu", {}, True, 0.1),
    ("all-lean-dropout", 0.1, "gelu", {"gelu": "tempo", "norm": "ms"}, True, 0.1),
    ("approx-lean-dropout", 0.1, "silu", {"silu": "resilu2", "norm": "ms"}, True, 0.15),
]


@pytest.mark.parametrize(
    ("p", "act", "options", "fused", "tol"), [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS]
)
def test_converted_model_trains_like_stock(p, act, options, fused, tol):
    model = copy.deepcopy(base_model(p, act))
    report = L.convert(model, **options)
    assert report.total > 0 or not options
    for block in model.blocks:
        block.attn.fused = fused
    losses = train(model)
    stock = stock_losses(p, act)
    assert losses[-1] < 0.7 * losses[0]  # it learns
    assert sum(losses[-5:]) < sum(losses[:5])
    assert abs(losses[-1] - stock[-1]) <= tol, (losses[-1], stock[-1])
