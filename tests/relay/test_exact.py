"""Exactness: after 3 AdamW steps, a relay's parameters and losses equal plain gradient
accumulation over the same U micro-batches on the same model, bit for bit (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from .conftest import (
    TINY,
    gpt_loss,
    plain_accumulation,
    relay_run,
    same_params,
    token_batches,
    twin,
)

U = 4

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
}


@pytest.mark.parametrize("mode", list(MODES))
def test_gpt_matches_plain_accumulation(mode, storage):
    plain, model = twin()
    batches = token_batches(TINY.vocab, TINY.seq, 8, steps=3)
    want = plain_accumulation(plain, batches, U, gpt_loss)
    got, relay = relay_run(model, batches, U, storage=storage, **MODES[mode])
    assert [g.item() for g in got] == [w.item() for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert same_params(plain, model) == []
