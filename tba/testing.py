"""A small GPT used by tba's tests, benchmarks and examples (not needed to use tba).

Pre-LN causal blocks with one fused q/k/v projection (so q, k and v are views of one storage at
different offsets), GELU MLP, optional tied embeddings, and either PyTorch's
``scaled_dot_product_attention`` or explicit softmax attention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0
    tied: bool = False
    attention: str = "sdpa"  # or "explicit"


# W1, the benchmark workload: 6 pre-LN causal blocks, H=512, 8 heads, MLP 4H, S=512, fp32.
W1 = GPTConfig(vocab=256, seq=512, hidden=512, heads=8, layers=6)
W1_MICRO_BATCH = 8


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.attention = cfg.attention
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, cfg.mlp_ratio * h)
        self.fc2 = nn.Linear(cfg.mlp_ratio * h, h)
        self.act = nn.GELU()  # a module, so tba.layers.convert can swap it
        self.drop = nn.Dropout(cfg.dropout)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attention == "explicit":
            scores = q @ k.transpose(-2, -1) / math.sqrt(h // self.heads)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
            out = probs @ v
        else:
            p = self.dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attend(x))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight
        self.checkpoint_blocks = False  # recompute each block in backward (non-reentrant)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# NOTE [First-call math]
# torch's CPU build routes tanh, exp, log, erf, sin, sqrt and a dozen more elementwise functions
# through MKL's vector math library (VML), once per OpenMP chunk. In a fresh process under CPU
# load (about once in 50 to 250 processes, in probes beside two busy-looping processes), the
# worker thread's share of the *first* such call comes back less accurate. Measured with torch
# 2.13 (MKL 2024.2) on this project's 2-core VM: the second half of a 65,536-element torch.tanh
# differed in 32,749 elements, with relative errors up to 5e-5 against 6e-8 for every later
# call, which all agreed bit for bit. It looks like a race in the library's first use (only
# under load, only the worker's half), not in tba; whether a new thread's first call can meet
# it again after the process's first was not tested. A test that computes its bit-exact
# reference as the process's first tanh takes that hit, and its gradients then differ from
# tba's by 1e-10 everywhere.
# warm_cpu_math() makes each of those first calls once, on the main thread alone and then on
# every OpenMP thread, before any result is compared.
_VML_FUNCTIONS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10",
    "log1p", "log2", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


def warm_cpu_math() -> None:
    """Make the first call of every VML-backed elementwise function in this process, so that
    bit-exact comparisons never meet the first call's race (NOTE [First-call math])."""
    parallel = 32768 * max(2, torch.get_num_threads())  # ATen's grain: one chunk per thread
    for dtype in (torch.float32, torch.float64):
        for n in (4096, parallel):  # the main thread alone, then every thread
            x = torch.linspace(0.1, 0.9, n, dtype=dtype)  # inside every function's domain
            for name in _VML_FUNCTIONS:
                getattr(torch, name)(x)


def random_batch(cfg: GPTConfig, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def strided_batches(vocab: int, seq: int, batch: int, steps: int | None = None, seed: int = 0):
    """``(inputs, targets)`` batches of arithmetic token sequences (start + stride * i mod vocab):
    learnable, so an example's loss falls. ``steps`` None: endless."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    while steps is None or n < steps:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        window = (start + stride * torch.arange(seq + 1)) % vocab
        yield window[:, :-1], window[:, 1:]
        n += 1


# megatron-core on the CPU (examples and tests): the shims, each replacing one CUDA assumption,
# are listed in megatron_on_cpu below.
class MegatronNoBuffer:
    """Stands in for megatron-core's global memory buffer, which allocates on the GPU."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


class CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    """Tensor factories asked for ``device="cuda"`` get the CPU.

    megatron-core's schedules allocate their token counter with ``device="cuda"``
    (``forward_backward_no_pipelining``); everything else already follows the model's device.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_on_cpu():
    """megatron-core's model-parallel code on the CPU with gloo, after
    ``parallel_state.initialize_model_parallel`` (tests and examples only). Each shim replaces
    one CUDA assumption and none replaces megatron-core's computation:

    - its global memory buffer allocates on the GPU (:class:`MegatronNoBuffer`);
    - its CUDA RNG tracker forks the CUDA generator: a null context (dropout then draws from
      the CPU generator, identically with and without tba);
    - its schedules allocate with ``device="cuda"`` (:class:`CudaFactoriesOnCpu`), and its
      pipeline send/receive buffers with ``device=torch.cuda.current_device()``, which a CPU
      build of torch cannot answer: it answers ``cpu`` here;
    - sequence parallel reduce-scatters with ``reduce_scatter_tensor``, which gloo lacks: an
      all-reduce followed by taking this rank's slice of the first dimension (the same sum, in
      the same rank order on every rank).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    saved_buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved_device, saved_rs = torch.cuda.current_device, dist.reduce_scatter_tensor
    parallel_state._GLOBAL_MEMORY_BUFFER = MegatronNoBuffer()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: torch.device("cpu")
    dist.reduce_scatter_tensor = _reduce_scatter_by_all_reduce
    try:
        with CudaFactoriesOnCpu():
            yield
    finally:
        dist.reduce_scatter_tensor = saved_rs
        torch.cuda.current_device = saved_device
        del tracker.fork
        parallel_state._GLOBAL_MEMORY_BUFFER = saved_buffer


def _reduce_scatter_by_all_reduce(output, input, op=None, group=None, async_op=False):
    import torch.distributed as dist

    full = input.clone()
    dist.all_reduce(full, group=group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    output.copy_(full.chunk(world, dim=0)[rank])
    return None
