"""Activation bytes of a whole W1-shaped model, converted per option, against the formulas.

T = batch * seq = 128 tokens, h = 64, i = 4h = 256, a = batch * heads * seq^2 = 16384, b = 4,
2 blocks, 5 LayerNorms (2 per block and ln_f). Parameters are not counted.
"""

import copy
import functools
import math

import pytest
import torch

import tba.layers as L

from ._support import TinyGPT, saved_bytes

T, H, WIDTH, A, B, BLOCKS, NORMS = 128, 64, 256, 4 * 4 * 32 * 32, 4, 2, 5
IDX = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))


@functools.cache
def stock_model(p: float) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(p=p)


def activation_bytes(p: float, options: dict, fused: bool) -> int:
    model = copy.deepcopy(stock_model(p))
    L.convert(model, **options)
    for block in model.blocks:
        block.attn.fused = fused
    torch.manual_seed(0)
    return saved_bytes(lambda: model(IDX), list(model.parameters()))


EXPECTED_SAVING = {
    "tempo-gelu": BLOCKS * (T * WIDTH * B - math.ceil(T * WIDTH / 8)),  # 2 * 126976
    "regelu2": BLOCKS * (T * WIDTH * B - math.ceil(T * WIDTH / 4)),  # 2 * 122880
    "tempo-norm": NORMS * (T * H * B + 4 * T),  # 5 * 33280
    "ms-norm": NORMS * (T * H * B + 4 * T),
    # CPU dropout keeps a float noise tensor (a * b) besides P_d (a * b); the op keeps 1 bit.
    "fused-attention": BLOCKS * (2 * A * B - math.ceil(A / 8)),  # 2 * 129024
}
OPTIONS = {
    "tempo-gelu": ({"gelu": "tempo"}, False),
    "regelu2": ({"gelu": "regelu2"}, False),
    "tempo-norm": ({"norm": "tempo"}, False),
    "ms-norm": ({"norm": "ms"}, False),
    "fused-attention": ({}, True),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_saves_its_formula(name):
    options, fused = OPTIONS[name]
    stock = activation_bytes(0.1, {}, False)
    assert stock - activation_bytes(0.1, options, fused) == EXPECTED_SAVING[name]


def test_savings_add_up_when_combined():
    stock = activation_bytes(0.1, {}, False)
    lean = activation_bytes(0.1, {"gelu": "tempo", "norm": "ms"}, True)
    expected = sum(EXPECTED_SAVING[k] for k in ("tempo-gelu", "ms-norm", "fused-attention"))
    assert stock - lean == expected  # 678400 of 1515776 bytes


def test_fused_attention_without_dropout_saves_what_stock_saves():
    assert activation_bytes(0.0, {}, True) == activation_bytes(0.0, {}, False)
