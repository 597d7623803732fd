"""The 7B-on-H100 projections (`tba plan --projections`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..config import format_size
from .inputs import GB, Hardware, Knobs
from .mix import make_mix
from .recommend import make_plan
from .render import runs_text, saved_text, table_lines
from .shape import ModelShape
from .simulation import simulate
from .workload import workload_from_shape

H100_FLOPS = 400e12  # achieved model FLOP/s: ~40% MFU of the H100 SXM's 989 TFLOP/s dense bf16
GEN4_READ = 6.5e9  # per drive, datacenter PCIe Gen4 (e.g. Samsung PM9A3 U.2: 6.5 GB/s read)
GEN4_WRITE = 3.5e9  # per drive, sustained sequential write of the same class (PM9A3: 3.5 GB/s)
H100_H2D = 50e9  # host-to-device copy rate, PCIe Gen5 x16 with pinned memory
MIX_DRIVE = 6e9  # per drive, write and read: a fast datacenter NVMe, round figure for the mix
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
        lines += ["", f"{label}:"] + table_lines(out)
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


def mix_projections(drives: Sequence[int] = (1, 2, 4), rate: float = MIX_DRIVE) -> list[dict]:
    """The chooser's mix (NOTE [Planner mix] in tba/plan/mix.py) for the 7B Llama on an H100 at
    micro-batch 1 with tba's defaults, per drive count at ``rate`` bytes/s each way. Its local
    search over 32 blocks takes minutes per row, so `--projections` leaves it out."""
    shape = ModelShape(batch=1, **LLAMA_7B)
    rows = []
    for n in drives:
        hw = Hardware(rate, rate, drives=n, flops=H100_FLOPS)
        rows.append(
            {
                "drives": n,
                "drive_gbps": rate / GB,
                **make_mix(workload_from_shape(shape, hw), hw, Knobs()),
            }
        )
    return rows


def render_mix_projections(rows: list[dict[str, Any]]) -> str:
    """The mix projections as a table, with what they assume; projections, not measurements."""
    head = ["drives", "GB/s each", "mix", "step/keep-all", "peak/keep-all", "saved vs keep-all",
            "vs checkpoint-all", "budget"]  # fmt: skip
    out = [head]
    for r in rows:
        out.append(
            [
                str(r["drives"]),
                f"{r['drive_gbps']:g}",
                runs_text(r["runs"]),
                f"{r['step_vs_keep_all']:.3f}",
                f"{r['peak_vs_keep_all']:.3f}",
                saved_text(r, "keep_all"),
                saved_text(r, "checkpoint_all"),
                "met" if r["fits"] else "NOT met",
            ]
        )
    r0 = rows[0]
    ckpt = "; ".join(
        f"{r['drives']} drive(s) {r['checkpoint_all']['step_seconds'] * 1e3:.1f} ms, "
        f"{format_size(r['checkpoint_all']['peak_bytes'])}"
        for r in rows
    )
    return "\n".join(
        [
            "Projections, not measurements: the chooser of TBA_POLICY=auto (tba.decide.chooser, a "
            "local search over the 32 blocks) on the 7B Llama shape at micro-batch 1 and "
            f"{H100_FLOPS / 1e12:.0f} TFLOP/s (assumptions as in --projections), drives striped, "
            f"write and read at the rate given each; budget {r0['budget_source']}; peaks are "
            "resident saved bytes.",
            "",
            *table_lines(out),
            "",
            f"keep-all: {r0['keep_all']['step_seconds'] * 1e3:.0f} ms, "
            f"{format_size(r0['keep_all']['peak_bytes'])}; checkpoint-all (every block "
            f"recomputed, the head then offloaded, so the drives count): {ckpt}.",
        ]
    )
