"""Casts of frozen parameters (rule 5 of NOTE [Weight-derived tensors] in
tba/datapath/capture/derived.py): recognised by value at pack, rebuilt from the parameter at
unpack, never written; anything that only looks like such a cast is written and comes back
exact; gradients bit-identical to stock PyTorch under the same autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tba
from tba.datapath.capture import derived as derived_mod
from tba.datapath.capture.derived import Derived, FrozenCasts

from .._scan import WriteScanner

BF16 = torch.bfloat16


class Net(nn.Module):
    """Trainable and frozen layers in a row: ``inp`` and ``out`` train, ``mid`` (a Linear:
    it saves ``W16.t()``), ``wide`` (no bias) and ``mix`` (a bare matrix: ``h @ M16`` saves
    the cast itself) are frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.mid = nn.Linear(256, 256)
        self.wide = nn.Linear(256, 512, bias=False)
        self.mix = nn.Parameter(torch.randn(512, 512) / 23)
        self.out = nn.Linear(512, 64)
        for p in (*self.mid.parameters(), self.wide.weight, self.mix):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.mid(h))
        h = torch.relu(self.wide(h)) @ self.mix
        return self.out(h).float().square().mean()


def frozen_weights(net: Net) -> list[torch.Tensor]:
    return [net.mid.weight, net.wide.weight, net.mix]


def offloader(tmp_path, **cfg):
    base = dict(spill_dir=str(tmp_path), backend="memory", min_offload_bytes=1, keep_last=0)
    base.update(cfg)
    return tba.Offloader(tba.Config(environ={}, **base))


def step(net, x, off=None, model=True, between=None):
    net.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16):
        if off is None:
            loss = net(x)
        else:
            with off.step(net if model else None):
                loss = net(x)
            off.synchronize()  # every write landed: backward reads back from the backend
    if between is not None:
        between()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def make():
    torch.manual_seed(0)
    return Net(), torch.randn(16, 64)


def test_frozen_casts_are_rebuilt_not_written_and_gradients_bit_identical(tmp_path):
    net, x = make()
    casts = [w.detach().to(BF16) for w in frozen_weights(net)]
    cast_bytes = sum(c.numel() * 2 for c in casts)
    loss0, grads0 = step(net, x)
    runs = {}
    for on in (False, True):
        with offloader(tmp_path / str(on), recompute_weights=on) as off:
            scan = WriteScanner(off, casts)
            loss, grads = step(net, x, off)
            runs[on] = scan, off.stats()
        assert torch.equal(loss, loss0) and same(grads, grads0)
    (scan_off, st_off), (scan_on, st_on) = runs[False], runs[True]
    assert scan_off.found == {0, 1, 2}, "the scanner finds them where the rule is off"
    assert scan_on.writes > 0 and scan_on.found == set()
    # the three frozen casts, and out's trainable one (rule 1); inp's is not saved (x has no grad)
    assert st_on["recomputed_tensors"] == 3 + 1
    assert st_on["recomputed_bytes"] == cast_bytes + 64 * 512 * 2
    assert st_on["bytes_offloaded"] <= st_off["bytes_offloaded"] - cast_bytes
    assert st_on["saved_bytes"] == st_off["saved_bytes"]  # still counted as saved, once
    ends = st_on["tensors_offloaded"] + st_on["tensors_kept"] + st_on["dedup_hits"]
    assert ends + st_on["recomputed_tensors"] == st_on["packs"]  # NOTE [Counted once]


def test_a_frozen_weight_edited_in_place_before_backward_raises_the_in_place_error(tmp_path):
    """As for a trainable weight (test_derived.py): stock fp32 autograd raises for the saved
    frozen parameter (``W.t()``); under autocast tba raises the same, where stock autocast
    would silently use the stale cast."""
    net, x = make()
    x.requires_grad_(True)  # so that mid, the first frozen layer, saves its weight in fp32 too
    w = net.mid.weight
    core = r"modified by an inplace operation: .*is at version {}; expected version {} instead"
    v = w._version

    def edit():
        with torch.no_grad():
            w.add_(1.0)  # e.g. an EMA update or a merge before backward

    net.zero_grad(set_to_none=True)
    loss = net(x)  # stock, fp32
    edit()
    with pytest.raises(RuntimeError, match=core.format(v + 1, v)):
        loss.backward()
    with offloader(tmp_path) as off:
        with pytest.raises(tba.UnpackError, match=core.format(v + 2, v + 1)) as err:
            step(net, x, off, between=edit)
        assert off.stats()["recomputed_tensors"] == 5  # inp's cast too: x needs its gradient
    assert "a parameter of shape [256, 256]" in str(err.value)


