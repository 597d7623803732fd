"""`tba plan`'s tables."""

from __future__ import annotations

from typing import Any

from ..config import format_size
from .inputs import GB


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
    lines.extend(table_lines(rows))
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
    lines.extend(table_lines(rows))
    if p.get("host_fits") is False:
        lines.append("warning: staging + prefetch exceed --host-mem")
    if "host_tier" in p:
        lines += [""] + host_tier_lines(p["host_tier"], dev)
    if "mix" in p:
        lines += [""] + mix_lines(p["mix"])
    return "\n".join(lines)


def host_tier_lines(t: dict[str, Any], dev: bool) -> list[str]:
    """The recommended K with the host tier and without it (NOTE [Host tier])."""
    rate = "instant" if t["host_tier_bps"] is None else f"{t['host_tier_bps'] / GB:.3g} GB/s"
    rows = [
        [
            "",
            "K",
            "step ms",
            "stall ms",
            "peak device" if dev else "peak",
            "to host",
            "to disk",
            "disk-first blocks",
        ]
    ]
    for name, key in (("host tier", "with"), ("disk only", "without")):
        r = t[key]
        rows.append(
            [
                name,
                str(r["keep"]),
                _ms(r["step_seconds"]),
                _ms(r["stall_seconds"]),
                format_size(r["peak_device_bytes"]),
                format_size(r["host_bytes_written"]),
                format_size(r["ssd_bytes_written"]),
                str(r["spill_groups"]) if key == "with" else "-",
            ]
        )
    ratio = t["step_vs_without"]
    lines = [
        f"host tier: {format_size(t['host_tier_bytes'])} of pinned memory at {rate}, in front "
        "of the disk; the earliest blocks go to disk when it is short"
        + (f" (step {ratio:.3f}x of disk only)" if ratio else "")
    ]
    return lines + table_lines(rows)


def mix_lines(m: dict[str, Any]) -> list[str]:
    """The chooser's mix (NOTE [Planner mix] in tba/plan/mix.py) against keep-all and
    checkpoint-all."""
    if not m["available"]:
        return [f"mix: not available: {m['reason']}"]
    search = "exhaustive" if m["search"] == "exhaustive" else "a local search, not exhaustive"
    lines = [
        "mix:      keep, offload, recompute or selective per block, as TBA_POLICY=auto chooses "
        "(tba.decide.chooser)",
        f"search:   {search}: {m['searched']:,} assignments simulated",
        f"model:    the runtime's: {format_size(m['staging_bytes'])} of staging (a full one "
        f"waits, as under auto), a {format_size(m['prefetch_bytes'])} read-ahead window, no "
        "copy costs",
        f"budget:   {_budget_text(m)}",
        f"blocks:   {runs_text(m['runs'])}  ({_letters(m['actions'])}, block 0 first)",
    ]
    rows = [["strategy", "step ms", "vs keep-all", "peak resident", "vs keep-all"]]
    base, top = m["keep_all"], m["keep_all"]["peak_bytes"]
    for name, x in (("keep all", base), ("checkpoint all", m["checkpoint_all"]), ("mix", m)):
        rows.append(
            [
                name,
                _ms(x["step_seconds"]),
                _share(x["step_seconds"], base["step_seconds"]),
                format_size(x["peak_bytes"]),
                _share(x["peak_bytes"], top),
            ]
        )
    lines.extend(table_lines(rows))
    lines.append(
        f"memory saved by the mix: {saved_text(m, 'keep_all')} vs keep-all, "
        f"{saved_text(m, 'checkpoint_all')} vs checkpoint-all"
    )
    return lines


def runs_text(runs: list[list[Any]]) -> str:
    """A block assignment run-length encoded: ``keep x8, recompute x23, keep x1``."""
    return ", ".join(f"{a} x{n}" for a, n in runs)


def saved_text(m: dict[str, Any], ref: str) -> str:
    """Bytes the mix saves against ``ref``'s peak (keep_all, checkpoint_all), with the share of
    that peak; a negative saving is said as more held."""
    n, base = m[f"saved_vs_{ref}_bytes"], m[ref]["peak_bytes"]
    if n < 0:
        return f"none (holds {format_size(-n)} more)"
    return format_size(n) + (f" ({n / base:.0%})" if base else "")


def _budget_text(m: dict[str, Any]) -> str:
    if m["budget_bytes"] is None:
        return f"none ({m['budget_source']}): nothing bounds memory, so keeping wins"
    text = f"{format_size(m['budget_bytes'])} of resident saved bytes ({m['budget_source']}): "
    if m["fits"]:
        return text + "met"
    found = "" if m["search"] == "exhaustive" else " that the search found"
    return text + f"NOT met: no assignment{found} fits; shown is the lowest peak"


LETTERS = {
    "keep": "k",
    "offload": "o",
    "recompute": "r",
    "recompute_offload": "s",
    "selective": "p",
}


def _letters(actions: list[str]) -> str:
    """k/o/r/s/p per block (s: recompute_offload, p: selective), in groups of 8 so that a
    block's index can be counted."""
    s = "".join(LETTERS.get(a, a[0]) for a in actions)
    return " ".join(s[i : i + 8] for i in range(0, len(s), 8))


def _share(x: float, base: float) -> str:
    return f"{x / base:.3f}" if base else "-"


def table_lines(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append("  ".join(cells))
    return out
