"""Offload versus no offload: bit-identical losses, gradients and parameters over 3 steps.

The matrix runs under each block policy (NOTE [Block policy] in tba/datapath/blocks/recompute.py):
offload (the default), recompute (every block checkpointed by tba), a forced mix cycling recompute,
offload, keep over the blocks, and auto (the chooser decides after step 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tba.layers as tl
from tba.config import RECOMPUTED
from tba.testing import GPT, GPTConfig, random_batch

from ..conftest import step_ctx

STEPS = 3
SMALL = GPTConfig(vocab=64, seq=32, hidden=32, heads=4, layers=3)


class InplaceMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(32, 64),
            nn.ReLU(inplace=True),
            nn.Linear(64, 64),
            nn.ReLU(inplace=True),
            nn.Linear(64, 64),
        )

    def forward(self, x, y):
        return F.cross_entropy(self.layers(x.float()), y)


def checkpointed_gpt():
    model = GPT(SMALL)
    model.checkpoint_blocks = True
    return model


def converted_gpt(**options):
    def make():
        model = GPT(SMALL)
        tl.convert(model, **options)
        return model

    return make


def gpt_batch(step):
    return random_batch(SMALL, 4, seed=step)


def mlp_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 32, generator=g), torch.randint(64, (16,), generator=g)


MODELS = {
    "pre_ln_transformer": (lambda: GPT(SMALL), gpt_batch),
    "qkv_split_views": (
        lambda: GPT(GPTConfig(**{**vars(SMALL), "attention": "explicit"})),
        gpt_batch,
    ),
    "dropout": (lambda: GPT(GPTConfig(**{**vars(SMALL), "dropout": 0.1})), gpt_batch),
    "inplace_relu_mlp": (InplaceMLP, mlp_batch),
    "tied_embeddings": (lambda: GPT(GPTConfig(**{**vars(SMALL), "tied": True})), gpt_batch),
    "checkpointed_blocks": (checkpointed_gpt, gpt_batch),
    "tempo_layers": (converted_gpt(gelu="tempo", norm="tempo"), gpt_batch),
    "ms_norm_regelu2_layers": (converted_gpt(gelu="regelu2", norm="ms"), gpt_batch),
}


ACTIONS = ("recompute", "offload", "recompute_offload", "selective", "keep")
MIXED = tuple((i, ACTIONS[i % 5]) for i in range(10))
POLICIES = {
    "offload": {"policy": "offload"},
    "recompute": {"policy": "recompute"},
    "selective": {"policy": "selective"},
    "mixed": {"block_policy": MIXED},
    "auto": {"policy": "auto"},
}


@pytest.fixture(params=list(POLICIES))
def policy(request):
    return request.param


def check_policy(off, policy, user_checkpointed=False):
    """The step ran the blocks as ``policy`` says (or left the user's checkpointing alone)."""
    st = off.stats()
    actions = st["group_policy"]
    if user_checkpointed:
        assert set(actions) == {"user"} and st["recomputed_groups"] == 0
    elif policy in ("recompute", "selective"):
        assert set(actions) == {policy} and st["recomputed_groups"] == len(actions)
    elif policy == "mixed":
        assert actions == [a for _, a in MIXED[: len(actions)]]
        assert st["recomputed_groups"] == len([a for a in actions if a in RECOMPUTED])
    elif policy == "auto":
        assert st["policy_decision"].get("actions") == actions  # decided after step 1
    else:
        assert "recompute" not in actions and st["recomputed_groups"] == 0


def settle(off):
    if off is not None:
        off.synchronize()


def train(make_model, batch, off=None, mode="plain", steps=STEPS, give_model=True):
    """Losses and gradients per step; ``mode`` picks the backward pattern.

    With an Offloader, each forward waits for its writes before it ends, so that backward reads
    from disk deterministically (the staging path is covered in test_offloader.py).
    """
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # dropout masks come from here, identically in both runs
    losses, grads = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        if mode == "plain":
            with step_ctx(off, model if give_model else None):
                loss = model(*batch(s))
                settle(off)
            loss.backward()
        elif mode == "accumulate":  # forward, backward, forward, backward
            loss = 0
            for mb in range(2):
                with step_ctx(off, model):
                    part = model(*batch(10 * s + mb)) / 2
                    settle(off)
                part.backward()
                loss = loss + part.detach()
        elif mode == "accumulate_concurrent":  # two graphs alive at once, one backward
            parts = []
            for mb in range(2):
                with step_ctx(off, model):
                    parts.append(model(*batch(10 * s + mb)) / 2)
                    settle(off)
            loss = parts[0] + parts[1]
            loss.backward()
        elif mode == "retain_graph":
            with step_ctx(off, model):
                loss = model(*batch(s))
                settle(off)
            loss.backward(retain_graph=True)
            loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def assert_identical(a, b):
    la, ga, pa = a
    lb, gb, pb = b
    for s, (x, y) in enumerate(zip(la, lb)):
        assert torch.equal(x, y), f"loss differs at step {s}: {x.item()} vs {y.item()}"
    for s, (gs, hs) in enumerate(zip(ga, gb)):
        assert len(gs) == len(hs)
        for i, (g, h) in enumerate(zip(gs, hs)):
            assert torch.equal(g, h), f"gradient {i} differs at step {s}"
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", list(MODELS))
def test_models_bit_identical(name, make_offloader, policy):
    make_model, batch = MODELS[name]
    off = make_offloader(keep_last=1, **POLICIES[policy])
    base = train(make_model, batch)
    got = train(make_model, batch, off)
    assert_identical(base, got)
    st = off.stats()
    if policy != "auto":  # auto may keep or recompute every block of a small model
        assert st["tensors_offloaded"] > 0 and st["bytes_reloaded"] > 0
    # the path of what is not moved (NOTE [Hot path]) ran too: the kept block, the head, a
    # recomputed block's inputs (the user's checkpointed blocks are theirs; auto chooses); the
    # fast path under the fixed policies (the others measure what each block saves) in the
    # transformers (the MLP's kept last layer saves only what the ReLU before it saved already)
    assert st["tensors_kept"] > 0 or name == "checkpointed_blocks" or policy == "auto"
    if policy in ("offload", "recompute") and name not in (
        "checkpointed_blocks",
        "inplace_relu_mlp",
    ):
        assert st["kept_fast"] > 0
        # and the kept block, measured, then run without tba's hooks (NOTE [Kept blocks
        # without hooks]) where all it saves is kept on the fast path
        assert st["kept_credited"] > 0
    assert st["disk_bytes_in_use"] == 0
    check_policy(off, policy, user_checkpointed=name == "checkpointed_blocks")


@pytest.mark.parametrize("backend", ["posix", "buffered", "memory"])
def test_every_backend_bit_identical(backend, make_offloader, policy):
    make_model, batch = MODELS["qkv_split_views"]
    off = make_offloader(backend=backend, **POLICIES[policy])
    assert_identical(train(make_model, batch), train(make_model, batch, off))
    assert off.stats()["backend"] == backend
    check_policy(off, policy)


@pytest.mark.parametrize("mode", ["accumulate", "accumulate_concurrent", "retain_graph"])
def test_backward_patterns_bit_identical(mode, make_offloader, policy):
    make_model, batch = MODELS["pre_ln_transformer"]
    off = make_offloader(**POLICIES[policy])
    assert_identical(train(make_model, batch, mode=mode), train(make_model, batch, off, mode=mode))
    off.synchronize()
    assert off.stats()["disk_bytes_in_use"] == 0
    check_policy(off, policy)


def test_without_model_groups_are_windows(make_offloader):
    make_model, batch = MODELS["pre_ln_transformer"]
    off = make_offloader(keep_last=1, group_bytes="1MiB")
    base = train(make_model, batch)
    assert_identical(base, train(make_model, batch, off, give_model=False))
    st = off.stats()
    assert st["groups"] >= 1 and st["bytes_reloaded"] > 0


def test_torch_compile_region_exact(make_offloader):
    """A compiled region is one autograd node whose saved tensors unpack together."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    fn = torch.compile(lambda x: torch.tanh(lin(x * 2)).sin().sum(), backend="aot_eager")

    def run(off):
        lin.weight.grad = None
        with step_ctx(off):
            loss = fn(torch.randn(32, 64, generator=torch.Generator().manual_seed(3)))
            settle(off)
        loss.backward()
        return lin.weight.grad.clone()

    want = run(None)
    off = make_offloader()
    assert torch.equal(run(off), want)
    st = off.stats()
    assert st["tensors_offloaded"] >= 2 and st["bytes_reloaded"] > 0


def test_unsupported_tensors_stay_as_they_are(make_offloader):
    """The hook's first check: an empty tensor (nothing to write) is kept as "unsupported"
    before the size policy is asked."""
    off = make_offloader()
    w = torch.randn(0, requires_grad=True)
    x = torch.randn(0)
    with off.step():
        loss = (x * w).sum() + 0
    loss.backward()
    st = off.stats()
    assert st["kept_reasons"].get("unsupported", 0) >= 1 and st["tensors_offloaded"] == 0