def saved_through(fake, x):
    return (x @ fake.t()).float().square().sum()  # saves fake.t()


@pytest.mark.parametrize("kind", ["one_element", "negative_zero", "unrelated"])
def test_a_lookalike_of_a_frozen_cast_is_written_and_comes_back_exact(tmp_path, kind):
    """Same shape, dtype and storage size as the cast, other bits: one element off where no
    sample looks (the full comparison rejects it), -0.0 for a 0.0 (equal as floats, not as
    bits), or other values altogether (the samples reject it)."""
    torch.manual_seed(0)
    holder = nn.Linear(256, 128, bias=False).requires_grad_(False)
    w = holder.weight
    with torch.no_grad():
        w[0, 1] = 0.0
    cast = w.detach().to(BF16)
    flat = torch.arange(cast.numel()).view_as(cast)
    at = flat == 1  # not one of the sampled elements
    samples = derived_mod._picks(cast.numel(), cast.device).tolist()
    assert 1 not in samples
    fake = {
        "one_element": torch.where(at, cast + 1, cast),
        "negative_zero": torch.where(at, torch.tensor(-0.0, dtype=BF16), cast),
        "unrelated": torch.randn(128, 256).to(BF16),
    }[kind]
    assert fake._version == 0 and fake.grad_fn is None
    assert not torch.equal(fake.view(torch.int16), cast.view(torch.int16))
    x0 = torch.randn(8, 256, dtype=BF16)

    def run(off):
        x = x0.clone().requires_grad_(True)
        if off is None:
            loss = saved_through(fake, x)
        else:
            with off.step(holder):
                loss = saved_through(fake, x)
            off.synchronize()
        loss.backward()
        return x.grad

    grad0 = run(None)
    with offloader(tmp_path) as off:
        scan = WriteScanner(off, [fake])
        grad = run(off)
        st = off.stats()
    assert torch.equal(grad, grad0)
    assert st["recomputed_tensors"] == 0 and scan.found == {0}


VIEWS = {
    "cast": lambda c: c,
    "t": lambda c: c.t(),
    "transpose": lambda c: c.transpose(0, 1),
    "view": lambda c: c.view(-1, 32),
    "reshape": lambda c: c.reshape(64, 2, -1),
    "slice": lambda c: c[3:, 5:],
    "unsqueeze": lambda c: c.unsqueeze(0),
}


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_view_of_a_frozen_cast_is_rebuilt_with_its_sizes_strides_and_offset(view):
    torch.manual_seed(0)
    holder = nn.Linear(64, 128).requires_grad_(False)
    frozen = FrozenCasts()
    frozen.begin(holder, frozenset())
    t = VIEWS[view](holder.weight.to(BF16))
    storage = t.untyped_storage()
    assert storage.nbytes() in frozen.sizes
    d = frozen.derived(t, storage)
    assert type(d) is Derived and d.nbytes == 64 * 128 * 2
    del t, storage  # the rebuild needs only the parameter
    out = d.rebuild()
    want = VIEWS[view](holder.weight.detach().to(BF16))
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert (out.shape, out.stride(), out.storage_offset()) == (
        want.shape,
        want.stride(),
        want.storage_offset(),
    )
    frozen.end()
    assert frozen.sizes == frozenset()


