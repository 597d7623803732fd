"""A transformer's saved tensors and FLOPs from its shape.

# NOTE [Activation bytes]
Per layer, the tensors autograd saves, after tba's dedup (one capture per storage). Notation: s
seq, b micro-batch, T = s·b tokens, h hidden, a heads, t tensor-parallel degree, d bytes per
element, r MLP width / h. "rep" tensors are replicated across tensor-parallel ranks unless
sequence parallelism splits them too; the others are split by t.

    LayerNorm input, QKV input, LN2 input, MLP input    4 · d·T·h   (rep)
    q, k, v (one storage)                              3 · d·T·h/t (k, v scale with kv heads)
    attention output (= output-projection input)       d·T·h/t
    GELU MLP: act input, fc2 input                     2r · d·T·h/t
    SwiGLU MLP: gate, up, silu(gate), down input       4r · d·T·h/t
    explicit attention: softmax output                 d·a·s²·b/t
      with dropout: + 1-byte mask + dropout output     (1 + d)·a·s²·b/t, and 2 · T·h masks (rep)
    flash attention: logsumexp (fp32)                  4·a·s·b/t
    norm statistics (fp32 mean, rstd)                  8·T per LayerNorm, 4·T per RMSNorm

With d=2, r=4, GELU, dropout, explicit attention and no sequence parallelism this is exactly
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
arXiv 2205.05198, Sec. 4, eq. 2): s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes, plus the norm
statistics they leave out; for t=1, sbh(34 + 5as/h). Flash attention stores no s² tensor (the
5as/h term goes) but its logsumexp. With sequence parallelism (their eq. 4) every term is
divided by t. Without dropout the two sbh masks go: a GELU block with SDPA is then 16·d·T·h, which
tba's `saved_bytes` matches to the byte (tests/plan/test_plan.py,
test_w1_bytes_match_what_tba_measures, pins it). Fused norms are assumed: HF's fp32 RMSNorm saves an
fp32 copy of its input as well. The head saves the final norm's input and output and the fp32
log-softmax of the logits (4·T·V/t); the embedding saves only token ids.

Forward FLOPs per layer (Narayanan et al., SC21, eq. 3: 24·b·s·h²·(1 + s/6h) for GPT, split
into its GEMMs): 2·T·h·(h + 2h·kv/a) QKV, 4·b·s²·h attention (the non-causal count MFU figures
use), 2·T·h² output projection, and 2·T·h·rh per MLP matrix (2 for GELU, 3 for SwiGLU);
divided by t. Time = FLOPs / achieved FLOP/s; backward = 2x forward (``backward_ratio``)
unless measured. Inside a layer, GEMMs take 1 - NON_GEMM_SHARE of the time by FLOPs and norms
and elementwise ops the rest; a saved tensor is packed when the op saving it runs and used when
backward reaches the end of that op. Only placement inside a layer depends on that share.
"""

from __future__ import annotations

import dataclasses

from ..decide.simulator import Saved
from .inputs import PlanInputError

LLAMA_FFN_RATIO = 11008 / 4096  # Llama 1/2 7B: ffn 11008 = 2/3·4h rounded up to 256


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int = 1
    dtype_bytes: int = 2
    tp: int = 1
    attention: str = "flash"  # or "explicit"
    arch: str = "gpt"  # gpt: LayerNorm + GELU MLP; llama: RMSNorm + SwiGLU MLP
    mlp_ratio: float | None = None  # MLP width / hidden; default 4 (gpt) or 11008/4096 (llama)
    vocab: int = 0  # 0: no head group
    kv_heads: int | None = None
    dropout: bool = False
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "batch", "dtype_bytes", "tp"):
            if getattr(self, name) < 1:
                raise PlanInputError(f"--{name.replace('_', '-')}", "must be 1 or more")
        if self.hidden % self.heads:
            raise PlanInputError("--heads", f"must divide --hidden ({self.hidden})")
        if self.heads % self.tp:
            raise PlanInputError("--tp", f"must divide --heads ({self.heads})")
        if self.attention not in ("flash", "explicit"):
            raise PlanInputError("--attention", "one of flash|explicit")
        if self.arch not in ("gpt", "llama"):
            raise PlanInputError("--arch", "one of gpt|llama")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise PlanInputError("--kv-heads", f"must divide --heads ({self.heads})")
        if self.mlp_ratio is not None and not self.mlp_ratio > 0:
            raise PlanInputError("--mlp-ratio", "must be above 0")
        if self.vocab < 0:
            raise PlanInputError("--vocab", "must be 0 (no head) or more")

    @property
    def ratio(self) -> float:
        if self.mlp_ratio is not None:
            return self.mlp_ratio
        return LLAMA_FFN_RATIO if self.arch == "llama" else 4.0

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    def describe(self) -> str:
        dt = {4: "fp32", 2: "bf16/fp16", 1: "fp8"}.get(self.dtype_bytes, f"{self.dtype_bytes} B")
        mlp = "SwiGLU" if self.arch == "llama" else "GELU"
        extra = ", dropout" if self.dropout else ""
        extra += ", sequence parallel" if self.sequence_parallel else ""
        return (
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, "
            f"micro-batch {self.batch}, {dt}, tp {self.tp}, {self.attention} attention, "
            f"{mlp} MLP x{self.ratio:.3g}, vocab {self.vocab}{extra}"
        )


NON_GEMM_SHARE = 0.10  # of a layer's time, spent in norms and elementwise ops (placement only)


def _layer_ops(m: ModelShape) -> list[tuple[str, float]]:
    """One layer's forward ops in order, with their FLOPs (0 for norms and elementwise ops),
    per tensor-parallel rank."""
    T, h, t = m.tokens, m.hidden, m.tp
    kv = (m.kv_heads or m.heads) / m.heads
    rh = m.ratio * h
    ops = [
        ("ln1", 0.0),
        ("qkv", 2 * T * h * (h + 2 * h * kv) / t),
        ("attention", 4 * m.batch * m.seq**2 * h / t),
        ("proj", 2 * T * h * h / t),
        ("ln2", 0.0),
    ]
    if m.arch == "llama":
        mlp = [("gate", 2 * T * h * rh / t), ("up", 2 * T * h * rh / t), ("act", 0.0)]
        mlp += [("mul", 0.0), ("down", 2 * T * rh * h / t)]
    else:
        mlp = [("fc1", 2 * T * h * rh / t), ("act", 0.0), ("fc2", 2 * T * rh * h / t)]
    return ops + mlp


def layer_flops(m: ModelShape) -> float:
    """Forward FLOPs of one transformer layer on one tensor-parallel rank (NOTE above)."""
    return sum(f for _, f in _layer_ops(m))


def _op_spans(m: ModelShape) -> dict[str, tuple[float, float]]:
    """(start, end) of each op as fractions of the layer's forward time: GEMMs share
    1 - NON_GEMM_SHARE by FLOPs, the other ops share NON_GEMM_SHARE evenly. Only where tensors
    are packed and used depends on this, not any total."""
    ops = _layer_ops(m)
    flops = sum(f for _, f in ops)
    light = sum(1 for _, f in ops if f == 0)
    spans, acc = {}, 0.0
    for name, f in ops:
        dt = (1 - NON_GEMM_SHARE) * f / flops if f else NON_GEMM_SHARE / light
        spans[name] = (acc, acc + dt)
        acc += dt
    return spans


