"""Shared helpers for the tba.layers tests: a saved-bytes counter and two tiny models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import tba.layers as L


class SavedBytes:
    """Counts the unique bytes autograd saves, through ``saved_tensors_hooks``.

    Dedup is by storage, byte by byte: each saved tensor marks the bytes of its storage that it
    actually covers (from storage offset, size, stride and dtype), and a byte counts once however
    many saved tensors cover it. So exact duplicates (same storage, offset, size, stride, dtype)
    count once, and so do views of the same bytes, which matters because ``nn.Linear`` on a 3-D
    input saves a 2-D view of it; a strided view (a head slice of a fused qkv output) counts only
    its own elements, as an offloader copying it would. Storages of ``exclude`` (parameters) are
    not counted.
    """

    def __init__(self, exclude=()) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.masks: dict[int, torch.Tensor] = {}
        self.kept: list[torch.Tensor] = []  # keeps storages alive so pointers stay unique

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.kept.append(t)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if t.numel() and ptr not in self.exclude:
            size = t.element_size()
            elements = torch.arange(storage.nbytes() // size)
            offsets = elements.as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1, 1)
            mask = self.masks.setdefault(ptr, torch.zeros(storage.nbytes(), dtype=torch.bool))
            mask[(offsets * size + torch.arange(size)).reshape(-1)] = True
        return t

    @property
    def total(self) -> int:
        return sum(int(mask.sum()) for mask in self.masks.values())

    def run(self, fn):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            return fn()


def saved_bytes(fn, exclude=()) -> int:
    counter = SavedBytes(exclude)
    counter.run(fn)
    return counter.total


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, p: float, fused: bool) -> None:
        super().__init__()
        self.heads, self.p, self.fused = heads, p, fused
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        if self.fused:
            out = L.softmax_dropout_matmul(scores, v, self.p, self.training)
        else:
            out = F.dropout(F.softmax(scores, dim=-1), self.p, self.training) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden: int, act: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = act
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden, heads, p, fused, act) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, p, fused)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """W1-shaped pre-LN causal transformer (defaults: 2 blocks, H=64, 4 heads, S=32)."""

    def __init__(
        self,
        vocab: int = 64,
        hidden: int = 64,
        heads: int = 4,
        blocks: int = 2,
        seq: int = 32,
        p: float = 0.0,
        fused: bool = False,
        act: str = "gelu",
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        make = nn.GELU if act == "gelu" else nn.SiLU
        self.blocks = nn.ModuleList(Block(hidden, heads, p, fused, make()) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def randomize_norms(model: nn.Module, seed: int = 0) -> None:
    """Give every norm a non-trivial gamma (and beta), so folding is really tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.weight is not None:
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.3)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def split(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, norm) -> None:
        super().__init__()
        self.input_layernorm = norm(hidden)
        self.self_attn = LlamaAttention(hidden, heads)
        self.post_attention_layernorm = norm(hidden)
        self.mlp = LlamaMLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaInner(nn.Module):
    def __init__(self, vocab, hidden, heads, layers, norm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaLayer(hidden, heads, norm) for _ in range(layers))
        self.norm = norm(hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaLike(nn.Module):
    """HF LLaMA module names (model.layers.N.input_layernorm, ..., model.norm, lm_head)."""

    def __init__(self, vocab=64, hidden=32, heads=4, layers=2, norm=nn.RMSNorm, tie=False):
        super().__init__()
        self.model = LlamaInner(vocab, hidden, heads, layers, norm)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx)[:, -8:])  # a view, like HF's logits_to_keep