def test_what_is_not_a_plain_cast_is_not_recognised():
    """An edited cast (its version moved), a cast that requires grad (rule 1's business), one
    of a trainable parameter, a clone in the same dtype, a cast on part of a larger storage,
    the cast's values in another shape, and the cast viewed as another dtype."""
    torch.manual_seed(0)
    holder = nn.Linear(64, 128)
    holder.weight.requires_grad_(False)
    frozen = FrozenCasts()
    frozen.begin(holder, frozenset())
    w = holder.weight
    edited = w.to(BF16)
    edited.mul_(1)
    grown = torch.empty(2 * w.numel(), dtype=BF16)
    grown[: w.numel()] = w.detach().to(BF16).flatten()
    inside = grown[: w.numel()].view_as(w)
    cases = {
        "edited": edited,
        "requires grad": w.to(BF16).requires_grad_(True),
        "trainable bias": holder.bias.detach().to(BF16),
        "same dtype": w.detach().clone(),
        "inside a larger storage": inside,
        "another shape": w.detach().to(BF16).flatten().clone(),
        "viewed as another dtype": w.detach().to(BF16).view(torch.float16),
    }
    for name, t in cases.items():
        s = t.untyped_storage()
        got = frozen.derived(t, s) if s.nbytes() in frozen.sizes else None
        assert got is None, name


def test_a_cast_saved_twice_is_compared_once_and_counted_once(tmp_path, monkeypatch):
    torch.manual_seed(0)
    holder = nn.Linear(128, 128, bias=False).requires_grad_(False)
    compared = []
    real = derived_mod._same_bits
    monkeypatch.setattr(derived_mod, "_same_bits", lambda b, p: compared.append(1) or real(b, p))
    x0 = torch.randn(4, 128)

    def run(off):
        x = x0.clone().requires_grad_(True)
        with off.step(holder) if off is not None else torch.enable_grad():
            c = holder.weight.to(BF16)
            xb = x.to(BF16)
            loss = ((xb @ c).float().sum() + (xb @ c.t()).float().square().sum()).sum()
        loss.backward()
        return x.grad

    grad0 = run(None)
    with offloader(tmp_path) as off:
        scan = WriteScanner(off, [holder.weight.detach().to(BF16)])
        grad = run(off)
        st = off.stats()
    assert torch.equal(grad, grad0)
    assert compared == [1] and scan.found == set()
    assert st["recomputed_tensors"] == 2 and st["recomputed_bytes"] == 128 * 128 * 2


def test_the_index_follows_the_model_between_steps(tmp_path):
    """Unfreezing (rule 1 takes over), freezing, and a replaced storage are seen at the next
    step; gradients exact at every step."""
    net, x = make()
    with offloader(tmp_path) as off:
        for change in (None, "unfreeze", "freeze", "replace"):
            if change == "unfreeze":
                net.mix.requires_grad_(True)
            elif change == "freeze":
                net.out.weight.requires_grad_(False)
            elif change == "replace":
                net.wide.weight.data = net.wide.weight.data.clone()
            loss0, grads0 = step(net, x)
            loss, grads = step(net, x, off)
            assert torch.equal(loss, loss0) and same(grads, grads0), change
            assert off.stats()["recomputed_tensors"] == 4, change


def test_without_the_model_or_with_the_rule_off_frozen_casts_are_written(tmp_path):
    net, x = make()
    casts = [w.detach().to(BF16) for w in frozen_weights(net)]
    loss0, grads0 = step(net, x)
    for name, cfg, model in (("no model", {}, False), ("rule off", {"recompute_weights": 0}, True)):
        with offloader(tmp_path / name.replace(" ", "_"), **cfg) as off:
            scan = WriteScanner(off, casts)
            loss, grads = step(net, x, off, model=model)
        assert torch.equal(loss, loss0) and same(grads, grads0)
        assert scan.found == {0, 1, 2}, name


def test_a_frozen_parameter_that_is_not_contiguous_is_left_to_the_writer(tmp_path):
    """Its cast keeps its strides; the index takes contiguous parameters only (rule 5)."""
    net, x = make()
    net.wide.weight = nn.Parameter(net.wide.weight.detach().t().contiguous().t(), False)
    assert not net.wide.weight.is_contiguous()
    cast = net.wide.weight.detach().to(BF16)
    loss0, grads0 = step(net, x)
    with offloader(tmp_path) as off:
        scan = WriteScanner(off, [cast.t()])  # its bytes, in memory order
        loss, grads = step(net, x, off)
        st = off.stats()
    assert torch.equal(loss, loss0) and same(grads, grads0)
    assert scan.found == {0} and st["recomputed_tensors"] == 3
