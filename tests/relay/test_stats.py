"""What a step moves and holds: weight traffic (2x the parameter bytes per step, whatever U),
optimizer state and stash traffic on the SSD tiers, and the tracked working bytes."""

from __future__ import annotations

import pytest
import torch

from tba.relay import Relay, RelayConfig, layers_of
from tba.testing import GPT, GPTConfig

from .conftest import TINY, adamw, token_batches

BATCH = 8


def run(cfg: GPTConfig, U: int, storage, steps: int = 2, **mode) -> tuple[Relay, list[dict]]:
    torch.manual_seed(0)
    relay = Relay(
        layers_of(GPT(cfg)),
        optimizer=adamw,
        micro_batches=U,
        config=RelayConfig(**mode),
        storage=storage,
    )
    stats = []
    for x, y in token_batches(cfg.vocab, cfg.seq, BATCH, steps):
        relay.step(x, y)
        stats.append(relay.stats())
    return relay, stats


@pytest.mark.parametrize(
    "mode", [dict(eps="host"), dict(eps="ssd", stash="ssd")], ids=["host", "ssd"]
)
@pytest.mark.parametrize("U", [1, 2, 4])
def test_weight_traffic_is_twice_the_parameters_whatever_u(U, mode, storage):
    relay, stats = run(TINY, U, storage, **mode)
    layers = len(relay.modules)
    params = sum(p.numel() * p.element_size() for p in GPT(TINY).parameters())
    assert relay.param_bytes == params
    for st in stats:
        assert st["weight_bytes_moved"] == 2 * params
        assert st["fetches"] == 2 * layers
        assert st["grad_bytes_moved"] == params  # every parameter trains
        assert st["updates"] == layers
    relay.close()


def test_ssd_tier_moves_state_and_writes_back(storage):
    relay, (first, second) = run(TINY, 2, storage, eps="ssd", stash="ssd")
    params = relay.param_bytes
    assert first["state_bytes_read"] == 0  # AdamW has no state before its first step
    assert second["state_bytes_read"] == 2 * params  # exp_avg and exp_avg_sq
    for st in (first, second):
        assert st["state_bytes_written"] == 2 * params
        assert st["weight_bytes_written"] == params
    relay.close()


@pytest.mark.parametrize("stash", ["memory", "ssd"])
def test_stash_holds_each_block_input_once(stash, storage):
    relay, (st, _) = run(TINY, 4, storage, stash=stash)
    # inputs of layers 1..L-1 (3 blocks and the head), each BATCH x seq x hidden fp32
    want = (len(relay.modules) - 1) * BATCH * TINY.seq * TINY.hidden * 4
    assert st["stash_bytes"] == want
    if stash == "ssd":
        assert st["stash_bytes_written"] == st["stash_bytes_read"] == want
        assert st["stash_sync_reads"] == 0  # every read was issued a layer ahead
    else:
        assert st["stash_bytes_written"] == 0
    assert st["working_bytes"] == 0  # nothing held between steps
    relay.close()


def test_graph_mode_counts_saved_activations(storage):
    relay, (st, _) = run(TINY, 2, storage, recompute=False)
    assert st["stash"] == "graph" and st["stash_bytes"] > 0
    assert st["peak_working_by_kind"]["stash"] > 0
    assert st["working_bytes"] == 0
    relay.close()


def test_tracked_working_bytes_do_not_grow_with_depth(storage):
    """NOTE [Working bytes]: with both SSD tiers the relay holds a few layers' weights and
    optimizer state and a window of stashed inputs, at any depth. Without overlap nothing
    depends on thread timing, so the peaks are equal to the byte (with overlap they vary within
    a bound set by read_ahead and max_pending_updates; peak RSS by depth: bench_relay.py)."""
    peaks, grows = {}, {}
    for depth in (4, 8, 16):
        cfg = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=depth)
        relay, stats = run(cfg, 2, storage, steps=2, eps="ssd", stash="ssd", overlap=False)
        peaks[depth] = max(s["peak_working_bytes"] for s in stats)
        relay.close()
        relay, stats = run(cfg, 2, storage, steps=1, eps="host", stash="memory", overlap=False)
        grows[depth] = stats[-1]["peak_working_bytes"]
        relay.close()
    assert peaks[4] == peaks[8] == peaks[16], peaks
    assert grows[4] < grows[8] < grows[16], grows  # the memory stash grows with depth


def test_overlap_off_reports_no_update_wait_of_its_own(storage):
    relay, (st, _) = run(TINY, 2, storage, overlap=False)
    assert st["overlap"] is False and st["updates"] == len(relay.modules)
    assert st["update_seconds"] > 0
    relay.close()
