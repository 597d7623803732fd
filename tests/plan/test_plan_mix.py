"""`tba plan`'s mix: the runtime's chooser on the planner's workload (NOTE [Planner mix])."""

from __future__ import annotations

import json

import pytest

from tba import cli
from tba import plan as P
from tba.decide.chooser import Cost, predict
from tba.plan.mix import _selective

from .test_plan import SHAPE, fake_trace, toy

MiB = 1 << 20


def run(capsys, *extra, budget=None, text=False):
    """`tba plan` on SHAPE, through the command line (``budget``: `--budget`'s text, or None).
    Returns (exit code, the mix from --json or the text, stderr)."""
    argv = [*SHAPE, *extra, *([] if budget is None else [f"--budget={budget}"])]
    rc = cli.main([*argv, *([] if text else ["--json"])])
    out, err = capsys.readouterr()
    if rc == 0 and not text:
        out = json.loads(out)["mix"]
    return rc, out, err


# what selective keeps of a layer of SHAPE's model (GPT, fused attention, no dropout)
PRODUCTS = {"q,k,v", "act.in", "attn.out", "attn.lse"}


def by_hand(w, hw, actions, prefetch=128 * MiB):
    """The chooser's prediction for ``actions``, its groups written out here, not by tba.plan
    (selective's recompute share is the one thing taken from it)."""
    share = _selective(w.shape)[1] if w.shape is not None else 0.0
    groups = [
        Cost(
            g.fwd,
            g.bwd,
            g.nbytes,
            g.input_bytes,
            g.block,
            cached_bytes=sum(x.nbytes for x in g.saved if x.name in PRODUCTS) if g.block else None,
            selective_recompute=share * g.fwd,
        )
        for g in w.groups
    ]
    return predict(groups, actions, hw.write_rate, hw.read_rate, prefetch)


def test_json_mix_is_what_the_chooser_predicts(capsys):
    rc, m, _ = run(capsys)
    assert rc == 0 and m["available"] and m["search"] == "exhaustive"
    assert m["searched"] == 5**4  # 4 blocks: every assignment of 5 actions
    hw = P.Hardware(0.5e9, 1e9, flops=1e12)
    w = P.workload_from_shape(P.ModelShape(4, 256, 4, 256, batch=2), hw)
    got = by_hand(w, hw, m["actions"])
    assert (m["step_seconds"], m["peak_bytes"]) == (got.step_seconds, got.peak_bytes)
    ckpt = by_hand(w, hw, ["recompute"] * 4)
    assert m["checkpoint_all"] == {"step_seconds": ckpt.step_seconds, "peak_bytes": ckpt.peak_bytes}
    keep = m["keep_all"]
    assert keep["step_seconds"] == pytest.approx(w.compute_seconds)
    assert keep["peak_bytes"] == w.total_bytes
    assert m["peak_vs_keep_all"] == m["peak_bytes"] / w.total_bytes
    assert m["saved_vs_keep_all_bytes"] == w.total_bytes - m["peak_bytes"]
    assert m["saved_vs_checkpoint_all_bytes"] == ckpt.peak_bytes - m["peak_bytes"]
    assert sum(n for _, n in m["runs"]) == 4


def test_slow_disk_recomputes_and_beats_all_offload():
    """Reads at 2 MB/s: a block's 16 MiB take 8 s to come back, its forward 1 s. (Writes are
    fast here: slow writes would fill staging, and the forward wait for it, NOTE [Chooser].)"""
    w = toy(blocks=5, head=2 * MiB)
    slow = P.Hardware(1e9, 2e6, device="cpu")
    m = P.make_mix(w, slow, P.Knobs(), "0.6")  # room for the inputs and one block's saves
    assert "recompute" in m["actions"] and m["fits"]
    offload = by_hand(w, slow, ["offload"] * 5)
    assert m["step_seconds"] < offload.step_seconds
    assert m["step_vs_keep_all"] < offload.step_seconds / w.compute_seconds


def test_infinite_disk_and_room_never_recompute():
    w = toy(blocks=5, head=2 * MiB)
    for budget in ("1.0", "none"):
        m = P.make_mix(w, P.Hardware(None, None, device="cpu"), P.Knobs(), budget)
        assert "recompute" not in m["actions"]
        assert m["step_seconds"] == pytest.approx(w.compute_seconds)
        assert m["step_vs_keep_all"] == pytest.approx(1.0)


def test_unreachable_budget_says_no_assignment_fits(capsys):
    rc, m, _ = run(capsys, budget="1MiB")  # checkpoint-all alone holds more
    assert rc == 0 and m["budget_bytes"] == MiB and not m["fits"]
    assert m["peak_bytes"] > MiB
    rc, text, _ = run(capsys, budget="1MiB", text=True)
    assert "1.0 MiB of resident saved bytes (--budget 1.0 MiB): NOT met: no assignment fits" in text


def test_budget_sources(capsys):
    w = P.workload_from_shape(P.ModelShape(4, 256, 4, 256, batch=2), P.Hardware(1, 1, flops=1e12))
    _, m, _ = run(capsys)
    assert m["budget_bytes"] == int(0.35 * w.total_bytes)  # the runtime's default share
    assert "0.35 of saved bytes" in m["budget_source"]
    _, m, _ = run(capsys, "--device-mem", "3MiB")
    assert (m["budget_bytes"], m["budget_source"]) == (3 * MiB, "--device-mem")
    _, m, _ = run(capsys, "--device-mem", "3MiB", budget="50%")  # --budget wins
    assert m["budget_bytes"] == int(0.5 * w.total_bytes)
    _, m, _ = run(capsys, budget="none")
    assert m["budget_bytes"] is None and m["fits"]
    assert set(m["actions"]) == {"keep"}  # nothing bounds memory: keeping is fastest


