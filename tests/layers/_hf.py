"""Small random-init Hugging Face models for the tba.layers tests (no hub access needed)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

tf = pytest.importorskip("transformers")
tf.logging.set_verbosity_error()

VOCAB = 128

# family: (the activation class, the norm class) its blocks use, and per 2-layer model how many.
EXPECTED = {
    "gpt2": ({"NewGELUActivation": 2}, {"LayerNorm": 5}),
    "bert": ({"GELUActivation": 3}, {"LayerNorm": 6}),  # + the MLM head's transform
    # RobertaLMHead calls transformers.activations.gelu, a module-level instance that is not a
    # submodule: invisible to convert, like any functional call (docs/layers.md, "Limits").
    "roberta": ({"GELUActivation": 2}, {"LayerNorm": 6}),
    "llama": ({"SiLUActivation": 2}, {"LlamaRMSNorm": 5}),
    "mistral": ({"SiLUActivation": 2}, {"MistralRMSNorm": 5}),
    "qwen2": ({"SiLUActivation": 2}, {"Qwen2RMSNorm": 5}),
    "gemma": ({"GELUTanh": 2}, {"GemmaRMSNorm": 5}),
}
FAMILIES = list(EXPECTED)


def build(family: str, hidden: int = 64, layers: int = 2, vocab: int = VOCAB, seed: int = 0):
    """A random-init model of ``family`` without dropout (so gradients are comparable)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    inter = int(2.75 * hidden)
    if family == "gpt2":
        config = tf.GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=512,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = tf.GPT2LMHeadModel(config)
    elif family == "bert":
        config = tf.BertConfig(
            intermediate_size=4 * hidden,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        model = tf.BertForMaskedLM(config)
    elif family == "roberta":
        config = tf.RobertaConfig(
            intermediate_size=4 * hidden,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        model = tf.RobertaForMaskedLM(config)
    elif family == "llama":
        model = tf.LlamaForCausalLM(
            tf.LlamaConfig(intermediate_size=inter, num_key_value_heads=4, **common)
        )
    elif family == "mistral":
        model = tf.MistralForCausalLM(
            tf.MistralConfig(intermediate_size=inter, num_key_value_heads=2, **common)
        )
    elif family == "qwen2":  # tied lm_head, like the small Qwen2 checkpoints
        config = tf.Qwen2Config(
            intermediate_size=inter, num_key_value_heads=2, tie_word_embeddings=True, **common
        )
        model = tf.Qwen2ForCausalLM(config)
    elif family == "gemma":
        config = tf.GemmaConfig(
            intermediate_size=inter, num_key_value_heads=2, head_dim=hidden // 4, **common
        )
        model = tf.GemmaForCausalLM(config)
    else:
        raise ValueError(family)
    perturb_norms(model)
    return model.train()


def perturb_norms(model: nn.Module, seed: int = 1) -> None:
    """Non-trivial norm weights and biases, so folding and inversion are really exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if "norm" not in type(module).__name__.lower():
                continue
            for p in module.parameters(recurse=False):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)


@functools.cache
def batch(seq: int = 32, size: int = 2, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (size, seq), generator=torch.Generator().manual_seed(2))


def loss_and_grads(model: nn.Module, ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def class_counts(model: nn.Module, names) -> dict[str, int]:
    counts: dict[str, int] = {}
    for module in model.modules():
        if type(module).__name__ in names:
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts
