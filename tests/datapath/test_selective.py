"""The selective block action (NOTE [Selective recompute] in tba/datapath/blocks/selective.py): what
it keeps, that its recompute takes it, that it stays exact where it cannot, and that its bytes
count."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tba.datapath.blocks.selective as selective
from tba.datapath.blocks.selective import _has_dropout, kept_by_selective
from tba.decide.block_policy import PolicyController
from tba.decide.cadence import Cadence
from tba.decide.chooser import Cost, choose, predict
from tba.testing import GPT, GPTConfig, random_batch

from .._core import FakeClock

SDPA = GPTConfig(vocab=64, seq=32, hidden=32, heads=4, layers=3)  # fused attention, no dropout
DROPOUT = GPTConfig(vocab=64, seq=32, hidden=32, heads=4, layers=3, dropout=0.1)
MiB = 1 << 20


@pytest.fixture
def instances(monkeypatch):
    """Every Selective made while the test runs."""
    made = []
    real = selective.Selective.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(selective.Selective, "__init__", init)
    return made


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def reference(cfg, seed=0, retain=False):
    torch.manual_seed(0)
    model = GPT(cfg)
    twin = copy.deepcopy(model)
    torch.manual_seed(seed)
    loss = model(*random_batch(cfg, 4))
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    return twin, grads(model)


@pytest.mark.parametrize("cfg", [SDPA, DROPOUT], ids=["sdpa", "dropout"])
def test_selective_is_exact_and_takes_what_it_kept(make_offloader, instances, cfg):
    twin, want = reference(cfg)
    off = make_offloader(policy="selective")
    torch.manual_seed(0)
    with off.step(twin):
        loss = twin(*random_batch(cfg, 4))
    loss.backward()
    got = grads(twin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(instances) == cfg.layers
    assert all(s.taken > 0 for s in instances)  # the recompute took the kept products
    recs = [r for r in off._last.group_records() if r["action"]]
    assert all(0 < r["cached_bytes"] < r["hidden_bytes"] for r in recs)
    # what the pack-time probe predicts is what selective kept, less the small outputs that
    # have no autograd history (fused attention's logsumexp)
    assert all(
        r["cacheable_bytes"] <= r["cached_bytes"] <= 1.05 * r["cacheable_bytes"] for r in recs
    )


def test_selective_kept_bytes_count_until_the_recompute(make_offloader):
    """Kept products are resident from the forward to the block's recompute: in
    peak_resident_bytes, and released afterwards (nothing stays charged)."""
    peaks = {}
    for policy in ("recompute", "selective"):
        torch.manual_seed(0)
        model = GPT(SDPA)
        off = make_offloader(policy=policy)
        with off.step(model):
            loss = model(*random_batch(SDPA, 4))
        recs = off._last.group_records()
        cached = sum(r["cached_bytes"] for r in recs)
        kept = sum(r["kept_bytes"] for r in recs)  # the blocks' inputs and what tba kept
        # at the end of the forward, before any recompute, all of it is counted at once (plus
        # writes still in flight); backward's peak depends on when autograd frees a recomputed
        # block's saves (under a loaded machine recompute's peak was 33 KiB over ``kept``)
        at_forward_end = off.stats()["resident_bytes"]
        assert at_forward_end >= kept + cached
        loss.backward()
        off.synchronize()
        st = off.stats()
        peaks[policy] = st["peak_resident_bytes"]
        assert peaks[policy] >= at_forward_end
        assert (cached > 0) == (policy == "selective")
        assert st["resident_bytes"] == 0


def test_retain_graph_recomputes_twice(make_offloader):
    twin, want = reference(SDPA, retain=True)
    off = make_offloader(policy="selective")
    torch.manual_seed(0)
    with off.step(twin):
        loss = twin(*random_batch(SDPA, 4))
    loss.backward(retain_graph=True)
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(twin), want))


class Mutating(nn.Module):
    """A block that changes a matrix product in place after computing it: the kept output
    no longer holds what the product was, so the recompute must compute it again."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        y = self.a(x)
        y.mul_(2)
        return self.b(torch.tanh(y))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Mutating() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().sum()


def test_a_product_changed_in_place_is_computed_again(make_offloader, instances):
    torch.manual_seed(0)
    model = Stack()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16)
    model(x).backward()
    off = make_offloader(block_policy="selective,selective")
    with off.step(twin):
        loss = twin(x)
    loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    assert all(s.computed > 0 for s in instances)


