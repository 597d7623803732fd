"""Adapters: a model's layer list for the relay, with the call, extras and loss it needs.

Each adapter reuses the model's own modules (no copy) and computes what the model's forward
computes, in the same order, so that a relay step equals a step of the model itself under
gradient accumulation. ``layers_of(model)`` picks the adapter by the model's class:

- ``transformers`` ``LlamaForCausalLM``: embed_tokens → decoder layers → norm + lm_head; the
  rotary embeddings and the causal mask are the extras (``prepare``), the loss is the model's
  ``loss_function`` (labels are shifted inside it, as in the model).
- ``transformers`` ``GPT2LMHeadModel``: wte + wpe (+ dropout) → blocks → ln_f + lm_head. GPT-2
  ties lm_head to wte by default, which the relay refuses (each layer's weights travel alone):
  build it with ``GPT2Config(tie_word_embeddings=False)``.
- ``tba.testing.GPT``: tok + pos → blocks → ln_f + head, with its cross-entropy.

The batch is ``input_ids`` (a tensor), or a dict with ``input_ids`` and optionally
``attention_mask``; the target is the labels (``tba.testing.GPT``: the next tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._errors import RelayConfigError
from ._layers import SHAPE, Layers

__all__ = ["gpt2_layers", "gpt_layers", "layers_of", "llama_layers"]


def _need(model: nn.Module, paths: list[str], what: str) -> None:
    for path in paths:
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if obj is None:
            raise RelayConfigError(
                f"{type(model).__name__} has no {path!r}, which {what} needs: {SHAPE}."
            )


def _ids_and_mask(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, dict):
        return batch["input_ids"], batch.get("attention_mask")
    return batch, None


class _Seq(nn.Module):
    """Modules applied one after the other (a head: final norm, then the vocabulary projection)."""

    def __init__(self, *mods: nn.Module):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.mods:
            x = m(x)
        return x


# -- Llama ------------------------------------------------------------------------------------
class _LlamaEmbed(nn.Module):
    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, batch: Any) -> torch.Tensor:
        return self.embed_tokens(_ids_and_mask(batch)[0])


def llama_layers(model: nn.Module) -> Layers:
    """A ``LlamaForCausalLM`` as relay layers (LlamaModel.forward without a KV cache)."""
    _need(
        model,
        ["model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"],
        "llama_layers",
    )
    from transformers.masking_utils import create_causal_mask

    inner, config = model.model, model.config
    blocks = list(inner.layers[: config.num_hidden_layers])
    last = len(blocks) + 1

    def prepare(batch: Any, hidden: torch.Tensor) -> dict:
        _, mask = _ids_and_mask(batch)
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        causal = create_causal_mask(
            config=config,
            inputs_embeds=hidden,
            attention_mask=mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        rotary = inner.rotary_emb.to(hidden.device)
        return {
            "attention_mask": causal,
            "position_ids": position_ids,
            "position_embeddings": rotary(hidden, position_ids=position_ids),
        }

    def call(i: int, layer: nn.Module, x: Any, extras: dict | None) -> torch.Tensor:
        if i == 0 or i == last:
            return layer(x)
        return layer(x, past_key_values=None, use_cache=False, **extras)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size)

    modules = [_LlamaEmbed(inner.embed_tokens), *blocks, _Seq(inner.norm, model.lm_head)]
    return Layers(modules, loss, call, prepare)


# -- GPT-2 ------------------------------------------------------------------------------------
class _GPT2Embed(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, batch: Any) -> torch.Tensor:
        ids, _ = _ids_and_mask(batch)
        embeds = self.wte(ids)
        position_ids = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
        return self.drop(embeds + self.wpe(position_ids))


def gpt2_layers(model: nn.Module) -> Layers:
    """A ``GPT2LMHeadModel`` (untied) as relay layers (GPT2Model.forward without a KV cache)."""
    _need(
        model,
        ["transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"],
        "gpt2_layers",
    )
    from transformers.masking_utils import create_causal_mask

    tr, config = model.transformer, model.config
    blocks = list(tr.h)
    last = len(blocks) + 1

    def prepare(batch: Any, hidden: torch.Tensor) -> dict:
        _, mask = _ids_and_mask(batch)
        if mask is not None and mask.ndim < 4:
            mask = mask.view(hidden.shape[0], -1)
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        causal = create_causal_mask(
            config=config,
            inputs_embeds=hidden,
            attention_mask=mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        return {"attention_mask": causal, "position_ids": position_ids}

    def call(i: int, layer: nn.Module, x: Any, extras: dict | None) -> torch.Tensor:
        if i == 0 or i == last:
            return layer(x)
        return layer(
            x,
            None,
            extras["attention_mask"],
            None,
            encoder_attention_mask=None,
            use_cache=False,
            position_ids=extras["position_ids"],
        )

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size)

    modules = [_GPT2Embed(tr.wte, tr.wpe, tr.drop), *blocks, _Seq(tr.ln_f, model.lm_head)]
    return Layers(modules, loss, call, prepare)


# -- tba.testing.GPT --------------------------------------------------------------------------
class _GPTEmbed(nn.Module):
    def __init__(self, tok: nn.Module, pos: nn.Module):
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_layers(model: nn.Module) -> Layers:
    """A ``tba.testing.GPT`` (untied) as relay layers; the target is the next tokens."""
    _need(model, ["tok", "pos", "blocks", "ln_f", "head"], "gpt_layers")
    modules = [_GPTEmbed(model.tok, model.pos), *model.blocks, _Seq(model.ln_f, model.head)]
    return Layers(modules, _next_token_loss)


_BY_CLASS = {
    "LlamaForCausalLM": llama_layers,
    "GPT2LMHeadModel": gpt2_layers,
}


def layers_of(model: nn.Module) -> Layers:
    """The relay layers of a model whose class an adapter knows (see the module docstring)."""
    from ..testing import GPT

    adapter = gpt_layers if isinstance(model, GPT) else _BY_CLASS.get(type(model).__name__)
    if adapter is None:
        known = ", ".join([*_BY_CLASS, "tba.testing.GPT"])
        raise RelayConfigError(
            f"no adapter knows {type(model).__name__} (known: {known}), and a model cannot be "
            f"split as it stands: {SHAPE}."
        )
    return adapter(model)