def layer_tensors(m: ModelShape) -> list[Saved]:
    """What one layer saves for backward, with pack and use fractions (NOTE [Activation bytes]).

    A tensor is packed when the op saving it runs (an op's input at its start, its output at
    its end) and used when backward reaches the end of that op: use_at = 1 - end."""
    T, h, t, d, a, s, b = m.tokens, m.hidden, m.tp, m.dtype_bytes, m.heads, m.seq, m.batch
    rep = t if m.sequence_parallel else 1
    kv = (m.kv_heads or m.heads) / m.heads
    rh = m.ratio * h
    sp = _op_spans(m)
    stats = 8 * T if m.arch == "gpt" else 4 * T  # fp32 mean+rstd (LayerNorm) or rstd (RMSNorm)
    out: list[Saved] = []

    def add(name: str, nbytes: float, packed: float, user: str) -> None:
        out.append(Saved(name, int(round(nbytes)), packed, 1.0 - sp[user][1]))

    start = {k: v[0] for k, v in sp.items()}
    end = {k: v[1] for k, v in sp.items()}
    add("ln1.in", d * T * h / rep, start["ln1"], "ln1")
    add("ln1.stats", stats / rep, end["ln1"], "ln1")
    add("qkv.in", d * T * h / rep, start["qkv"], "qkv")
    add("q,k,v", d * T * h * (1 + 2 * kv) / t, end["qkv"], "attention")
    if m.attention == "explicit":
        mid = (start["attention"] + end["attention"]) / 2
        add("attn.probs", d * a * s * s * b / t, mid, "attention")
        if m.dropout:
            add("attn.dropout_mask", a * s * s * b / t, mid, "attention")
            add("attn.dropped", d * a * s * s * b / t, mid, "attention")
    else:
        add("attn.lse", 4 * a * s * b / t, end["attention"], "attention")
    add("attn.out", d * T * h / t, end["attention"], "proj")
    if m.dropout:
        add("proj.dropout_mask", T * h / rep, end["proj"], "ln2")
    add("ln2.in", d * T * h / rep, start["ln2"], "ln2")
    add("ln2.stats", stats / rep, end["ln2"], "ln2")
    if m.arch == "llama":
        add("mlp.in", d * T * h / rep, start["gate"], "up")
        add("gate.out", d * T * rh / t, end["gate"], "act")
        add("up.out", d * T * rh / t, end["up"], "mul")
        add("silu.out", d * T * rh / t, end["act"], "mul")
        add("down.in", d * T * rh / t, end["mul"], "down")
    else:
        add("mlp.in", d * T * h / rep, start["fc1"], "fc1")
        add("act.in", d * T * rh / t, end["fc1"], "act")
        add("fc2.in", d * T * rh / t, end["act"], "fc2")
    if m.dropout:
        add("mlp.dropout_mask", T * h / rep, 1.0, "fc2" if m.arch == "gpt" else "down")
    return out


def layer_bytes(m: ModelShape) -> int:
    return sum(x.nbytes for x in layer_tensors(m))


def korthikanti_bytes(m: ModelShape) -> float:
    """Korthikanti et al. eq. 2/4 (16-bit activations and dropout assumed by the paper, so the
    masks are counted at 1 byte): sbh(10 + 24/t + 5as/(ht)), or sbh(34/t + 5as/(ht)) with
    sequence parallelism; the flash-attention variant drops 5as/(ht) and adds the fp32
    logsumexp, 4·a·s·b/t bytes. Norm statistics are not included."""
    s, b, h, a, t = m.seq, m.batch, m.hidden, m.heads, m.tp
    base = 34 / t if m.sequence_parallel else 10 + 24 / t
    if m.attention == "explicit":
        return s * b * h * (base + 5 * a * s / (h * t))
    return s * b * h * base + 4 * a * s * b / t


def head_tensors(m: ModelShape) -> list[Saved]:
    if not m.vocab:
        return []
    T, h, d = m.tokens, m.hidden, m.dtype_bytes
    rep = m.tp if m.sequence_parallel else 1
    return [
        Saved("lnf.in", d * T * h // rep, 0.0, 1.0),
        Saved("lnf.stats", (8 if m.arch == "gpt" else 4) * T // rep, 0.0, 1.0),
        Saved("head.in", d * T * h // rep, 0.0, 1.0),
        Saved("logsoftmax", 4 * T * m.vocab // m.tp, 1.0, 0.0),
        Saved("targets", 8 * T, 1.0, 0.0),
    ]
