"""Real transformers models (random init from small configs) under bf16 autocast: the weight
casts they save are recomputed, never written (NOTE [Weight-derived tensors] in
tba/datapath/capture/derived.py), and losses and gradients stay bit-identical to the same autocast
without tba."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tba

from .._scan import WriteScanner
from ._frameworks import bf16_step

tf = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration]


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":  # Conv1D (addmm saves the cast itself); lm_head tied to wte
        cfg = tf.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(cfg).train()
    cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg).train()


def matmul_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights autocast casts to bf16 for a matmul: every Linear's and Conv1D's, once."""
    from transformers.pytorch_utils import Conv1D

    seen: dict[int, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, (nn.Linear, Conv1D)):
            seen.setdefault(id(m.weight), m.weight)
    return list(seen.values())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_weight_casts_of_hf_models_are_recomputed_and_gradients_bit_identical(tmp_path, family):
    model = build(family)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    weights = matmul_weights(model)
    casts = [w.detach().to(torch.bfloat16) for w in weights]
    loss0, grads0 = bf16_step(model, ids)
    cfg = tba.Config(spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=0, environ={})
    with tba.Offloader(cfg) as off:
        scan = WriteScanner(off, casts)
        loss, grads = bf16_step(model, ids, off)
        st = off.stats()
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys() and all(torch.equal(grads[k], grads0[k]) for k in grads)
    assert scan.writes > 0 and scan.found == set()
    assert st["recomputed_tensors"] == len(weights), st
    assert st["recomputed_bytes"] == sum(c.numel() * 2 for c in casts)
