"""tba.layers presets on Hugging Face models: saved bytes, CPU step time, activation cost, and a
short fine-tuning run.

Models are random-init HF models built from small configs (no hub access). Four parts:
  bytes:    unique bytes autograd saves in one training forward, counted by storage as tba's
            dedup counts them (each storage once; parameters and buffers apart), stock against
            convert(model, preset="exact") and preset="approx";
  time:     one training step (forward, backward, AdamW) per family and preset, all interleaved,
            medians of --repeats rounds after one warm-up round, wall time and the process's
            CPU time (less sensitive to other work on the machine; with --time-threads 1 the
            two agree on a quiet machine);
  act:      forward + backward of the activations alone (stock, Tempo, Approx-BP) on a tensor the
            size of one MLP activation, --act-threads threads, interleaved medians;
            --compare-commit also times the TempoGELU of that commit (read from git);
  finetune: a small Llama pretrained from scratch on this repository's Python sources
            (--pretrain-steps, stock), then fine-tuned --finetune-steps steps on its Markdown docs
            (held-out tail for evaluation) as stock, llama-approx and llama-exact, same batches.

    python benchmarks/bench_hf_layers.py [--parts bytes,time,act,finetune] [--repeats 5]
        [--dropout 0.0] [--compare-commit aff9fc1] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import machine_line  # noqa: E402

import tba.layers as tl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("gpt2", "bert", "llama", "mistral", "qwen2", "gemma")
PRESETS = ("stock", "exact", "approx")


def build(family: str, hidden: int, layers: int, vocab: int, dropout: float, seed: int = 0):
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(seed)
    heads = max(4, hidden // 64)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=1024,
    )
    inter = 64 * round(2.75 * hidden / 64)  # Llama's ratio (11008 / 4096 = 2.69), rounded
    if family == "gpt2":
        config = tf.GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=1024,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
        )
        return tf.GPT2LMHeadModel(config).train()
    if family == "bert":
        config = tf.BertConfig(
            intermediate_size=4 * hidden,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            **common,
        )
        return tf.BertForMaskedLM(config).train()
    kinds = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {"num_key_value_heads": heads}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"num_key_value_heads": 2}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {"num_key_value_heads": 2}),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"num_key_value_heads": 2}),
    }
    config_cls, model_cls, extra = kinds[family]
    if family == "gemma":
        extra = {**extra, "head_dim": hidden // heads}
    config = config_cls(intermediate_size=inter, attention_dropout=dropout, **common, **extra)
    return model_cls(config).train()


def converted(stock, family: str, preset: str):
    model = copy.deepcopy(stock)
    if preset != "stock":
        report = tl.convert(model, preset=f"{family}-{preset}")
        if report.skipped:
            raise SystemExit(f"{family}-{preset}: skipped {report.skipped}")
    return model


def storage_bytes(model, ids) -> int:
    """Each saved storage once, parameters and buffers apart: what tba's dedup counts."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen, kept = {}, []

    def pack(t):
        kept.append(t)  # keeps storages alive, so addresses stay unique
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


def part_bytes(args, ids) -> list[dict]:
    rows = []
    for family in args.families:
        stock = build(family, args.hidden, args.layers, args.vocab, args.dropout)
        sizes = {p: storage_bytes(converted(stock, family, p), ids) for p in PRESETS}
        rows.append({"family": family, **{f"{p}_bytes": sizes[p] for p in PRESETS}})
        print(
            f"  bytes {family:<8} stock {sizes['stock'] / 2**20:8.1f} MiB  exact "
            f"{sizes['exact'] / sizes['stock']:.3f}  approx {sizes['approx'] / sizes['stock']:.3f}",
            flush=True,
        )
    return rows


def part_time(args, ids) -> list[dict]:
    runs = {}
    for family in args.time_families:
        stock = build(family, args.hidden, args.layers, args.vocab, args.dropout)
        for preset in PRESETS:
            model = converted(stock, family, preset)
            runs[(family, preset)] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    threads = torch.get_num_threads()
    torch.set_num_threads(args.time_threads or threads)
    times = {key: [] for key in runs}
    cpu = {key: [] for key in runs}
    for r in range(1 + args.repeats):
        for key, (model, opt) in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            dt, dt_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if r:
                times[key].append(dt)
                cpu[key].append(dt_cpu)
            print(f"  round {r} {key[0]:<8}{key[1]:<7}{dt:7.3f} s ({dt_cpu:.3f} CPU-s)", flush=True)
    torch.set_num_threads(threads)
    rows = []
    for (family, preset), values in times.items():
        base = statistics.median(times[(family, "stock")])
        base_cpu = statistics.median(cpu[(family, "stock")])
        med, med_cpu = statistics.median(values), statistics.median(cpu[(family, preset)])
        rows.append(
            {
                "family": family,
                "preset": preset,
                "step_s": med,
                "vs_stock": med / base,
                "cpu_s": med_cpu,
                "cpu_vs_stock": med_cpu / base_cpu,
            }
        )
    return rows


