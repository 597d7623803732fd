"""Blocks tba keeps whole run without its hooks once measured (NOTE [Kept blocks without hooks]
in tba/datapath/blocks/kept.py): the same counts, the same gradients, and tba's hooks back on
autograd's stack whatever the block does."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

from tba.datapath.blocks import kept as kept_blocks
from tba.testing import GPT, GPTConfig, random_batch

CFG = GPTConfig(vocab=64, seq=32, hidden=32, heads=4, layers=3, dropout=0.0)
COUNTS = ("packs", "tensors_kept", "kept_fast", "kept_reasons", "dedup_hits", "saved_bytes")
COUNTS += ("peak_resident_bytes", "groups", "tensors_offloaded")
RECORD = ("tensors", "packed_bytes", "saved_bytes", "sizes", "kept_bytes", "keepable_bytes")


def _depth() -> int:
    """How many saved-tensor hooks are on autograd's stack (popped, counted, pushed back)."""
    got = []
    while (top := kept_blocks.top_hooks(False)) is not None:
        got.append(top)
        kept_blocks._pop()
    for top in reversed(got):
        kept_blocks._push(*top)
    return len(got)


def _steps(off, model, x, n):
    """``n`` steps of ``model`` on ``x``, forward under tba, backward after."""
    for _ in range(n):
        with off.step(model):
            loss = model(x)
        loss.backward()


def _train(off, model, steps, batch=4):
    out = []
    for s in range(steps):
        model.zero_grad(set_to_none=True)
        with off.step(model) if off is not None else torch.enable_grad():
            loss = model(*random_batch(CFG, batch, seed=s))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if off is None:
            out.append((loss.detach(), grads, None, None))
            continue
        off.synchronize()  # writes counted once they end (NOTE [Counted once])
        st = off.stats()
        recs = [{k: r[k] for k in RECORD} for r in off._last.group_records()]
        out.append((loss.detach(), grads, {k: st[k] for k in COUNTS}, (recs, st)))
    return out


@pytest.mark.parametrize(
    "cfg",
    [{"policy": "keep"}, {"keep_last": 2}, {"min_offload_bytes": "1MiB"}, {"policy": "recompute"}],
    ids=["keep", "keep_last", "all_small", "recompute"],
)
def test_credited_steps_count_and_compute_what_measured_steps_do(make_offloader, cfg):
    torch.manual_seed(0)
    model = GPT(CFG)
    base = _train(None, model, 4)
    off = make_offloader(**cfg)
    got = _train(off, model, 4)
    first = got[0][2]
    for s, ((loss, grads, _, _), (tloss, tgrads, counts, (recs, st))) in enumerate(zip(base, got)):
        assert torch.equal(loss, tloss)
        assert all(torch.equal(a, b) for a, b in zip(grads, tgrads))
        if counts["tensors_offloaded"]:
            del counts["peak_resident_bytes"]
        assert counts == {k: first[k] for k in counts}, f"step {s}"
        assert recs == got[0][3][0], f"step {s}"
        assert (st["kept_credited"] > 0) == (s > 0)
        assert st["resident_bytes"] == 0  # every credit's charge ended with its backward
    blocks = off.stats()["group_policy"]
    credited = got[-1][3][1]["kept_credited"]
    assert 0 < credited < got[-1][3][1]["packs"]  # the embedding took the hooks
    assert blocks.count("keep") >= 2 or "min_offload_bytes" in cfg or "policy" in cfg


@pytest.mark.parametrize("where", ["block", "head"])
def test_a_block_or_head_that_raises_leaves_the_hooks_in_place(make_offloader, where):
    """A credited block that raises never reaches its exit hook, and a credited head raises
    before the step's end: the step's end puts tba's hooks back before popping them, so
    autograd's stack is as before the step, and the next steps are credited as before."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="keep")
    _train(off, model, 2)

    def fail(module, args):
        raise RuntimeError("boom")

    inside = model.blocks[1].fc2 if where == "block" else model.head
    h = inside.register_forward_pre_hook(fail)
    depth = _depth()
    try:  # not pytest.raises: its record of the traceback would hold the graph
        with off.step(model):
            model(*random_batch(CFG, 4, seed=5))
    except RuntimeError as e:
        assert str(e) == "boom"
    else:
        raise AssertionError("the block did not raise")
    h.remove()
    assert _depth() == depth
    again = _train(off, model, 2)
    assert again[-1][3][1]["kept_credited"] > 0
    gc.collect()
    assert off.stats()["resident_bytes"] == 0


def test_users_hooks_inside_the_step_take_the_blocks_tensors(make_offloader):
    """A user's saved-tensor hooks opened inside the step are innermost: their pack sees the
    block's tensors, and tba credits nothing for that step."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="keep")
    _train(off, model, 2)
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    with off.step(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*random_batch(CFG, 4, seed=1))
    loss.backward()
    assert seen and off.stats()["kept_credited"] == 0 and off.stats()["packs"] == 0


