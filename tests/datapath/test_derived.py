"""Weight-derived saved tensors (NOTE [Weight-derived tensors] in tba/datapath/capture/derived.py):
recognised at pack, rebuilt from the parameter at unpack, never written; gradients bit-identical to
stock PyTorch under the same autocast; in-place edits of the parameter or of the cast raise."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tba
from tba.datapath.capture.derived import Derived, derived
from tba.testing import GPT, W1, GPTConfig, random_batch

from .._scan import WriteScanner

BF16 = torch.bfloat16


def offloader(tmp_path, **cfg):
    base = dict(spill_dir=str(tmp_path), backend="memory", min_offload_bytes=1, keep_last=0)
    base.update(cfg)
    return tba.Offloader(tba.Config(environ={}, **base))


def weight_casts(model: nn.Module) -> list[torch.Tensor]:
    """The bf16 casts autocast makes of the weights of every Linear (what it saves)."""
    return [m.weight.detach().to(BF16) for m in model.modules() if isinstance(m, nn.Linear)]


def step(model, batch, off=None, autocast=True, retain=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        if off is None:
            loss = model(*batch)
        else:
            with off.step(model):
                loss = model(*batch)
    if off is not None:
        off.synchronize()  # every write landed: backward reads back from the backend
    loss.backward(retain_graph=retain)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the acceptance run: autocast bf16 W1 ---------------------------------------------------------
@pytest.mark.slow  # bf16 matmuls take a fallback path on CPUs without bf16 units
def test_autocast_w1_writes_no_weight_cast_and_gradients_are_bit_identical(tmp_path):
    """W1's blocks (6, H=512) under bf16 autocast, with few tokens (bf16 matmuls are slow on
    the CPU; the weight casts do not depend on the batch). With the rule off, every weight
    cast is found in what was written: the scanner sees them, and the rule is what removes
    them. With it on, none is, and bytes written fall by at least their bytes."""
    torch.manual_seed(0)
    model = GPT(W1)
    x, y = random_batch(W1, 1)
    batch = (x[:, :8], y[:, :8])
    casts = weight_casts(model)
    cast_bytes = sum(c.numel() * c.element_size() for c in casts)
    assert len(casts) == 6 * 4 + 1 and cast_bytes == 38_010_880  # 6 x (qkv, proj, fc1, fc2), head
    loss0, grads0 = step(model, batch)
    runs = {}
    for on in (False, True):
        with offloader(tmp_path / str(on), recompute_weights=on) as off:
            scan = WriteScanner(off, casts)
            loss, grads = step(model, batch, off)
            runs[on] = scan, off.stats()
        assert torch.equal(loss, loss0) and same(grads, grads0)
    (scan_off, st_off), (scan_on, st_on) = runs[False], runs[True]
    assert len(scan_off.found) == len(casts), "the scanner finds what today's code writes"
    assert scan_on.found == set() and scan_on.writes > 0
    assert st_on["bytes_offloaded"] <= st_off["bytes_offloaded"] - cast_bytes
    assert st_on["recomputed_tensors"] == len(casts) and st_on["recomputed_bytes"] == cast_bytes
    assert st_off["recomputed_tensors"] == 0
    for st in (st_on, st_off):  # NOTE [Counted once]: each pack in exactly one outcome
        ends = st["tensors_offloaded"] + st["tensors_kept"] + st["dedup_hits"]
        assert ends + st["recomputed_tensors"] == st["packs"], st
    assert st_on["saved_bytes"] == st_off["saved_bytes"]  # the casts still count as saved


def test_fp32_saves_parameter_views_only_and_recomputes_nothing(tmp_path):
    """Without autocast a Linear saves ``W.t()``, a view of the parameter: excluded as a
    parameter (never counted), so there is nothing to recompute."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2))
    batch = random_batch(model.cfg, 2)
    loss0, grads0 = step(model, batch, autocast=False)
    with offloader(tmp_path) as off:
        loss, grads = step(model, batch, off, autocast=False)
        st = off.stats()
    assert torch.equal(loss, loss0) and same(grads, grads0)
    assert st["recomputed_tensors"] == 0 and st["packs"] > 0


