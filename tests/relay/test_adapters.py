"""The Hugging Face adapters: a relay over LlamaForCausalLM and GPT-2 (random init from small
configs, nothing downloaded) equals gradient accumulation over the model itself, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

import tba
from tba.relay import RelayConfigError, gpt2_layers, layers_of, llama_layers

from .conftest import plain_accumulation, relay_run, same_params, token_batches

transformers = pytest.importorskip("transformers")

U = 2
VOCAB, SEQ = 96, 12


def hf_loss(model, x, y):
    return model(input_ids=x, labels=y, use_cache=False).loss


def llama(**kw):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kw,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def gpt2(tied=False):
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=3,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def labels_batches():
    # labels = inputs (the model shifts them), some masked out with -100 as a collator does
    out = []
    for x, _ in token_batches(VOCAB, SEQ, 4, steps=3, seed=3):
        y = x.clone()
        y[:, :2] = -100
        out.append((x, y))
    return out


@pytest.mark.parametrize("mode", [dict(), dict(recompute=False), dict(eps="ssd", stash="ssd")])
@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
def test_hf_model_matches_its_own_accumulation(build, mode, storage):
    plain = build()
    model = copy.deepcopy(plain)
    batches = labels_batches()
    want = plain_accumulation(plain, batches, U, hf_loss)
    got, _ = relay_run(model, batches, U, storage=storage, **mode)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)
    assert same_params(plain, model) == []


def test_llama_with_padding_mask():
    """A dict batch with an attention mask reaches the mask the model itself would build."""
    plain = llama()
    model = copy.deepcopy(plain)
    x, y = labels_batches()[0]
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding in the first sequence
    want = None
    for xu, mu, yu in zip(x.chunk(U), mask.chunk(U), y.chunk(U)):
        loss = plain(input_ids=xu, attention_mask=mu, labels=yu, use_cache=False).loss / U
        loss.backward()
        want = loss.detach() if want is None else want + loss.detach()
    torch.optim.AdamW(plain.parameters(), lr=1e-2).step()
    got, _ = relay_run(model, [({"input_ids": x, "attention_mask": mask}, y)], U)
    assert torch.equal(got[0], want)
    assert same_params(plain, model) == []


def test_layers_of_dispatches():
    assert len(layers_of(llama()).modules) == 5  # embed, 3 decoder layers, norm + lm_head
    assert len(layers_of(gpt2()).modules) == 5


def test_tied_gpt2_is_refused_with_the_fix():
    with pytest.raises(tba.ConfigError, match=r"tied weights.*tie_word_embeddings=False"):
        tba.relay.Relay(
            gpt2_layers(gpt2(tied=True)),
            optimizer=lambda p: torch.optim.AdamW(p),
            micro_batches=2,
        )


def test_an_adapter_names_what_it_misses():
    with pytest.raises(
        RelayConfigError, match=r"GPT2LMHeadModel has no 'model.embed_tokens', which llama_layers"
    ):
        llama_layers(gpt2())
