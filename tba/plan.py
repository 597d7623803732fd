"""`tba plan`: will the SSDs keep up? Activation bytes, required bandwidth, and a discrete-event
simulation of tba's offload schedule for every keep-last K, from a model shape and hardware
figures or from a trace of a real run. No torch calls and no I/O except reading a trace.

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
divided by t. Without dropout the two sbh masks go: W1 (fp32, GELU, SDPA) is 16·d·T·h per block,
which tba's `saved_bytes` confirms to the byte. Fused norms are assumed: HF's fp32 RMSNorm saves
an fp32 copy of its input as well. The head saves the final norm's input and output and the fp32
log-softmax of the logits (4·T·V/t); the embedding saves only token ids.

Forward FLOPs per layer (Narayanan et al., SC21, eq. 3: 24·b·s·h²·(1 + s/6h) for GPT, split
into its GEMMs): 2·T·h·(h + 2h·kv/a) QKV, 4·b·s²·h attention (the non-causal count MFU figures
use), 2·T·h² output projection, and 2·T·h·rh per MLP matrix (2 for GELU, 3 for SwiGLU);
divided by t. Time = FLOPs / achieved FLOP/s; backward = 2x forward (``backward_ratio``)
unless measured. Inside a layer, GEMMs take 1 - NON_GEMM_SHARE of the time by FLOPs and norms
and elementwise ops the rest; a saved tensor is packed when the op saving it runs and used when
backward reaches the end of that op. Only placement inside a layer depends on that share.

# NOTE [Simulator]
One timeline runs compute; disks are FIFO servers at a fixed rate: two (``duplex="full"``, NVMe)
or one shared by reads and writes in submit order (``"shared"``, e.g. a virtio disk). It follows
tba's rules (README "How it works"):

- Forward, per group in order, per saved tensor at its pack time: kept when its group is one of
  the last K blocks (or the head after them), or smaller than ``min_offload_bytes``. Otherwise it
  needs a staging block (its size rounded up to 4096, placed by tba's own best-fit allocator,
  so fragmentation counts): when none fits it stays resident (``staging_full``, never a
  wait); else the capture copy runs (on the compute timeline when
  ``capture_gbps`` is set: the CPU memcpy) and the write is queued. Staging frees when the write
  completes; nothing cancels a write.
- At the end of forward the prefetch plan is the offloaded tensors in reverse pack order. Reads
  are issued in order while bytes issued and not yet used stay within the read-ahead window
  (at least one): tba's rule from the largest tensor, the backward consumption rate and the
  read rate, capped at ``prefetch_bytes`` (NOTE [Prefetch depth] in tba/adaptive.py). A
  tensor still being written takes budget and is copied from staging when its
  write completes (no read). Each use returns its budget and issues more.
- Backward, per group in reverse: a tensor is used at its unpack time. Kept ones are released.
  An offloaded one waits for its read (stall), or is copied out of staging when its write is
  still in flight, or is read synchronously when no read was issued (``sync_loads``).
  ``h2d_gbps`` adds the host-to-device copy of each offloaded tensor to the compute timeline
  (tba's CUDA adapter orders it after the consumer's queued work: NOTE [CUDA ordering] rule 4).
- Memory follows tba's ``peak_resident_bytes`` accounting: kept tensors from pack to use,
  staging blocks until written, read-back buffers from read issue to use, staging copies.
  ``peak_device`` counts only what stays on the accelerator (kept tensors); ``peak_host``
  staging and read-back. On a CPU they are one memory.
- Several steps back to back (``steps``) carry the disk queues and staging over, so a step
  starts behind the previous step's unfinished writes; the last step is reported.

Closed form next to it (``peak_formula``): kept groups + small tensors + a full staging pool +
a full prefetch window, the resident set at the end of forward when writes lag; tensors kept
for lack of staging come on top, which only the simulation sees.

Recommendation rule: among K = 0..blocks, the smallest peak (device peak with a GPU, resident
peak on a CPU) whose step time is within 3% of the fastest K; ties go to the larger K (less
disk traffic).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from .adaptive import read_ahead
from .config import format_size
from .storage.alloc import ExtentAllocator

__all__ = [
    "ModelShape",
    "Hardware",
    "Knobs",
    "Saved",
    "Group",
    "Workload",
    "SimResult",
    "PlanInputError",
    "layer_tensors",
    "layer_bytes",
    "korthikanti_bytes",
    "layer_flops",
    "workload_from_shape",
    "read_trace",
    "simulate",
    "make_plan",
    "render_text",
    "projections",
    "render_projections",
]

GB = 1e9
ALIGN = 4096
WITHIN = 0.03  # the recommendation's step-time tolerance
DTYPES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
TRACE_PIECE = 16 << 20  # a trace's offloadable bytes are simulated in pieces of at most this
LLAMA_FFN_RATIO = 11008 / 4096  # Llama 1/2 7B: ffn 11008 = 2/3·4h rounded up to 256


class PlanInputError(ValueError):
    """Bad planner input; ``flag`` names the command-line flag, the text says what is accepted."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


# -- inputs --------------------------------------------------------------------------------------
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


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Rates in bytes/s (None: infinite or not on the critical path)."""

    write_bps: float | None
    read_bps: float | None
    drives: int = 1  # rates are per drive; tba's spill dir striped over them (RAID0)
    duplex: str = "full"  # "shared": reads and writes queue on one server
    flops: float | None = None  # achieved FLOP/s (model FLOPs)
    layer_fwd_seconds: float | None = None  # measured forward time of one layer instead
    backward_ratio: float = 2.0
    device: str = "cuda"  # "cpu": memory is one pool, capture is a memcpy on the compute thread
    capture_bps: float | None = None  # capture copy on the compute timeline (CPU memcpy)
    h2d_bps: float | None = None  # read-back H2D copy on the compute timeline (CUDA, staged)
    device_bytes: int | None = None  # memory left for activations on the device
    host_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.duplex not in ("full", "shared"):
            raise PlanInputError("--duplex", "one of full|shared")
        if self.drives < 1:
            raise PlanInputError("--drives", "must be 1 or more")
        if self.device not in ("cuda", "cpu"):
            raise PlanInputError("--device", "one of cuda|cpu")
        for flag, v in (
            ("--write-gbps", self.write_bps),
            ("--read-gbps", self.read_bps),
            ("--flops", self.flops),
            ("--layer-fwd-ms", self.layer_fwd_seconds),
            ("--backward-ratio", self.backward_ratio),
        ):
            if v is not None and not v > 0:
                raise PlanInputError(flag, "must be above 0")

    @property
    def write_rate(self) -> float:
        return math.inf if self.write_bps is None else self.write_bps * self.drives

    @property
    def read_rate(self) -> float:
        return math.inf if self.read_bps is None else self.read_bps * self.drives

    def scaled(self, factor: float) -> Hardware:
        """The same machine with both disk rates (per drive) multiplied by ``factor``."""
        w = None if self.write_bps is None else self.write_bps * factor
        r = None if self.read_bps is None else self.read_bps * factor
        return dataclasses.replace(self, write_bps=w, read_bps=r)


@dataclasses.dataclass(frozen=True)
class Knobs:
    """tba's settings that shape the schedule (TBA_PREFETCH_BYTES, TBA_STAGING_BYTES, ...)."""

    prefetch_bytes: int = 128 << 20
    staging_bytes: int = 256 << 20
    min_offload_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.prefetch_bytes < 1:
            raise PlanInputError("--prefetch", "a size of at least 1 byte, such as 128MiB")
        if self.staging_bytes < 1:
            raise PlanInputError("--staging", "a size of at least 1 byte, such as 256MiB")