# -- guards -------------------------------------------------------------------------------------
def test_a_parameter_edited_in_place_before_backward_raises_the_in_place_error(tmp_path):
    """The error autograd gives when a parameter it saved was edited (fp32, where Linear saves
    ``W.t()``), now also under autocast, where the cast is rebuilt from that parameter."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1))
    batch = random_batch(model.cfg, 2)
    fc2 = model.blocks[0].fc2.weight
    core = r"modified by an inplace operation: .*is at version {}; expected version {} instead"

    def forward_then_edit(off, autocast):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            if off is None:
                loss = model(*batch)
            else:
                with off.step(model):
                    loss = model(*batch)
        v = fc2._version
        with torch.no_grad():
            fc2.add_(1.0)  # e.g. optimizer.step() before backward
        return loss, core.format(v + 1, v)

    loss, stock = forward_then_edit(None, autocast=False)
    with pytest.raises(RuntimeError, match=stock):
        loss.backward()
    with offloader(tmp_path) as off:
        loss, want = forward_then_edit(off, autocast=True)
        assert off.stats()["recomputed_tensors"] > 0
        with pytest.raises(tba.UnpackError, match=want) as err:
            loss.backward()
    assert "a parameter of shape [64, 256]" in str(err.value)
    assert "TBA_RECOMPUTE_WEIGHTS=0" in str(err.value)


def test_a_saved_cast_edited_in_place_raises_like_stock_pytorch(tmp_path):
    w = nn.Parameter(torch.randn(32, 16))
    x = torch.randn(4, 32, requires_grad=True)

    def run(hooks):
        with hooks:
            cast = w.to(BF16)
            out = (x.to(BF16) @ cast).sum()
        with torch.no_grad():
            cast.mul_(2)
        out.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(torch.enable_grad())  # stock
    with offloader(tmp_path) as off, pytest.raises(tba.UnpackError, match="inplace operation"):
        run(off.step())
    assert off.stats()["recomputed_tensors"] >= 1


def test_a_replaced_parameter_storage_raises_naming_the_switch(tmp_path):
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with offloader(tmp_path) as off:
        with torch.autocast("cpu", dtype=BF16), off.step():
            out = lin(x).float().sum()
        lin.weight.data = lin.weight.data.clone()  # no version bump, another storage
        with pytest.raises(tba.UnpackError, match="TBA_RECOMPUTE_WEIGHTS=0"):
            out.backward()


# -- which tensors qualify ----------------------------------------------------------------------
def test_frozen_parameters_casts_are_recognised_by_value_not_by_the_graph(tmp_path):
    """A frozen weight's cast has no grad_fn: rules 1 to 3 cannot see it, rule 5 recognises it
    by its values (tests/datapath/test_frozen_casts.py has the details); with the rule off
    (TBA_RECOMPUTE_WEIGHTS=0) it is written as before, gradients exact either way."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=128))
    for b in model.blocks:
        b.fc1.weight.requires_grad_(False)
    batch = random_batch(model.cfg, 2)
    frozen = [b.fc1.weight.detach().to(BF16) for b in model.blocks]
    loss0, grads0 = step(model, batch)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    for on in (True, False):
        with offloader(tmp_path / str(on), recompute_weights=on) as off:
            scan = WriteScanner(off, frozen)
            loss, grads = step(model, batch, off)
            st = off.stats()
        assert torch.equal(loss, loss0) and same(grads, grads0)
        assert scan.found == (set() if on else {0, 1})
        assert st["recomputed_tensors"] == (linears if on else 0)


def test_tied_weights_are_recomputed_from_the_shared_parameter(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1, tied=True))
    batch = random_batch(model.cfg, 2)
    loss0, grads0 = step(model, batch)
    with offloader(tmp_path) as off:
        scan = WriteScanner(off, [model.tok.weight.detach().to(BF16)])
        loss, grads = step(model, batch, off)
        st = off.stats()
    assert torch.equal(loss, loss0) and same(grads, grads0)
    assert scan.found == set() and st["recomputed_tensors"] == 5  # qkv, proj, fc1, fc2, head