def test_fused_attention_with_dropout_is_never_kept():
    q = torch.randn(1, 2, 4, 8)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert _has_dropout(op, (q, q, q, 0.1), {})
    assert not _has_dropout(op, (q, q, q, 0.0), {})
    assert not _has_dropout(op, (q, q, q), {})
    assert _has_dropout(op, (q, q, q), {"dropout_p": 0.2})
    assert not _has_dropout(torch.ops.aten.mm.default, (q, q), {})


def test_the_probe_sees_products_through_views():
    lin = nn.Linear(8, 24)
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = lin(x)
    q, k, v = y.split(8, dim=-1)
    assert kept_by_selective(q.view(2, 5, 2, 4).transpose(1, 2))
    assert not kept_by_selective(torch.nn.functional.gelu(y))
    assert not kept_by_selective(x)


def block_costs(cached, full=0.13, part=0.02):
    """W1-like: embedding group, 6 blocks of 128 MiB with 8 MiB inputs, selective keeping
    ``cached`` of them."""
    gs = [Cost(0.01, 0.02, 8 * MiB, block=False)]
    for _ in range(6):
        gs.append(
            Cost(
                0.19,
                0.38,
                128 * MiB,
                8 * MiB,
                recompute=full,
                cached_bytes=cached,
                selective_recompute=part,
            )
        )
        gs.append(Cost(0.001, 0.001, 0, block=False))
    return gs


def test_chooser_offers_selective_only_where_it_knows_what_it_keeps():
    slow = 5e6  # nothing is worth writing
    budget = int(0.35 * sum(g.nbytes for g in block_costs(64 * MiB)))
    unknown = choose(block_costs(None), slow, slow, budget)
    assert "selective" not in unknown.best.actions
    known = choose(block_costs(64 * MiB), slow, slow, budget)
    assert "selective" in known.best.actions and known.fits
    assert known.best.step_seconds < unknown.best.step_seconds
    # the kept products count from the forward: one more selective block breaks the budget
    gs = block_costs(64 * MiB)
    acts = list(known.best.actions)
    more = next(i for i, a in enumerate(acts) if a == "recompute")
    acts[more] = "selective"
    assert predict(gs, acts, slow, slow, 128 * MiB).peak_bytes > budget


def records(actions, cacheable=64 * MiB, cached=64 * MiB, again=None):
    """group_records() of a W1-like step (block groups only matter here)."""
    out = [dict(action="", saved_bytes=8 * MiB, hidden_bytes=0, input_bytes=0)]
    for a in actions:
        rec = a in ("recompute", "selective")
        x = dict(
            action=a,
            saved_bytes=8 * MiB if rec else 128 * MiB,
            hidden_bytes=120 * MiB if rec else 0,
            input_bytes=8 * MiB,
            cacheable_bytes=cacheable,
            cached_bytes=cached if a == "selective" else 0,
            bwd_seconds=0.38 + ((again or 0.19) if rec else 0.0),
        )
        if rec and again is not None:
            x["recompute_seconds"] = again
        out += [x, dict(action="", saved_bytes=0, hidden_bytes=0, input_bytes=0)]
    for x in out:
        x.setdefault("bwd_seconds", 0.001)
        x.update(fwd_seconds=0.19 if x["action"] else 0.001, stall_seconds=0.0)
    return out


def test_controller_prior_then_measured_selective():
    """NOTE [Selective recompute cost]: before a block runs selective it is charged a prior
    from what the probe saw; the first measurement replaces it and decides again."""
    ctl = PolicyController("auto", None, every=50, cadence=Cadence(FakeClock()))
    groups = [g for g in ctl._costs(records(["recompute"] * 6, again=0.13))[0] if g.block]
    assert all(g.cached_bytes == 64 * MiB for g in groups)
    # the prior: the full recompute, less the share of the block's saves selective keeps
    assert groups[0].selective_recompute == pytest.approx(0.13 * (1 - 64 / 120))
    ctl.learned = False
    groups = [
        g for g in ctl._costs(records(["selective"] * 6, cached=60 * MiB, again=0.02))[0] if g.block
    ]
    assert ctl.learned
    assert all(g.cached_bytes == 60 * MiB for g in groups)
    assert all(g.selective_recompute == pytest.approx(0.02) for g in groups)
    assert all(g.recompute == pytest.approx(0.13) for g in groups)  # the full one stays


def test_policy_and_block_policy_accept_selective(make_offloader):
    off = make_offloader(block_policy="selective,offload")
    assert dict(off.config.block_policy) == {0: "selective", 1: "offload"}
    assert make_offloader(policy="selective").policy.default_action() == "selective"