# -- the analytical model ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Saved:
    """One capture: ``pack_at``/``use_at`` are fractions of its group's forward/backward time."""

    name: str
    nbytes: int
    pack_at: float
    use_at: float
    small: bool | None = None  # None: below min_offload_bytes; a trace decides it instead


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


# -- workloads -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Group:
    name: str
    fwd: float  # forward compute seconds
    bwd: float  # backward compute seconds (no stalls)
    saved: list[Saved]
    block: bool = True  # a repeated block: what keep-last K counts
    input_bytes: int | None = None  # the block's input (what per-block checkpointing keeps)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.saved)


@dataclasses.dataclass
class Workload:
    groups: list[Group]  # forward order
    source: str = ""
    shape: ModelShape | None = None

    @property
    def blocks(self) -> int:
        return sum(g.block for g in self.groups)

    def kept_flags(self, keep: int) -> list[bool]:
        """tba's rule: the last ``keep`` blocks and every group after the first of them."""
        first = self.blocks - keep if keep else self.blocks + 1
        flags, seen = [], 0
        for g in self.groups:
            if g.block:
                seen += 1
            flags.append(keep > 0 and seen > first)
        return flags

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def compute_seconds(self) -> float:
        return sum(g.fwd + g.bwd for g in self.groups)


def workload_from_shape(m: ModelShape, hw: Hardware) -> Workload:
    """Groups for ``m``: token ids, one per layer, then the head; times from FLOP/s."""
    if hw.layer_fwd_seconds is not None:
        per_flop = hw.layer_fwd_seconds / layer_flops(m)
    elif hw.flops is not None:
        per_flop = 1.0 / hw.flops
    else:
        raise PlanInputError("--flops", "give the achieved FLOP/s (e.g. 400e12) or --layer-fwd-ms")
    lf = layer_flops(m) * per_flop
    groups = [Group("embedding", 0.0, 0.0, [Saved("token_ids", 8 * m.tokens, 0.0, 1.0)], False)]
    tensors = layer_tensors(m)
    for i in range(m.layers):
        groups.append(
            Group(f"layer{i}", lf, lf * hw.backward_ratio, list(tensors), True, tensors[0].nbytes)
        )
    if m.vocab:
        hf = 2 * m.tokens * m.hidden * m.vocab / m.tp * per_flop
        groups.append(Group("head", hf, hf * hw.backward_ratio, head_tensors(m), False))
    return Workload(groups, "shape", m)