class Views(nn.Module):
    """Weight-derived tensors made through views before and after one copy, and through two
    copies (not recognised: only one copy is rebuilt, NOTE [Weight-derived tensors] rule 1)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 32))
        self.v = nn.Parameter(torch.randn(4, 8, 32))

    def forward(self, x):
        w = self.w
        outs = [
            F.linear(x, w[:16]),  # autocast: Slice -> ToCopy
            F.linear(x, self.v.view(32, 32)),  # autocast: View -> ToCopy
            F.linear(x, w.select(0, 3).unsqueeze(0).expand(8, 32)),  # Select, Unsqueeze, Expand
            F.linear(x, w.view(2, 24, 32).flatten(0, 1)[:16]),  # View, View, Slice -> ToCopy
            x @ w.t().contiguous()[:, 8:40],  # T -> Clone, then a slice of it (fp32)
            x @ w.transpose(0, 1).permute(1, 0).t().contiguous(),  # three views -> Clone (fp32)
            x @ w.t().contiguous().to(torch.float16).float(),  # three copies: never rebuilt
        ]
        return sum(o.float().sum() for o in outs)


@pytest.mark.parametrize("autocast", [True, False])
def test_views_around_the_copy_rebuild_the_same_bits(tmp_path, autocast):
    torch.manual_seed(0)
    model = Views()
    x = torch.randn(6, 32, requires_grad=True)

    def run(off):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            if off is None:
                loss = model(x)
            else:
                with off.step(model):
                    loss = model(x)
        if off is not None:
            off.synchronize()
        loss.backward(retain_graph=True)
        loss.backward()  # every recompute runs twice
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return loss.detach(), {**grads, "x": x.grad.clone()}

    loss0, grads0 = run(None)
    with offloader(tmp_path) as off:
        loss, grads = run(off)
        st = off.stats()
    assert torch.equal(loss, loss0) and same(grads, grads0)
    # autocast: the four casts of parameter views (the matmuls' casts of copies are two
    # copies); fp32: the two contiguous copies. The casts of x (not a parameter) never.
    assert st["recomputed_tensors"] == (4 if autocast else 2), st


def test_only_parameter_derived_copies_qualify():
    p = nn.Parameter(torch.randn(8, 8))
    leaf = torch.randn(8, 8, requires_grad=True)  # an input, not a parameter
    act = torch.sin(p)
    assert isinstance(derived(p.to(BF16), frozenset()), Derived)
    assert isinstance(derived(p.to(BF16).t(), frozenset()), Derived)
    assert derived(leaf.to(BF16), frozenset()) is None
    assert isinstance(derived(leaf.to(BF16), frozenset({leaf.untyped_storage()._cdata})), Derived)
    assert derived(act.to(BF16), frozenset()) is None  # computed, not a parameter
    assert derived((p * 2).to(BF16), frozenset()) is None
    assert derived(p.detach().to(BF16), frozenset()) is None  # no graph link
    cast = p.to(BF16)
    with torch.no_grad():
        cast.add_(1)  # modified before it was saved: its bytes are no cast of p
    assert derived(cast, frozenset()) is None
    edited = p.to(BF16)
    edited.mul_(2)  # under grad mode: its grad_fn is MulBackward0 now
    assert derived(edited, frozenset()) is None


def test_switched_off_by_the_variable(tmp_path):
    cfg = tba.Config(spill_dir=str(tmp_path), environ={"TBA_RECOMPUTE_WEIGHTS": "0"})
    assert cfg.recompute_weights is False and cfg.sources["recompute_weights"] == "env"
    lin = nn.Linear(64, 64)
    with offloader(tmp_path, recompute_weights=False) as off:
        with torch.autocast("cpu", dtype=BF16), off.step():
            out = lin(torch.randn(4, 64, requires_grad=True)).float().sum()
        off.synchronize()
        out.backward()
        st = off.stats()
    assert st["recomputed_tensors"] == 0 and st["tensors_offloaded"] >= 1


def test_gradient_accumulation_keeps_each_graph_exact(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1))
    batches = [random_batch(model.cfg, 2, seed=s) for s in (0, 1)]

    def run(off):
        model.zero_grad(set_to_none=True)
        losses = []
        for b in batches:  # two graphs alive, then both backwards
            with torch.autocast("cpu", dtype=BF16):
                if off is None:
                    losses.append(model(*b))
                else:
                    with off.step(model):
                        losses.append(model(*b))
        for loss in reversed(losses):
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = run(None)
    with offloader(tmp_path) as off:
        assert same(run(off), want)


def test_double_backward_through_a_recomputed_cast_is_exact(tmp_path):
    """create_graph=True: autograd gives the rebuilt cast its graph back (a gradient penalty)."""
    torch.manual_seed(0)
    lin, head = nn.Linear(32, 32), nn.Linear(32, 1)
    x = torch.randn(4, 32, requires_grad=True)

    def run(off):
        for t in (*lin.parameters(), *head.parameters(), x):
            t.grad = None
        with torch.autocast("cpu", dtype=BF16), off.step() if off else torch.enable_grad():
            out = head(torch.tanh(lin(x))).float().sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        (g.float().pow(2).sum() + out).backward()
        return [t.grad.clone() for t in (lin.weight, head.weight, x)]

    want = run(None)
    with offloader(tmp_path) as off:
        got = run(off)
        assert off.stats()["recomputed_tensors"] == 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))