def new_gelu(x):  # HF's NewGELUActivation (GPT-2), an autograd chain of elementwise ops
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def old_tempo_gelu(commit: str):
    """TempoGELU as of ``commit``, loaded from git into a throwaway module."""
    source = subprocess.run(
        ["git", "show", f"{commit}:tba/layers/_gelu.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType("tba.layers._gelu_at_commit")
    module.__package__ = "tba.layers"
    exec(compile(source, f"{commit}:tba/layers/_gelu.py", "exec"), module.__dict__)
    return module.tempo_gelu


def part_act(args) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.act_threads)  # one thread: less exposed to a loaded machine
    n = args.batch * args.seq * 4 * args.hidden
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    fns = {
        "gelu erf: F.gelu": F.gelu,
        "gelu erf: TempoGELU": tl.tempo_gelu,
        "gelu erf: ReGELU2": tl.regelu2,
        "gelu tanh: F.gelu(tanh)": lambda t: F.gelu(t, approximate="tanh"),
        "gelu tanh: NewGELUActivation": new_gelu,
        "gelu tanh: TempoGELU": lambda t: tl.tempo_gelu(t, "tanh"),
        "silu: F.silu": F.silu,
        "silu: TempoSiLU": tl.tempo_silu,
        "silu: ReSiLU2": tl.resilu2,
    }
    if args.compare_commit:
        fns[f"gelu erf: TempoGELU at {args.compare_commit}"] = old_tempo_gelu(args.compare_commit)
    times = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    grad = torch.ones_like(x)
    for r in range(1 + args.repeats):
        for name, fn in fns.items():
            xt = x.clone().requires_grad_()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(xt).backward(grad)
            if r:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    rows = [
        {
            "activation": k,
            "elements": n,
            "ms": 1e3 * statistics.median(v),
            "cpu_ms": 1e3 * statistics.median(cpu[k]),
        }
        for k, v in times.items()
    ]
    for row in rows:
        print(
            f"  act {row['activation']:<36}{row['ms']:8.1f} ms {row['cpu_ms']:8.1f} CPU-ms",
            flush=True,
        )
    torch.set_num_threads(threads)
    return rows


def text_bytes(patterns: list[str]) -> torch.Tensor:
    files = sorted(f for p in patterns for f in glob.glob(os.path.join(ROOT, p), recursive=True))
    data = b"\n".join(open(f, "rb").read() for f in files)  # noqa: SIM115 - read once
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def windows(data: torch.Tensor, seq: int, count: int, seed: int) -> torch.Tensor:
    starts = torch.randint(
        len(data) - seq - 1, (count,), generator=torch.Generator().manual_seed(seed)
    )
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def train(model, data, steps: int, lr: float, batch: int, seq: int, seed: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        w = windows(data, seq, batch, seed * 100_003 + step)
        loss = model(input_ids=w[:, :-1], labels=w[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def evaluate(model, held_out: torch.Tensor, seq: int) -> float:
    w = windows(held_out, seq, 64, seed=7)
    with torch.no_grad():
        return float(model.eval()(input_ids=w[:, :-1], labels=w[:, :-1]).loss)


def part_finetune(args) -> dict:
    seq, batch = args.ft_seq, args.ft_batch
    sources = text_bytes(["tba/**/*.py"])
    docs = text_bytes(["*.md", "examples/**/*.md", "deploy/**/*.md"])
    cut = int(0.9 * len(docs))
    train_docs, held_out = docs[:cut], docs[cut:]
    base = build("llama", args.ft_hidden, args.ft_layers, 256, 0.0)
    start = time.perf_counter()
    pre = train(base, sources, args.pretrain_steps, 1e-3, batch, seq, seed=1)
    print(f"  pretrain {args.pretrain_steps} steps: loss {pre[0]:.3f} -> {pre[-1]:.3f}", flush=True)
    result = {"pretrain": {"first": pre[0], "last": pre[-1]}, "runs": {}}
    for preset in PRESETS:
        model = converted(base, "llama", preset).train()
        losses = train(model, train_docs, args.finetune_steps, 3e-4, batch, seq, seed=2)
        run = {
            "first": losses[0],
            "last": losses[-1],
            "last20_mean": statistics.fmean(losses[-20:]),
            "eval": evaluate(model, held_out, seq),
            "losses": losses,
        }
        result["runs"][preset] = run
        print(
            f"  finetune {preset:<7} loss {run['first']:.4f} -> last {run['last']:.4f}, "
            f"last-20 mean {run['last20_mean']:.4f}, held-out {run['eval']:.4f}",
            flush=True,
        )
    result["seconds"] = time.perf_counter() - start
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="bytes,time,act,finetune")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--time-families", default="gpt2,bert,llama")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--act-threads", type=int, default=1)
    ap.add_argument("--time-threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--compare-commit", default="")
    ap.add_argument("--pretrain-steps", type=int, default=200)
    ap.add_argument("--finetune-steps", type=int, default=200)
    ap.add_argument("--ft-hidden", type=int, default=256)
    ap.add_argument("--ft-layers", type=int, default=4)
    ap.add_argument("--ft-seq", type=int, default=128)
    ap.add_argument("--ft-batch", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.families = args.families.split(",")
    args.time_families = args.time_families.split(",")
    parts = set(args.parts.split(","))
    ids = torch.randint(
        0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    out: dict = {"machine": machine_line("/var/tmp"), "args": vars(args)}
    out["loadavg_start"] = os.getloadavg()
    print(out["machine"], flush=True)
    print(
        f"models: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab "
        f"{args.vocab}, batch {args.batch}, dropout {args.dropout}, SDPA, float32",
        flush=True,
    )
    if "bytes" in parts:
        out["bytes"] = part_bytes(args, ids)
    if "time" in parts:
        out["time"] = part_time(args, ids)
        for row in out["time"]:
            print(
                f"  step {row['family']:<8}{row['preset']:<7}{row['step_s']:7.3f} s "
                f"{row['vs_stock']:.3f}x stock, {row['cpu_s']:7.3f} CPU-s "
                f"{row['cpu_vs_stock']:.3f}x stock",
                flush=True,
            )
    if "act" in parts:
        out["act"] = part_act(args)
    if "finetune" in parts:
        out["finetune"] = part_finetune(args)
    out["loadavg_end"] = os.getloadavg()
    print(f"load average at the start {out['loadavg_start']}, at the end {out['loadavg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