# -- traces --------------------------------------------------------------------------------------
@dataclasses.dataclass
class TraceInfo:
    config: dict[str, Any]
    steps: int
    groups: int
    write_bps: float | None
    read_bps: float | None
    step_seconds: float | None
    peak_resident_bytes: int | None
    keep_last: int | None
    machine: str


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def read_trace(path: str) -> tuple[Workload, TraceInfo]:
    """Per-group compute and bytes from a JSON-lines trace (schema version 1).

    Unknown keys and record types are ignored. Figures are medians over the steps after the
    first (all steps when there is only one); ``bwd_seconds`` excludes stalls (README, Trace).
    ``offloaded_bytes`` counts each storage once, but ``packed_bytes``, ``kept_bytes`` and
    ``keepable_bytes`` count it once per view saved (q, k and v of one projection: three
    times). So a kept block's offloadable bytes are ``keepable_bytes`` times the unique share
    ``offloaded / (packed - kept)`` of the blocks that offloaded (other groups: as they are);
    its small tensors are ``kept_bytes - keepable_bytes``. An offloaded block's small tensors
    are the median small share of the kept blocks (or, with none, the least ``kept/packed`` of
    an offloaded block); the rest of its ``kept_bytes`` was kept for lack of staging or disk.
    An offloaded group that is not a block keeps only small tensors.
    Offloadable bytes are cut into pieces of at most 16 MiB, produced and used evenly over the
    group's time. When the groups are numbered as tba numbers
    them with a model (blocks odd, the groups between blocks empty), only the odd ones count
    as blocks for K; otherwise every group does.
    """
    meta: dict[str, Any] = {}
    groups: dict[int, list[dict[str, Any]]] = {}
    steps: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            lines = list(f)
    except OSError as e:
        raise PlanInputError("--trace", f"cannot read {path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise PlanInputError("--trace", f"{path} line {n} is not JSON") from None
        if not isinstance(rec, dict):
            continue
        kind = rec.get("type")
        if kind == "meta":
            if rec.get("version", 1) != 1:
                raise PlanInputError("--trace", f"version {rec.get('version')}; this reads 1")
            meta = rec
        elif kind == "group" and "group" in rec:
            groups.setdefault(int(rec["group"]), []).append(rec)
        elif kind == "step":
            steps.append(rec)
    if not groups:
        raise PlanInputError("--trace", f"{path} has no group records")
    step_ids = sorted({int(r.get("step", 0)) for rs in groups.values() for r in rs})
    later = set(step_ids[1:] or step_ids)

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return _median([float(r.get(key, 0) or 0) for r in rs if int(r.get("step", 0)) in later])

    ids = sorted(groups)
    rows = []
    for g in ids:
        rs = groups[g]
        rows.append(
            {
                "g": g,
                "fwd": med(rs, "fwd_seconds"),
                "bwd": med(rs, "bwd_seconds"),
                "packed": med(rs, "packed_bytes"),
                "offloaded": med(rs, "offloaded_bytes"),
                "kept_bytes": med(rs, "kept_bytes"),
                "keepable": med(rs, "keepable_bytes"),
            }
        )
    total = sum(r["offloaded"] + r["kept_bytes"] for r in rows) or 1.0
    gaps = [r for r in rows[1:-1] if r["g"] % 2 == 0]
    by_model = len(rows) >= 3 and all(r["packed"] <= 0.01 * total for r in gaps)
    for r in rows:
        r["block"] = r["g"] % 2 == 1 if by_model else True
    # packed/kept/keepable count a storage once per view saved; offloaded_bytes once: the
    # unique share of what blocks pack, from the blocks that offloaded
    uniq = [
        r["offloaded"] / (r["packed"] - r["kept_bytes"])
        for r in rows
        if r["block"] and r["offloaded"] > 0 and r["packed"] > r["kept_bytes"]
    ]
    ratio = min(1.0, _median(uniq)) if uniq else 1.0
    blocks = [r for r in rows if r["block"] and r["packed"] > 0]
    exact = [(r["kept_bytes"] - r["keepable"]) / r["packed"] for r in blocks if r["keepable"] > 0]
    rough = [r["kept_bytes"] / r["packed"] for r in blocks if r["offloaded"] > 0]
    share = _median(exact) if exact else (min(rough) if rough else 0.0)
    out = []
    for r in rows:
        unique = ratio if r["block"] else 1.0
        if r["keepable"] > 0:  # a kept group: what it would offload, and its small tensors
            small = r["kept_bytes"] - r["keepable"]
            big = r["keepable"] * unique
        else:  # offloaded, plus (blocks) what staging-full or disk-full kept
            small = min(r["kept_bytes"], r["packed"] * share) if r["block"] else r["kept_bytes"]
            big = r["offloaded"] + (r["kept_bytes"] - small) * unique
        n = max(1, math.ceil(big / TRACE_PIECE))
        saved = [
            Saved(f"g{r['g']}.{j}", int(big / n), (j + 0.5) / n, 1 - (j + 0.5) / n)
            for j in range(n)
            if big > 0
        ]
        if small > 0:
            saved.append(Saved(f"g{r['g']}.small", int(small), 0.0, 1.0, small=True))
        out.append(Group(f"group{r['g']}", r["fwd"], r["bwd"], saved, r["block"]))
    cfg = meta.get("config") or {}

    def step_med(key: str) -> float | None:
        xs = [float(s[key]) for s in steps if s.get(key) and int(s.get("step", 0)) in later]
        return _median(xs) if xs else None

    peak = step_med("peak_resident_bytes")
    info = TraceInfo(
        config=cfg,
        steps=len(step_ids),
        groups=len(ids),
        write_bps=step_med("write_bps"),
        read_bps=step_med("read_bps"),
        step_seconds=step_med("step_seconds"),
        peak_resident_bytes=None if peak is None else int(peak),
        keep_last=cfg.get("keep_last", steps[-1].get("keep_last") if steps else None),
        machine=str(meta.get("machine", "")),
    )
    return Workload(out, f"trace {path}"), info


# -- the simulator -------------------------------------------------------------------------------
@dataclasses.dataclass
class SimResult:
    keep: int
    step_seconds: float
    forward_seconds: float
    backward_seconds: float
    stall_seconds: float
    sync_loads: int
    peak_resident_bytes: int  # tba's accounting: kept + staging + read-back
    peak_device_bytes: int  # kept tensors only (what stays on an accelerator)
    peak_host_bytes: int  # staging + read-back buffers
    bytes_written: int
    bytes_read: int
    served_from_staging: int
    kept_bytes: int  # kept by group or size
    staging_full_bytes: int  # kept because staging was full
    writes_done_at: float  # seconds after the step started when its last write completes
    steps: int = 1  # steps simulated; this is the last

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Fifo:
    """A disk queue served in submit order at a fixed rate (submits arrive in time order)."""

    def __init__(self) -> None:
        self.free = 0.0

    def submit(self, now: float, nbytes: int, rate: float) -> float:
        start = max(now, self.free)
        self.free = start + (nbytes / rate if rate != math.inf else 0.0)
        return self.free


class _Entry:
    __slots__ = ("nbytes", "padded", "written", "want", "budgeted", "read_done", "used")

    def __init__(self, nbytes: int, padded: int, written: float):
        self.nbytes = nbytes
        self.padded = padded
        self.written = written  # when its write completes and staging frees
        self.want = False  # prefetch reached it while it was being written
        self.budgeted = 0
        self.read_done: float | None = None
        self.used = False


_DEV, _HOST = 0, 1


class _Sim:
    def __init__(self, hw: Hardware, knobs: Knobs):
        self.hw = hw
        self.knobs = knobs
        self.wq = _Fifo()
        self.rq = self.wq if hw.duplex == "shared" else _Fifo()
        self.now = 0.0
        # tba's own allocator over the staging arena: best fit, so fragmentation is modelled
        self.arena = ExtentAllocator(knobs.staging_bytes, ALIGN)
        self.staging: list[tuple[float, int]] = []  # (write done, offset in the arena) heap
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, delta, kind)
        self.seq = 0
        self.base = [0, 0]  # resident bytes of events folded away (before the current step)
        self.window = (0.0, 0.0)  # the last step's start and end

    def mem(self, t: float, delta: int, kind: int) -> None:
        self.seq += 1
        self.events.append((t, self.seq, delta, kind))

    def fold(self, t: float) -> None:
        """Fold the memory events before ``t`` into the baseline (keeps long runs cheap)."""
        keep = []
        for ev in self.events:
            if ev[0] < t:
                self.base[ev[3]] += ev[2]
            else:
                keep.append(ev)
        self.events = keep

    def prefill(self) -> None:
        """Start behind a full staging pool of unfinished writes (a backlog that never ends)."""
        rate = self.hw.write_rate
        chunk = 16 << 20
        while True:
            at = self.arena.alloc(chunk)
            if at is None:
                break
            done = self.wq.submit(0.0, chunk, rate)
            heapq.heappush(self.staging, (done, at))
            self.mem(0.0, chunk, _HOST)
            self.mem(done, -chunk, _HOST)

    def _drain(self, t: float) -> None:
        while self.staging and self.staging[0][0] <= t:
            self.arena.free(heapq.heappop(self.staging)[1])

    def step(self, w: Workload, keep: int) -> SimResult:
        hw, kn = self.hw, self.knobs
        t0 = t = self.now
        self.fold(t0)
        cap_rate = hw.capture_bps or math.inf
        h2d_rate = hw.h2d_bps or math.inf
        n_kept = n_full = written = 0
        entries: list[_Entry] = []
        uses: list[list[tuple[float, int, int, _Entry | None]]] = []
        for g, kept in zip(w.groups, w.kept_flags(keep)):
            start, shift, items = t, 0.0, []
            for i, s in enumerate(sorted(g.saved, key=lambda x: x.pack_at)):
                tp = start + shift + s.pack_at * g.fwd
                if kept or not _big(s, kn) or s.nbytes == 0:
                    self.mem(tp, s.nbytes, _DEV)
                    items.append((s.use_at, -i, s.nbytes, None))
                    n_kept += s.nbytes
                    continue
                padded = -(-s.nbytes // ALIGN) * ALIGN
                self._drain(tp)
                at = self.arena.alloc(padded)
                if at is None:  # no free range fits: kept, the forward does not wait
                    self.mem(tp, s.nbytes, _DEV)
                    items.append((s.use_at, -i, s.nbytes, None))
                    n_full += s.nbytes
                    continue
                self.mem(tp, padded, _HOST)
                copy = s.nbytes / cap_rate
                shift += copy
                done = self.wq.submit(tp + copy, padded, hw.write_rate)
                heapq.heappush(self.staging, (done, at))
                self.mem(done, -padded, _HOST)
                e = _Entry(s.nbytes, padded, done)
                entries.append(e)
                items.append((s.use_at, -i, s.nbytes, e))
                written += s.nbytes
            t = start + shift + g.fwd
            uses.append(items)
        fwd_end = t

        plan = entries[::-1]  # reverse pack order
        state = {"cursor": 0, "inflight": 0, "read": 0}
        # the window tba sizes from measured rates within the cap (NOTE [Prefetch depth])
        bwd_total = sum(g.bwd for g in w.groups)
        consume = written / bwd_total if bwd_total > 0 else math.inf
        window = (
            read_ahead(max(e.padded for e in entries), consume, hw.read_rate, kn.prefetch_bytes)[0]
            if entries
            else kn.prefetch_bytes
        )

        def pump(now: float) -> None:
            while state["cursor"] < len(plan):
                e = plan[state["cursor"]]
                if e.used or e.budgeted or e.read_done is not None:
                    state["cursor"] += 1
                    continue
                if state["inflight"] and state["inflight"] + e.padded > window:
                    return
                e.budgeted = e.padded
                state["inflight"] += e.padded
                if e.written > now:
                    e.want = True  # copied out of staging when its write completes
                else:
                    self.mem(now, e.padded, _HOST)
                    e.read_done = self.rq.submit(now, e.padded, hw.read_rate)
                    state["read"] += e.nbytes
                state["cursor"] += 1

        pump(fwd_end)
        stall = 0.0
        sync = served = 0
        for g, items in zip(reversed(w.groups), reversed(uses)):
            start, shift = t, 0.0
            # backward order: by use time, ties in reverse pack order (the later op first)
            for use_at, _, nbytes, e in sorted(items, key=lambda x: (x[0], x[1])):
                tu = start + shift + use_at * g.bwd
                if e is None:
                    self.mem(tu, -nbytes, _DEV)
                    continue
                if e.read_done is None and e.written > tu:  # still in staging: copy it out
                    self.mem(tu, e.padded, _HOST)
                    copy = nbytes / cap_rate
                    shift += copy
                    tu += copy
                    self.mem(tu, -e.padded, _HOST)  # freed when its handle dies after the use
                    served += nbytes
                elif e.read_done is None and e.want:  # copied out when the write completed
                    self.mem(e.written, e.padded, _HOST)
                    self.mem(tu, -e.padded, _HOST)
                    served += nbytes
                else:
                    if e.read_done is None:  # on disk and never issued: a synchronous load
                        sync += 1
                        if not e.budgeted:
                            e.budgeted = e.padded
                            state["inflight"] += e.padded
                        self.mem(tu, e.padded, _HOST)
                        e.read_done = self.rq.submit(tu, e.padded, hw.read_rate)
                        state["read"] += nbytes
                    if e.read_done > tu:
                        stall += e.read_done - tu
                        shift += e.read_done - tu
                        tu = e.read_done
                    self.mem(tu, -e.padded, _HOST)
                h2d = nbytes / h2d_rate
                shift += h2d
                tu += h2d
                e.used = True
                state["inflight"] -= e.budgeted
                e.budgeted = 0
                pump(tu)
            t = start + shift + g.bwd
        self.now = t
        self.window = (t0, t)
        return SimResult(
            keep=keep,
            step_seconds=t - t0,
            forward_seconds=fwd_end - t0,
            backward_seconds=t - fwd_end,
            stall_seconds=stall,
            sync_loads=sync,
            peak_resident_bytes=0,  # filled by peaks(), for the step that is reported
            peak_device_bytes=0,
            peak_host_bytes=0,
            bytes_written=written,
            bytes_read=state["read"],
            served_from_staging=served,
            kept_bytes=n_kept,
            staging_full_bytes=n_full,
            writes_done_at=max((e.written for e in entries), default=t0) - t0,
        )

    def peaks(self) -> tuple[int, int, int]:
        """Peak (all, device, host) bytes over the last step, what earlier steps left included."""
        t0, t1 = self.window
        cur = list(self.base)
        best = [0, 0, 0]
        for tm, _, delta, kind in sorted(self.events):
            cur[kind] += delta
            if t0 <= tm <= t1:
                best[0] = max(best[0], cur[0] + cur[1])
                best[kind + 1] = max(best[kind + 1], cur[kind])
        return best[0], best[1], best[2]


STEADY_MAX = 40  # steps=0 simulates until a step repeats one of the two before, at most this


def simulate(
    w: Workload, hw: Hardware, knobs: Knobs, keep: int, steps: int = 1, gap: float = 0.0
) -> SimResult:
    """Simulate ``steps`` steps back to back (``gap`` seconds apart) and return the last.

    Writes are never cancelled, so a step inherits the previous step's unfinished writes and
    the staging they hold. ``steps=0`` means the steady state: from an idle disk until a step
    repeats the one or two before it (same time, bytes, staging-full keeps and backlog), at
    most STEADY_MAX steps. When the write backlog is still growing by then (a step offloads
    more than the disk writes in a step), the steady state is a full staging pool: it is
    simulated again from one, which is where that growth ends.
    """
    if not 0 <= keep <= w.blocks:
        raise PlanInputError("--keep", f"a number of blocks from 0 to {w.blocks}")
    if steps > 0:
        return _run(w, hw, knobs, keep, steps, gap, steady=False, prefill=False)[0]
    res, converged, growing = _run(w, hw, knobs, keep, STEADY_MAX, gap, True, False)
    if not converged and growing:
        res = _run(w, hw, knobs, keep, STEADY_MAX, gap, True, True)[0]
    return res


def _run(w, hw, knobs, keep, steps, gap, steady, prefill) -> tuple[SimResult, bool, bool]:
    sim = _Sim(hw, knobs)
    if prefill:
        sim.prefill()
    done: list[SimResult] = []
    converged = False
    for n in range(1, steps + 1):
        res = sim.step(w, keep)
        res.steps = n
        sim.now += gap
        done.append(res)
        if steady and any(_same(prev, res) for prev in done[-3:-1]):
            converged = True
            break
    backlog = [r.writes_done_at - r.step_seconds for r in done[-4:]]
    growing = len(backlog) == 4 and all(b > a + 1e-9 for a, b in zip(backlog, backlog[1:]))
    res = done[-1]
    res.peak_resident_bytes, res.peak_device_bytes, res.peak_host_bytes = sim.peaks()
    return res, converged, growing


def _same(a: SimResult, b: SimResult) -> bool:
    return (
        abs(a.step_seconds - b.step_seconds) <= 1e-9 * max(1.0, b.step_seconds)
        and a.bytes_written == b.bytes_written
        and a.bytes_read == b.bytes_read
        and a.staging_full_bytes == b.staging_full_bytes
        and abs(a.writes_done_at - b.writes_done_at) <= 1e-9 * max(1.0, b.step_seconds)
    )


# -- the plan ------------------------------------------------------------------------------------
def _big(s: Saved, knobs: Knobs) -> bool:
    return not s.small if s.small is not None else s.nbytes >= knobs.min_offload_bytes


def peak_formula(w: Workload, knobs: Knobs, keep: int) -> int:
    """The closed-form bound on tba's peak for keep-last ``keep``: the kept groups and every
    small tensor, plus a full staging pool and a full prefetch window (what is resident at the
    end of forward when writes lag). Tensors kept because staging was full come on top; the
    simulator has them."""
    kept = 0
    offloadable = 0
    for g, k in zip(w.groups, w.kept_flags(keep)):
        for x in g.saved:
            if k or not _big(x, knobs):
                kept += x.nbytes
            else:
                offloadable += x.nbytes
    window = min(knobs.staging_bytes, offloadable) + min(knobs.prefetch_bytes, offloadable)
    return kept + window


def recommend(results: Sequence[SimResult], device: str) -> SimResult:
    """The smallest peak within 3% of the fastest step time; ties go to the larger K."""
    fastest = min(r.step_seconds for r in results)
    ok = [r for r in results if r.step_seconds <= fastest * (1 + WITHIN)]

    def peak(r: SimResult) -> int:
        return r.peak_device_bytes if device == "cuda" else r.peak_resident_bytes

    return min(ok, key=lambda r: (peak(r), -r.keep))


PEAK_SLACK = 0.05  # needed_gbps: the peak may exceed an unlimited disk's by this share of saved


def needed_gbps(
    w: Workload, hw: Hardware, knobs: Knobs, keep: int = 1, steps: int = 0
) -> float | None:
    """Least aggregate GB/s, the same for writes and reads, at which keep-last ``keep`` runs
    within 3% of the compute-only step and its peak is within 5% of the step's saved bytes of
    the peak an unlimited disk gives. None when no rate up to 100 TB/s does."""
    ideal = simulate(w, dataclasses.replace(hw, write_bps=None, read_bps=None), knobs, keep, 1)
    base = dataclasses.replace(hw, write_bps=GB, read_bps=GB, drives=1)
    cuda = hw.device == "cuda"
    target = (ideal.peak_device_bytes if cuda else ideal.peak_resident_bytes) + PEAK_SLACK * (
        w.total_bytes
    )

    def ok(x: float) -> bool:
        r = simulate(w, base.scaled(x), knobs, keep, steps)
        peak = r.peak_device_bytes if cuda else r.peak_resident_bytes
        return peak <= target and r.step_seconds <= w.compute_seconds * (1 + WITHIN)

    lo, hi = 1e-3, 1e5  # GB/s
    if not ok(hi):
        return None
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def recompute_estimate(w: Workload) -> tuple[float, int | None]:
    """Per-block checkpointing: one more forward of every block in backward. Memory (saved
    tensors, as tba counts them): every block's input plus the other groups until the head's
    backward ends, then the inputs of blocks 0..i plus block i recomputed. None when the block
    inputs are unknown (a trace)."""
    time = w.compute_seconds + sum(g.fwd for g in w.groups if g.block)
    blocks = [g for g in w.groups if g.block]
    if any(g.input_bytes is None for g in blocks):
        return time, None
    inputs = [g.input_bytes or 0 for g in blocks]
    head = sum(g.nbytes for g in w.groups if not g.block)
    pre = sum(g.nbytes for g in w.groups[: w.groups.index(blocks[0])]) if blocks else 0
    peak = sum(inputs) + head
    for i, g in enumerate(blocks):
        peak = max(peak, sum(inputs[:i]) + g.nbytes + pre)
    return time, peak


def make_plan(
    w: Workload,
    hw: Hardware,
    knobs: Knobs,
    steps: int = 0,
    keeps: Iterable[int] | None = None,
    with_needed: bool = True,
) -> dict[str, Any]:
    """Everything `tba plan` prints, as one JSON-ready dict."""
    keeps = list(range(w.blocks + 1)) if keeps is None else list(keeps)
    results = [simulate(w, hw, knobs, k, steps) for k in keeps]
    best = recommend(results, hw.device)
    blocks = [g for g in w.groups if g.block]
    block_bytes = _median([g.nbytes for g in blocks])
    offloadable = _median([sum(s.nbytes for s in g.saved if _big(s, knobs)) for g in blocks])
    fwd = _median([g.fwd for g in blocks])
    bwd = _median([g.bwd for g in blocks])
    keep_all_time = w.compute_seconds
    keep_all_mem = w.total_bytes
    rtime, rmem = recompute_estimate(w)

    def peak(r: SimResult) -> int:
        return r.peak_device_bytes if hw.device == "cuda" else r.peak_resident_bytes

    out: dict[str, Any] = {
        "source": w.source,
        "shape": dataclasses.asdict(w.shape) if w.shape else None,
        "hardware": dataclasses.asdict(hw),
        "knobs": dataclasses.asdict(knobs),
        "steps_simulated": steps,
        "blocks": len(blocks),
        "per_layer_bytes": int(block_bytes),
        "per_layer_offloadable_bytes": int(offloadable),
        "per_step_bytes": int(keep_all_mem),
        "layer_forward_seconds": fwd,
        "layer_backward_seconds": bwd,
        "required_write_gbps": offloadable / fwd / GB if fwd else None,
        "required_read_gbps": offloadable / bwd / GB if bwd else None,
        "table": [
            {**r.as_dict(), "peak_formula_bytes": peak_formula(w, knobs, r.keep)} for r in results
        ],
        "recommended": {
            "keep": best.keep,
            "rule": "smallest peak (device peak on cuda, resident peak on cpu) whose step time "
            "is within 3% of the fastest K; ties go to the larger K",
        },
        "rok": {
            "keep_all": {"step_seconds": keep_all_time, "memory_bytes": keep_all_mem},
            "offload": {
                "keep": best.keep,
                "step_seconds": best.step_seconds,
                "memory_bytes": peak(best),
                "host_bytes": best.peak_host_bytes,
            },
            "recompute": {"step_seconds": rtime, "memory_bytes": rmem},
        },
    }
    if w.shape is not None and hw.flops is not None and w.shape.arch == "gpt":
        t, h = w.shape.tp, w.shape.hidden  # the TBA paper's rule of thumb (docs/sources.md)
        out["tba_paper_write_gbps"] = (10 * t + 24) * hw.flops / (24 * h) / GB
    if hw.device_bytes is not None:
        for row in out["table"]:
            row["fits"] = (
                row["peak_device_bytes"] if hw.device == "cuda" else row["peak_resident_bytes"]
            ) <= hw.device_bytes
        out["rok"]["keep_all"]["fits"] = keep_all_mem <= hw.device_bytes
        out["rok"]["recompute"]["fits"] = rmem is None or rmem <= hw.device_bytes
    if hw.host_bytes is not None:
        out["host_fits"] = knobs.staging_bytes + knobs.prefetch_bytes <= hw.host_bytes
    over = [
        x
        for g in blocks
        for x in g.saved
        if _big(x, knobs) and -(-x.nbytes // ALIGN) * ALIGN > knobs.staging_bytes
    ]
    if over:
        out["over_staging"] = {
            "tensors_per_layer": len(over) / len(blocks),
            "largest_bytes": max(x.nbytes for x in over),
        }
    if with_needed and w.blocks:
        got = needed_gbps(w, hw, knobs, keep=min(1, w.blocks))
        out["needed_gbps_keep_1"] = got
    return out


# -- rendering -----------------------------------------------------------------------------------
def _gb(x: float | None) -> str:
    if x is None:
        return "inf"
    return f"{x:.3g}" if x < 10 else f"{x:.0f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def _rate(bps: float | None, drives: int) -> str:
    if bps is None:
        return "unlimited"
    return f"{bps / GB:.3g} GB/s" + (f" x {drives} drives" if drives > 1 else "")


def render_text(p: dict[str, Any], describe: str = "") -> str:
    hw, kn = p["hardware"], p["knobs"]
    lines = []
    if describe:
        lines.append(f"model:    {describe}")
    lines.append(
        f"disk:     write {_rate(hw['write_bps'], hw['drives'])}, read "
        f"{_rate(hw['read_bps'], hw['drives'])}, {hw['duplex']} duplex; staging "
        f"{format_size(kn['staging_bytes'])}, prefetch {format_size(kn['prefetch_bytes'])}, "
        f"min offload {format_size(kn['min_offload_bytes'])}; "
        + (
            f"{p['steps_simulated']} step(s) back to back, the last shown"
            if p["steps_simulated"]
            else "steady state of steps back to back"
        )
    )
    lines.append(
        f"saved:    {format_size(p['per_layer_bytes'])} per layer "
        f"({format_size(p['per_layer_offloadable_bytes'])} offloadable), "
        f"{format_size(p['per_step_bytes'])} per step"
    )
    lines.append(
        f"compute:  {_ms(p['layer_forward_seconds'])} ms forward, "
        f"{_ms(p['layer_backward_seconds'])} ms backward per layer"
    )
    need = (
        f"bandwidth to keep pace with a layer: write {_gb(p['required_write_gbps'])} GB/s "
        f"(forward), read {_gb(p['required_read_gbps'])} GB/s (backward)"
    )
    if "tba_paper_write_gbps" in p:
        need += f"; TBA paper's (10t+24)F/(24h): {_gb(p['tba_paper_write_gbps'])} GB/s"
    lines.append(need)
    if "needed_gbps_keep_1" in p:
        n = p["needed_gbps_keep_1"]
        lines.append(
            "simulated: K=1 runs within 3% of compute with about the peak of an unlimited disk at "
            + (f"{_gb(n)} GB/s each way (aggregate)" if n else "no rate up to 100 TB/s")
        )
    if "over_staging" in p:
        o = p["over_staging"]
        lines.append(
            f"warning:  {o['tensors_per_layer']:g} saved tensors per layer (up to "
            f"{format_size(o['largest_bytes'])}) are larger than TBA_STAGING_BYTES: they can "
            "never be offloaded; raise --staging above them"
        )
    lines.append("")
    dev = hw["device"] == "cuda"
    head = [
        "K",
        "step ms",
        "vs keep-all",
        "stall ms",
        "peak device" if dev else "peak",
        "peak host" if dev else "staging+reads",
        "written",
        "read",
        "staging-full",
    ]
    rows = [head]
    base = p["rok"]["keep_all"]["step_seconds"]
    for r in p["table"]:
        mark = " *" if r["keep"] == p["recommended"]["keep"] else ""
        fit = "" if r.get("fits", True) else " (no fit)"
        rows.append(
            [
                f"{r['keep']}{mark}",
                _ms(r["step_seconds"]),
                f"{r['step_seconds'] / base:.3f}" if base else "-",
                _ms(r["stall_seconds"]),
                format_size(r["peak_device_bytes"] if dev else r["peak_resident_bytes"]) + fit,
                format_size(r["peak_host_bytes"]),
                format_size(r["bytes_written"]),
                format_size(r["bytes_read"]),
                format_size(r["staging_full_bytes"]),
            ]
        )
    lines.extend(_table(rows))
    rec = p["recommended"]
    lines.append(f"\nrecommended: TBA_KEEP_LAST={rec['keep']}  (rule: {rec['rule']})")
    rok = p["rok"]
    lines.append("")
    rows = [["strategy", "step ms", "vs keep-all", "activation memory"]]
    for name, key in (
        ("keep all", "keep_all"),
        (f"offload K={rok['offload']['keep']}", "offload"),
        ("recompute per block", "recompute"),
    ):
        x = rok[key]
        fit = "" if x.get("fits", True) else " (no fit)"
        rows.append(
            [
                name,
                _ms(x["step_seconds"]),
                f"{x['step_seconds'] / base:.3f}" if base else "-",
                "unknown (block inputs)"
                if x["memory_bytes"] is None
                else format_size(x["memory_bytes"]) + fit,
            ]
        )
    lines.extend(_table(rows))
    if p.get("host_fits") is False:
        lines.append("warning: staging + prefetch exceed --host-mem")
    return "\n".join(lines)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append("  ".join(cells))
    return out


# -- projections ---------------------------------------------------------------------------------
H100_FLOPS = 400e12  # achieved model FLOP/s: ~40% MFU of the H100 SXM's 989 TFLOP/s dense bf16
GEN4_READ = 6.5e9  # per drive, datacenter PCIe Gen4 (e.g. Samsung PM9A3 U.2: 6.5 GB/s read)
GEN4_WRITE = 3.5e9  # per drive, sustained sequential write of the same class (PM9A3: 3.5 GB/s)
H100_H2D = 50e9  # host-to-device copy rate, PCIe Gen5 x16 with pinned memory
LLAMA_7B = dict(
    layers=32, hidden=4096, heads=32, seq=4096, dtype_bytes=2, attention="flash", arch="llama",
    vocab=32000,
)  # fmt: skip
PROJECTION_KNOBS = {
    "tba defaults (staging 256 MiB, prefetch 128 MiB)": Knobs(),
    "more host memory (staging 8 GiB, prefetch 4 GiB)": Knobs(4 << 30, 8 << 30),
}
PROJECTION_ASSUMPTIONS = (
    "Llama-2-7B shape: 32 layers, hidden 4096, 32 heads (no GQA), SwiGLU ffn 11008, fused "
    "RMSNorm, vocab 32000, seq 4096, bf16, flash attention, no dropout, tp 1, no pipeline",
    f"H100 SXM at {H100_FLOPS / 1e12:.0f} TFLOP/s achieved: about 40% MFU of its 989 TFLOP/s "
    "dense bf16, a typical figure for 7B-class training; backward = 2x forward",
    f"PCIe Gen4 datacenter NVMe per drive: {GEN4_WRITE / GB} GB/s sustained write, "
    f"{GEN4_READ / GB} GB/s read (Samsung PM9A3 U.2 datasheet class), striped (RAID0) so rates "
    "add up, full duplex",
    "min offload 1 MiB; steady state of steps back to back with no gap for the optimizer "
    "(pessimistic: unfinished writes of one step hold staging in the next)",
    f"'+H2D': tba's CUDA adapter copies each read-back tensor host-to-device after the "
    f"consumer stream's queued work (NOTE [CUDA ordering] rule 4), so at {H100_H2D / GB:.0f} "
    "GB/s (PCIe Gen5 x16) that copy adds to the step; the other columns leave it out",
)


def projections(
    drives: Sequence[int] = (1, 2, 4),
    batches: Sequence[int] = (1, 2, 4),
    settings: dict[str, Knobs] | None = None,
) -> list[dict[str, Any]]:
    """The 7B-on-H100 tables: one row per (tba settings, micro-batch, drives)."""
    rows = []
    for label, knobs in (settings or PROJECTION_KNOBS).items():
        for b in batches:
            shape = ModelShape(batch=b, **LLAMA_7B)
            for n in drives:
                hw = Hardware(GEN4_WRITE, GEN4_READ, drives=n, flops=H100_FLOPS)
                w = workload_from_shape(shape, hw)
                p = make_plan(w, hw, knobs)
                best = next(r for r in p["table"] if r["keep"] == p["recommended"]["keep"])
                h2d = dataclasses.replace(hw, h2d_bps=H100_H2D)
                with_h2d = simulate(w, h2d, knobs, best["keep"], 0).step_seconds
                rows.append(
                    {
                        "settings": label,
                        "batch": b,
                        "drives": n,
                        "per_layer_bytes": p["per_layer_bytes"],
                        "per_step_bytes": p["per_step_bytes"],
                        "layer_forward_seconds": p["layer_forward_seconds"],
                        "required_write_gbps": p["required_write_gbps"],
                        "required_read_gbps": p["required_read_gbps"],
                        "disk_write_gbps": GEN4_WRITE * n / GB,
                        "disk_read_gbps": GEN4_READ * n / GB,
                        "needed_gbps_keep_1": p["needed_gbps_keep_1"],
                        "keep_all_seconds": p["rok"]["keep_all"]["step_seconds"],
                        "k1": p["table"][1],
                        "recommended": best,
                        "recommended_h2d_seconds": with_h2d,
                        "recompute": p["rok"]["recompute"],
                    }
                )
    return rows


def render_projections(rows: list[dict[str, Any]]) -> str:
    lines = ["assumptions:"] + [f"  - {a}" for a in PROJECTION_ASSUMPTIONS]
    r0 = rows[0]
    lines.append(
        f"  - per layer: {format_size(r0['per_layer_bytes'])} saved per micro-batch, "
        f"{r0['layer_forward_seconds'] * 1e3:.2f} ms forward at micro-batch {r0['batch']}"
    )
    head = ["mb", "drives", "saved/step", "need W/R", "have W/R", "K=1 step", "K=1 stall",
            "K=1 peak", "rec K", "rec step", "+H2D", "rec peak", "written", "needed"]  # fmt: skip
    for label in dict.fromkeys(r["settings"] for r in rows):
        out = [head]
        for r in (r for r in rows if r["settings"] == label):
            base = r["keep_all_seconds"]
            k1, rec = r["k1"], r["recommended"]
            need = r["needed_gbps_keep_1"]
            out.append(
                [
                    str(r["batch"]),
                    str(r["drives"]),
                    format_size(r["per_step_bytes"]),
                    f"{r['required_write_gbps']:.0f}/{r['required_read_gbps']:.0f}",
                    f"{r['disk_write_gbps']:.3g}/{r['disk_read_gbps']:.3g}",
                    f"{k1['step_seconds'] / base:.3f}",
                    f"{k1['stall_seconds'] * 1e3:.0f} ms",
                    format_size(k1["peak_device_bytes"]),
                    str(rec["keep"]),
                    f"{rec['step_seconds'] / base:.3f}",
                    f"{r['recommended_h2d_seconds'] / base:.3f}",
                    format_size(rec["peak_device_bytes"]),
                    format_size(rec["bytes_written"]),
                    "-" if need is None else f"{need:.0f}",
                ]
            )
        lines += ["", f"{label}:"] + _table(out)
    rc = r0["recompute"]
    lines += [
        "",
        "need W/R: GB/s to write a layer during its forward and read it during its backward; "
        "have: the drives' aggregate; steps are relative to keep-all (compute only, "
        f"{r0['keep_all_seconds'] * 1e3:.0f} ms at micro-batch {r0['batch']}); peaks are device "
        "memory for saved tensors; written: bytes offloaded per step at the recommended K; "
        "needed: least GB/s each way (aggregate) at which K=1 is within 3% of keep-all with a "
        "peak within 5% of the saved bytes of an unlimited disk's (tensors larger than staging "
        "stay resident at any rate).",
        f"recompute (per-block checkpointing): {rc['step_seconds'] / r0['keep_all_seconds']:.3f}"
        f" of keep-all, {format_size(rc['memory_bytes'])} at micro-batch {r0['batch']} "
        "(scales with it).",
    ]
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------
_SHAPE_FLAGS = (
    "layers",
    "hidden",
    "heads",
    "seq",
    "batch",
    "dtype",
    "tp",
    "attention",
    "arch",
    "mlp_ratio",
    "vocab",
    "kv_heads",
    "dropout",
    "sequence_parallel",
)


def _given(args: Any, name: str) -> bool:
    v = getattr(args, name, None)
    return v is not None and v is not False


def build(args: Any) -> tuple[Workload, Hardware, Knobs, str, dict[str, Any] | None]:
    """Workload, hardware and knobs from parsed `tba plan` arguments (PlanInputError if bad)."""
    info = None
    cfg: dict[str, Any] = {}
    if args.trace:
        extra = [n for n in _SHAPE_FLAGS if _given(args, n)]
        if extra:
            flag = "--" + extra[0].replace("_", "-")
            raise PlanInputError(flag, "describes a model shape; with --trace the trace does")
        w, ti = read_trace(args.trace)
        cfg = ti.config
        info = dataclasses.asdict(ti)
        describe = f"trace {args.trace}: {ti.groups} groups, {ti.steps} steps"
        if ti.machine:
            describe += f", {ti.machine}"
        if args.write_gbps is None or args.read_gbps is None:
            describe += (
                "; disk rates not given are the trace's achieved rates (a lower bound on the "
                "drive's: reads wait for the prefetch budget)"
            )
    else:
        missing = [n for n in ("layers", "hidden", "heads", "seq") if not _given(args, n)]
        if missing:
            raise PlanInputError(
                "--" + missing[0], "required (a model shape), or give --trace FILE or --projections"
            )
        shape = ModelShape(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            seq=args.seq,
            batch=args.batch or 1,
            dtype_bytes=args.dtype or 2,
            tp=args.tp or 1,
            attention=args.attention or "flash",
            arch=args.arch or "gpt",
            mlp_ratio=args.mlp_ratio,
            vocab=args.vocab or 0,
            kv_heads=args.kv_heads,
            dropout=bool(args.dropout),
            sequence_parallel=bool(args.sequence_parallel),
        )
        describe = shape.describe()

    def rate(flag_value: float | None, trace_value: float | None, flag: str) -> float | None:
        if flag_value is not None:
            return flag_value * GB
        if args.trace and trace_value:
            return trace_value
        if args.trace:
            return None
        raise PlanInputError(flag, "required: the drive's rate in GB/s, e.g. 6 (per drive)")

    hw = Hardware(
        write_bps=rate(args.write_gbps, info and info["write_bps"], "--write-gbps"),
        read_bps=rate(args.read_gbps, info and info["read_bps"], "--read-gbps"),
        drives=args.drives or 1,
        duplex=args.duplex or "full",
        flops=args.flops,
        layer_fwd_seconds=None if args.layer_fwd_ms is None else args.layer_fwd_ms / 1e3,
        backward_ratio=args.backward_ratio or 2.0,
        device=args.device or "cuda",
        capture_bps=None if args.capture_gbps is None else args.capture_gbps * GB,
        h2d_bps=None if args.h2d_gbps is None else args.h2d_gbps * GB,
        device_bytes=args.device_mem,
        host_bytes=args.host_mem,
    )
    knobs = Knobs(
        prefetch_bytes=_pick(args.prefetch, cfg.get("prefetch_bytes"), 128 << 20),
        staging_bytes=_pick(args.staging, cfg.get("staging_bytes"), 256 << 20),
        min_offload_bytes=_pick(args.min_offload, cfg.get("min_offload_bytes"), 1 << 20),
    )
    if not args.trace:
        w = workload_from_shape(shape, hw)
    return w, hw, knobs, describe, info


def _pick(flag: Any, traced: Any, default: int) -> int:
    if flag is not None:
        return int(flag)
    if isinstance(traced, int) and traced > 0:
        return traced
    return default


def run_cli(args: Any) -> int:
    """`tba plan`: 0 done, 2 bad input (the message names the flag)."""
    import sys

    try:
        if args.projections:
            rows = projections()
            if args.json:
                print(json.dumps({"assumptions": PROJECTION_ASSUMPTIONS, "rows": rows}, indent=2))
            else:
                print(render_projections(rows))
            return 0
        w, hw, knobs, describe, info = build(args)
        if args.steps is not None and args.steps < 1:
            raise PlanInputError("--steps", "must be 1 or more")
        p = make_plan(w, hw, knobs, steps=args.steps or 0)
    except PlanInputError as e:
        print(f"tba plan: {e}", file=sys.stderr)
        return 2
    p["describe"] = describe
    if info is not None:
        p["trace"] = info
    if args.json:
        print(json.dumps(p, indent=2, default=_json_default))
    else:
        print(render_text(p, describe))
    return 0


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return None
    return str(x)