@pytest.mark.parametrize("value", ["lots", "1.5", "0", "100", "-2GiB"])
def test_bad_budget_exit_2_names_the_flag(capsys, value):
    rc, out, err = run(capsys, budget=value)
    assert rc == 2 and out == ""
    assert err.startswith("tba plan: --budget: ") and "TBA_MEMORY_BUDGET" in err


def test_text_mix_section(capsys):
    rc, text, err = run(capsys, "--write-gbps", "1e-3", text=True)
    assert rc == 0 and err == ""  # 4 blocks: exhaustive, no note about a long search
    mix = text[text.index("\nmix: ") :]
    assert "search:   exhaustive: 625 assignments simulated" in mix
    assert "blocks:   " in mix and "recompute x" in mix
    for row in ("keep all", "checkpoint all", "mix "):
        assert f"\n{row}" in mix
    assert "vs keep-all" in mix and "vs checkpoint-all" in mix


def test_many_blocks_local_search_is_said(capsys):
    rc, m, err = run(capsys, "--layers", "8")
    assert rc == 0 and m["search"] == "local" and "local search" in err
    rc, text, _ = run(capsys, "--layers", "8", text=True)
    assert "a local search, not exhaustive" in text


def test_trace_has_no_mix(tmp_path, capsys):
    path = fake_trace(tmp_path / "t.jsonl")
    assert cli.main(["plan", "--trace", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mix"] == {
        "available": False,
        "reason": "a trace does not record block inputs",
    }
    assert cli.main(["plan", "--trace", path]) == 0
    assert "mix: not available: a trace" in capsys.readouterr().out


def test_mix_projections_table(monkeypatch, capsys):
    """The 7B rows take minutes; the routing and the table are checked on a small shape."""
    w = P.workload_from_shape(P.ModelShape(4, 256, 4, 256), P.Hardware(1, 1, flops=1e12))
    rows = [
        {"drives": n, "drive_gbps": 6.0, **P.make_mix(w, P.Hardware(6e9, 6e9, n), P.Knobs())}
        for n in (1, 2)
    ]
    monkeypatch.setattr("tba.plan.command.mix_projections", lambda: rows)
    assert cli.main(["plan", "--projections-mix"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Projections, not measurements")
    for r in rows:
        assert f"\n{r['drives']}  " in text
    assert P.render_mix_projections(rows) in text
    assert "step/keep-all" in text and "vs checkpoint-all" in text


def test_selective_is_charged_the_layer_products_and_the_rest_of_its_forward():
    """With the model's shape, a block offers selective: it keeps the saved products (what the
    runtime's probe would see) and recomputes the share of the forward that is not them."""
    hw = P.Hardware(0.5e9, 1e9, flops=1e12)
    for arch, kept in (
        ("gpt", {"q,k,v", "act.in", "attn.out", "attn.lse"}),
        ("llama", {"q,k,v", "gate.out", "up.out", "attn.out", "attn.lse"}),
    ):
        shape = P.ModelShape(4, 256, 4, 256, batch=2, arch=arch)
        w = P.workload_from_shape(shape, hw)
        groups = P.mix.costs(w)
        block = next(g for g, c in zip(w.groups, groups) if c.block)
        cost = next(c for c in groups if c.block)
        assert cost.cached_bytes == sum(x.nbytes for x in block.saved if x.name in kept)
        assert 0 < cost.cached_bytes < cost.nbytes
        assert 0 < cost.selective_recompute < 0.5 * cost.fwd
    explicit = P.ModelShape(4, 256, 4, 256, batch=2, attention="explicit")
    names, share = _selective(explicit)
    assert "attn.out" not in names and share > _selective(P.ModelShape(4, 256, 4, 256))[1]


def test_the_greedy_start_fills_the_budget_on_the_7b(monkeypatch):
    """NOTE [Chooser], the greedy start: on the 7B of BENCHMARKS.md with one drive, the bounded
    run-time search ended at recompute_offload x22, keep x10 (1.225x keep-all) while
    assignments 4% faster fit the budget; from every block recomputed, taking the changes that
    save the most seconds per byte of peak first, it reaches one of them."""
    from tba.decide import chooser
    from tba.plan.inputs import Hardware, Knobs
    from tba.plan.mix import budget_for, costs
    from tba.plan.projections import H100_FLOPS, LLAMA_7B, MIX_DRIVE
    from tba.plan.shape import ModelShape
    from tba.plan.workload import workload_from_shape

    hw = Hardware(MIX_DRIVE, MIX_DRIVE, drives=1, flops=H100_FLOPS)
    w = workload_from_shape(ModelShape(batch=1, **LLAMA_7B), hw)
    gs, knobs = costs(w), Knobs()
    limit, _ = budget_for(None, w.total_bytes, hw.device_bytes)
    disk = (hw.write_rate, hw.read_rate, knobs.prefetch_bytes, knobs.staging_bytes, True)
    keep = predict(gs, ("keep",) * w.blocks, *disk).step_seconds

    def search():
        return chooser.choose(
            gs,
            hw.write_rate,
            hw.read_rate,
            limit,
            knobs.prefetch_bytes,
            exhaustive_blocks=0,
            max_sims=chooser.SEARCH_SIMS,
            staging_bytes=knobs.staging_bytes,
            staging_waits=True,
        )

    got = search()
    assert got.fits and got.best.step_seconds < 1.2 * keep
    assert got.searched <= chooser.SEARCH_SIMS + (len(chooser.ACTIONS) - 1) * w.blocks
    monkeypatch.setattr(chooser, "_fill", lambda *a: None)  # the search as it was
    before = search()
    assert before.fits and before.best.step_seconds > 1.2 * keep
