"""Exactness: after 3 AdamW steps, a relay's parameters and losses equal plain gradient
accumulation over the same U micro-batches on the same model, bit for bit (fp32, CPU).

U is 4 (batch 8) in most modes and 3 (batch 12) in two: with a power of two only, a wrong
scaling such as ``out * (1 / U)`` for ``out / U`` would give the same bits and pass."""

from __future__ import annotations

import pytest
import torch

from tba.relay import _eps

from .conftest import (
    TINY,
    gpt_loss,
    plain_accumulation,
    relay_run,
    same_params,
    token_batches,
    twin,
)

MODES = {
    "host-memory": dict(eps="host", stash="memory"),
    "host-memory-serial": dict(eps="host", stash="memory", overlap=False),
    "host-memory-workers": dict(eps="host", stash="memory", workers=True),
    "host-graph": dict(eps="host", recompute=False),
    "ssd-ssd": dict(eps="ssd", stash="ssd"),
    "ssd-ssd-workers-ahead2": dict(
        eps="ssd", stash="ssd", workers=True, read_ahead=2, max_pending_updates=1
    ),
    "host-graph-workers": dict(eps="host", recompute=False, workers=True),
    "ssd-graph-serial": dict(eps="ssd", recompute=False, overlap=False),
    "host-memory-U3": dict(eps="host", stash="memory", U=3),
    "ssd-ssd-U3": dict(eps="ssd", stash="ssd", U=3),
    # the host EPS as it runs on a CUDA device: one flat buffer per layer, masters its views
    "host-flat": dict(eps="host", stash="memory", flat=True),
    "host-flat-graph-workers": dict(eps="host", recompute=False, workers=True, flat=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_gpt_matches_plain_accumulation(mode, storage, monkeypatch):
    cfg = dict(MODES[mode])
    U = cfg.pop("U", 4)
    monkeypatch.setattr(_eps.HostEPS, "flat_on_cpu", cfg.pop("flat", False))
    plain, model = twin()
    batches = token_batches(TINY.vocab, TINY.seq, 2 * U, steps=3)
    want = plain_accumulation(plain, batches, U, gpt_loss)
    got, relay = relay_run(model, batches, U, storage=storage, **cfg)
    assert [g.item() for g in got] == [w.item() for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert same_params(plain, model) == []