def test_hooks_below_tbas_leave_every_block_to_tba(make_offloader):
    """With a user's hooks opened around the step, popping tba's would hand the blocks'
    tensors to them: nothing is credited, tba packs every block, as when measuring."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="keep")
    measured = _train(off, model, 1)[0][3][1]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        got = _train(off, model, 2)
    for *_, (_, st) in got:
        assert st["kept_credited"] == 0 and st["packs"] == measured["packs"]


def test_a_graph_dropped_without_backward_ends_its_charge(make_offloader):
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="keep")
    _train(off, model, 2)
    with off.step(model):
        loss = model(*random_batch(CFG, 4, seed=1))
    st = off.stats()
    assert st["kept_credited"] > 0 and st["resident_bytes"] == st["peak_resident_bytes"] > 0
    del loss
    gc.collect()
    assert off.stats()["resident_bytes"] == 0


def test_measured_again_after_remeasure_credits_and_on_a_new_signature(make_offloader, monkeypatch):
    monkeypatch.setattr(kept_blocks, "REMEASURE", 2)
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="keep")
    credited = [r[3][1]["kept_credited"] for r in _train(off, model, 5)]
    assert credited[0] == 0 and credited[1] == credited[2] > 0
    assert credited[3] == 0 and credited[4] == credited[1]  # measured again, then credited
    longer = _train(off, model, 1, batch=6)[0][3][1]
    assert longer["kept_credited"] == 0  # a new signature: measured first
    assert longer["saved_bytes"] > _train(off, model, 1)[0][3][1]["saved_bytes"]


def test_in_place_edit_of_a_tensor_a_credited_block_saved_raises(make_offloader):
    """Autograd checks the versions of what it saves itself, as tba does of what it keeps."""

    class Edits(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x, edit=False):
            for b in self.blocks:
                x = torch.sigmoid(b(x))  # sigmoid saves its output
            if edit:
                x.mul_(2)  # the last block's saved output, modified
            return x.sum()

    torch.manual_seed(0)
    model = Edits()
    off = make_offloader(policy="keep")
    x = torch.randn(4, 8, requires_grad=True)
    _steps(off, model, x, 2)
    with off.step(model):
        loss = model(x, edit=True)
    assert off.stats()["kept_credited"] > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_retain_graph_and_a_second_backward(make_offloader):
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = [p.detach().clone() for p in model.parameters()]
    off = make_offloader(policy="keep")
    _train(off, model, 2)
    batch = random_batch(CFG, 4, seed=3)
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward(retain_graph=True)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with off.step(model):
        loss = model(*batch)
    assert off.stats()["kept_credited"] > 0
    loss.backward(retain_graph=True)
    loss.backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref))


def test_no_credit_while_a_chooser_measures_or_a_trace_records(make_offloader, tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    for cfg in ({"policy": "auto"}, {"policy": "keep", "trace": str(tmp_path / "t.jsonl")}):
        off = make_offloader(**cfg)
        assert all(r[3][1]["kept_credited"] == 0 for r in _train(off, model, 3))


class _Stack(nn.Module):
    def __init__(self, width, lead=True):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8 if i == 0 else width, width), nn.Tanh()) for i in range(3)
        )
        self.out = nn.Linear(width, 8)
        self.lead = lead  # an op before the blocks: the first block's input has a grad_fn

    def forward(self, x):
        if self.lead:
            x = x * 2
        for b in self.blocks:
            x = b(x)
        return self.out(x).sum()


def test_two_models_taking_turns_keep_their_own_measurements(make_offloader):
    """Measurements belong to the block module: two models of one Offloader, alternating (their
    first blocks on the same signature), each count what a measured step of their own counts."""
    torch.manual_seed(0)
    models = [_Stack(8), _Stack(16)]
    off = make_offloader(policy="keep")
    x = torch.randn(4, 8, requires_grad=True)
    first: dict[int, dict] = {}
    for s in range(6):
        m = models[s % 2]
        with off.step(m):
            loss = m(x)
        loss.backward()
        st = off.stats()
        got = {k: st[k] for k in ("packs", "saved_bytes", "tensors_kept", "peak_resident_bytes")}
        got["sizes"] = off._last.group_records()[1]["sizes"]  # the first block's
        assert first.setdefault(s % 2, got) == got
        assert (st["kept_credited"] >= 3) == (s >= 2)


def test_no_hook_piles_up_on_a_leaf_input(make_offloader):
    """The first block fed a leaf directly is not credited: a hook on the leaf's gradient would
    stay on it for good, one more each step."""
    torch.manual_seed(0)
    model = _Stack(8, lead=False)
    off = make_offloader(policy="keep")
    x = torch.randn(4, 8, requires_grad=True)
    _steps(off, model, x, 3)
    assert off.stats()["kept_credited"] > 0  # the other blocks are
    assert not x._backward_hooks
