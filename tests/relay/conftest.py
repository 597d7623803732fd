"""Shared helpers: tiny models, plain gradient accumulation as the reference, relay runs."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import tba
from tba.relay import Relay, RelayConfig, layers_of
from tba.testing import GPT, GPTConfig

TINY = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=3)
LR = 1e-2


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def token_batches(vocab: int, seq: int, batch: int, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(vocab, (batch, seq), generator=g),
            torch.randint(vocab, (batch, seq), generator=g),
        )
        for _ in range(steps)
    ]


def total(losses: list[torch.Tensor]) -> torch.Tensor:
    """The relay's loss: the scaled micro-batch losses added in micro-batch order."""
    return functools.reduce(lambda a, b: a + b, losses)


def plain_accumulation(model, batches, U: int, loss_of, optimizer=adamw) -> list[torch.Tensor]:
    """The reference: ``(loss(micro-batch) / U).backward()`` for each micro-batch, then one
    optimizer step over the whole model. Returns the losses, summed as the relay sums them."""
    opt = optimizer(list(model.parameters()))
    out = []
    for x, y in batches:
        parts = []
        for xu, yu in zip(x.chunk(U), y.chunk(U)):
            loss = loss_of(model, xu, yu) / U
            loss.backward()
            parts.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total(parts))
    return out


def gpt_loss(model, x, y):
    return model(x, y)


@pytest.fixture
def storage(tmp_path):
    """A tba.Config for SSD tiers on a per-test spill dir, isolated from TBA_* variables."""
    return tba.Config(
        spill_dir=str(tmp_path / "spill"),
        slab_bytes="16MiB",
        min_free_bytes=0,
        staging_bytes="4MiB",
        environ={},
    )


def relay_run(model, batches, U, storage=None, optimizer=adamw, layers=None, **cfg):
    """Train ``model`` through a Relay; returns (losses, relay) with the relay closed and the
    weights restored into ``model``."""
    relay = Relay(
        layers if layers is not None else layers_of(model),
        optimizer=optimizer,
        micro_batches=U,
        config=RelayConfig(**cfg),
        storage=storage,
    )
    losses = [relay.step(x, y) for x, y in batches]
    relay.close(restore=True)
    return losses, relay


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the parameters that differ (bitwise)."""
    pb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p.detach(), pb[n].detach())]


def twin(cfg: GPTConfig = TINY, seed: int = 0):
    torch.manual_seed(seed)
    m = GPT(cfg)
    return m, copy.deepcopy(m)
