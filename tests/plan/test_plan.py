"""`tba plan`: formulas by hand, the simulator on toy cases, the trace reader, the command."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tba import cli
from tba import plan as P
from tba.decide.adaptive import read_ahead

MiB = 1 << 20
INF = P.Hardware(None, None, device="cpu")


def toy(blocks=2, tensors=(4 * MiB,) * 4, fwd=1.0, bwd=2.0, head=0, use_at=None):
    """``blocks`` groups of equal tensors packed evenly, and an optional kept-after head."""
    n = len(tensors)
    groups = []
    for i in range(blocks):
        saved = [
            P.Saved(
                f"b{i}.{j}",
                b,
                (j + 1) / (n + 1),
                1 - (j + 1) / (n + 1) if use_at is None else use_at,
            )
            for j, b in enumerate(tensors)
        ]
        groups.append(P.Group(f"b{i}", fwd, bwd, saved, True, tensors[0]))
    if head:
        groups.append(P.Group("head", 0.1, 0.2, [P.Saved("h", head, 0.5, 0.5)], False))
    return P.Workload(groups, "toy")


# -- formulas --------------------------------------------------------------------------------------
def big(m: P.ModelShape) -> int:
    """Per-layer bytes without the small fp32 norm statistics and logsumexp."""
    return sum(x.nbytes for x in P.layer_tensors(m) if not x.name.endswith((".stats", ".lse")))


def test_korthikanti_closed_form_by_hand():
    s, b, h, a = 2048, 1, 4096, 32
    m = P.ModelShape(layers=1, hidden=h, heads=a, seq=s, batch=b, attention="explicit")
    assert P.korthikanti_bytes(m) == s * b * h * (34 + 5 * a * s / h)  # t=1: sbh(34 + 5as/h)
    m2 = dataclasses.replace(m, tp=8)
    assert P.korthikanti_bytes(m2) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    m3 = dataclasses.replace(m2, sequence_parallel=True)
    assert P.korthikanti_bytes(m3) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / 8)
    flash = dataclasses.replace(m, attention="flash")
    assert P.korthikanti_bytes(flash) == s * b * h * 34 + 4 * a * s * b


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (4, True)])
@pytest.mark.parametrize("attention", ["explicit", "flash"])
def test_tensor_list_is_korthikanti_with_dropout(tp, sp, attention):
    m = P.ModelShape(
        layers=1, hidden=1024, heads=16, seq=512, batch=2, tp=tp, attention=attention,
        dropout=True, sequence_parallel=sp,
    )  # fmt: skip
    lse = 4 * 16 * 512 * 2 // tp if attention == "flash" else 0
    assert big(m) + lse == pytest.approx(P.korthikanti_bytes(m), abs=4)


def test_w1_bytes_match_what_tba_measures():
    # W1: 6 blocks, H=512, 8 heads, S=512, micro-batch 8, fp32, SDPA, vocab 256, no dropout.
    m = P.ModelShape(layers=6, hidden=512, heads=8, seq=512, batch=8, dtype_bytes=4, vocab=256)
    T = 8 * 512
    block = 16 * 4 * T * 512 + 2 * 8 * T + 4 * 8 * 8 * 512  # 16dTh + LN stats + logsumexp
    assert P.layer_bytes(m) == block
    head = 2 * 4 * T * 512 + 8 * T + 4 * T * 256 + 8 * T  # lnf in/out, stats, log-softmax, targets
    w = P.workload_from_shape(m, P.Hardware(None, None, flops=1e12))
    assert w.total_bytes == 6 * block + head + 8 * T  # + token ids
    # tba's saved_bytes for W1 is 827,559,940: this + the position ids (4 KiB) + the 4-byte loss
    assert w.total_bytes + 4096 + 4 == 827_559_940


def test_llama_bytes_and_flops_by_hand():
    m = P.ModelShape(layers=1, hidden=4096, heads=32, seq=4096, arch="llama")
    T, h, r = 4096, 4096, 11008 / 4096
    expect = (2 * 8 + 2 * 4 * r) * T * h + 2 * 4 * T + 4 * 32 * 4096
    assert P.layer_bytes(m) == pytest.approx(expect, abs=8)
    flops = 2 * T * h * 3 * h + 4 * 4096**2 * h + 2 * T * h * h + 3 * 2 * T * h * r * h
    assert P.layer_flops(m) == pytest.approx(flops)
    gpt = P.ModelShape(layers=1, hidden=h, heads=32, seq=2048)
    assert P.layer_flops(gpt) == pytest.approx(24 * 2048 * h * h + 4 * 2048**2 * h)


def test_pack_and_use_order_inside_a_layer():
    t = {x.name: x for x in P.layer_tensors(P.ModelShape(layers=1, hidden=64, heads=4, seq=64))}
    assert t["ln1.in"].pack_at == 0 and t["ln1.in"].use_at == pytest.approx(1 - 0.1 / 3)
    assert t["fc2.in"].use_at == 0  # fc2 is the last op: its input is needed first
    assert t["q,k,v"].pack_at < t["attn.out"].pack_at < t["act.in"].pack_at
    assert t["act.in"].use_at > t["fc2.in"].use_at


# -- the simulator ---------------------------------------------------------------------------------
def test_infinite_bandwidth_no_stall_step_is_compute():
    w = toy(blocks=3, head=2 * MiB)
    for k in range(4):
        r = P.simulate(w, INF, P.Knobs(), k)
        assert r.stall_seconds == 0 and r.sync_loads == 0
        assert r.step_seconds == pytest.approx(w.compute_seconds)
        head = 2 * MiB if k == 0 else 0  # the head is kept with the last block, from K=1
        assert r.bytes_read == r.bytes_written == (3 - k) * 16 * MiB + head
    # K=1: the last block and the head stay; the read-ahead window is charged at forward end.
    # With reads infinitely fast it is two tensors, one consumed while the next is read (NOTE
    # [Prefetch depth]): here 8 MiB.
    r = P.simulate(w, INF, P.Knobs(prefetch_bytes=16 * MiB), 1)
    assert r.peak_resident_bytes == 16 * MiB + 2 * MiB + 8 * MiB


def test_peak_formula_by_hand():
    w = toy(blocks=3, head=2 * MiB)  # blocks of 16 MiB
    kn = P.Knobs(staging_bytes=8 * MiB, prefetch_bytes=4 * MiB)
    assert P.peak_formula(w, kn, 1) == 16 * MiB + 2 * MiB + 8 * MiB + 4 * MiB
    assert P.peak_formula(w, kn, 3) == 48 * MiB + 2 * MiB  # nothing left to offload


def test_zero_ish_bandwidth_everything_resident_or_staged():
    w = toy(blocks=3)
    slow = P.Hardware(1.0, 1.0, device="cpu")  # 1 B/s: no write ever completes
    kn = P.Knobs(staging_bytes=8 * MiB)
    r = P.simulate(w, slow, kn, 0)
    assert r.bytes_written == 8 * MiB  # what staging took; nothing is read back
    assert r.staging_full_bytes == 40 * MiB and r.bytes_read == 0
    assert r.served_from_staging == 8 * MiB and r.stall_seconds == 0  # copied out of staging
    assert r.step_seconds == pytest.approx(w.compute_seconds)
    assert r.peak_resident_bytes == 48 * MiB  # keep-all's peak: nothing left memory


def test_staging_full_keeps_instead_of_waiting():
    # one block, 4 x 4 MiB packed at 0.2, 0.4, 0.6, 0.8 s; writes at 8 MiB/s (0.5 s each);
    # staging 8 MiB. #1 done at 0.7; #2 queued behind it, done at 1.2; #3 at 0.6 finds #1 and
    # #2 in staging: kept; #4 at 0.8: #1 is done, so it is staged and written by 1.7.
    w = toy(blocks=1)
    hw = P.Hardware(8 * MiB, None, device="cpu")
    r = P.simulate(w, hw, P.Knobs(staging_bytes=8 * MiB), 0)
    assert r.staging_full_bytes == 4 * MiB
    assert r.bytes_written == 12 * MiB
    assert r.forward_seconds == pytest.approx(1.0)  # the forward never waits
    assert r.writes_done_at == pytest.approx(1.7)


def test_tensor_larger_than_staging_is_never_offloaded():
    w = toy(blocks=2, tensors=(32 * MiB,))
    r = P.simulate(w, INF, P.Knobs(staging_bytes=16 * MiB), 0)
    assert r.bytes_written == 0 and r.staging_full_bytes == 64 * MiB
    p = P.make_plan(w, INF, P.Knobs(staging_bytes=16 * MiB), steps=1, with_needed=False)
    assert p["over_staging"]["tensors_per_layer"] == 1


def test_prefetch_budget_serialises_reads():
    # block 0 offloaded (4 x 4 MiB, all needed at the start of its backward), block 1 kept
    # with 1 s of backward first. Reads at 16 MiB/s: 0.25 s each.
    w = toy(blocks=2, fwd=1.0, bwd=1.0, use_at=0.0)
    w.groups[0].bwd = 0.0
    hw = P.Hardware(None, 16 * MiB, device="cpu")
    wide = P.simulate(w, hw, P.Knobs(prefetch_bytes=16 * MiB), 1)
    assert wide.stall_seconds == pytest.approx(0.0)  # all 4 read during block 1's backward
    narrow = P.simulate(w, hw, P.Knobs(prefetch_bytes=4 * MiB), 1)
    # one read ahead: the first is ready; each next one is issued at the previous use
    assert narrow.stall_seconds == pytest.approx(0.75)
    assert narrow.step_seconds == pytest.approx(w.compute_seconds + 0.75)
    assert narrow.sync_loads == 0


def test_shared_disk_queues_reads_behind_writes():
    w = toy(blocks=4, fwd=0.1, bwd=0.2)
    full = P.Hardware(64 * MiB, 64 * MiB, device="cpu")
    shared = dataclasses.replace(full, duplex="shared")
    for k in (0, 1, 2):
        a = P.simulate(w, full, P.Knobs(), k)
        b = P.simulate(w, shared, P.Knobs(), k)
        assert b.step_seconds >= a.step_seconds - 1e-12


def test_capture_and_h2d_copies_add_to_the_step():
    w = toy(blocks=2)
    r = P.simulate(
        w, dataclasses.replace(INF, capture_bps=16 * MiB, h2d_bps=32 * MiB), P.Knobs(), 0
    )
    # 32 MiB captured at 16 MiB/s (2 s) and 32 MiB brought back at 32 MiB/s (1 s)
    assert r.step_seconds == pytest.approx(w.compute_seconds + 3.0)


W1 = P.ModelShape(layers=6, hidden=512, heads=8, seq=512, batch=8, dtype_bytes=4, vocab=256)


def w1(hw: P.Hardware) -> P.Workload:
    return P.workload_from_shape(W1, dataclasses.replace(hw, layer_fwd_seconds=0.15))


RATES = [30e6, 100e6, 300e6, 1e9, 3e9, None]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_more_read_bandwidth_never_slower_beyond_the_windows_slack(k):
    # More read bandwidth shrinks the read-ahead window (NOTE [Prefetch depth]), which trades
    # a little slack for memory: a step may get slower, but by less than 1% of compute.
    kn = P.Knobs()
    prev = None
    for rate in RATES:
        hw = P.Hardware(300e6, rate, device="cpu", capture_bps=5e9)
        w = P.workload_from_shape(W1, dataclasses.replace(hw, layer_fwd_seconds=0.15))
        r = P.simulate(w, hw, kn, k)
        if prev is not None:
            assert r.step_seconds <= prev + 0.01 * w.compute_seconds
        prev = r.step_seconds


def test_more_bandwidth_never_slower_for_the_best_k():
    # With K fixed, more write bandwidth can be slower: staging frees sooner, more is
    # offloaded, and more must be read back. Over K, the best step never gets worse.
    prev = None
    for rate in RATES:
        hw = P.Hardware(rate, rate, device="cpu", capture_bps=5e9)
        w = w1(hw)
        best = min(P.simulate(w, hw, P.Knobs(), k, steps=0).step_seconds for k in range(7))
        if prev is not None:
            assert best <= prev + 1e-9
        prev = best


@pytest.mark.parametrize("rate", [100e6, 300e6, 2e9])
def test_larger_k_never_more_traffic(rate):
    # Writes never grow with K, nor do the bytes brought back (read, or copied out of staging
    # when a write still runs). Reads alone can: a larger K changes the window, and with it
    # which tensors are still in staging when backward wants them.
    hw = P.Hardware(rate, rate, device="cpu", capture_bps=5e9)
    w = w1(hw)
    for steps in (1, 0):
        rs = [P.simulate(w, hw, P.Knobs(), k, steps=steps) for k in range(7)]
        for a, b in zip(rs, rs[1:]):
            assert b.bytes_written <= a.bytes_written
            back_a = a.bytes_read + a.served_from_staging
            assert b.bytes_read + b.served_from_staging <= back_a


def test_w1_peak_is_the_kept_block_plus_the_window():
    hw = P.Hardware(2e9, 2e9, device="cpu", capture_bps=5e9)
    r = P.simulate(w1(hw), hw, P.Knobs(), 1)
    # block 5 + head + token ids + the small tensors of blocks 0-4 + the read-ahead window:
    # the largest tensor (32 MiB, the MLP's 4H activation) plus what backward consumes while
    # it is read, twice over (NOTE [Prefetch depth])
    block, small = 134_414_336, 2 * 8 * 4096 + 4 * 8 * 8 * 512
    head = 2 * 4 * 4096 * 512 + 8 * 4096 + 4 * 4096 * 256 + 8 * 4096
    offloaded = r.bytes_written
    consume = offloaded / sum(g.bwd for g in w1(hw).groups)
    window = read_ahead(32 * MiB, consume, 2e9, 128 * MiB)[0]
    assert 32 * MiB < window < 128 * MiB
    kept = block + head + 8 * 4096 + 5 * small
    assert kept + 32 * MiB <= r.peak_resident_bytes <= kept + window
    assert r.stall_seconds == 0


def test_steady_state_carries_unfinished_writes():
    w = toy(blocks=4, fwd=0.1, bwd=0.2)
    hw = P.Hardware(20 * MiB, 1e12, device="cpu")
    kn = P.Knobs(staging_bytes=24 * MiB)
    one = P.simulate(w, hw, kn, 1, steps=1)
    steady = P.simulate(w, hw, kn, 1, steps=0)
    assert steady.steps > 1
    assert steady.bytes_written < one.bytes_written  # staging still holds the last step's bytes


def test_steady_state_offloads_what_the_disk_writes_per_step():
    # 48 MiB offloadable per step (K=1), 1.2 s steps, writes at 20 MiB/s: the backlog grows
    # until staging is full of it, then each step offloads about what the disk writes in one
    w = toy(blocks=4, fwd=0.1, bwd=0.2)
    hw = P.Hardware(20 * MiB, None, device="cpu")
    r = P.simulate(w, hw, P.Knobs(staging_bytes=64 * MiB), 1, steps=0)
    assert r.step_seconds == pytest.approx(1.2)
    assert abs(r.bytes_written - 24 * MiB) <= 4 * MiB
    assert r.staging_full_bytes == 48 * MiB - r.bytes_written


def test_recommendation_rule():
    def res(k, t, peak):
        return P.SimResult(k, t, 0, 0, 0, 0, peak, peak, 0, 0, 0, 0, 0, 0, 0)

    rs = [res(0, 1.10, 10), res(1, 1.02, 20), res(2, 1.00, 30), res(3, 1.00, 40)]
    assert P.recommend(rs, "cpu").keep == 1  # within 3% of 1.00, smallest peak
    rs = [res(0, 1.0, 10), res(1, 1.0, 10)]
    assert P.recommend(rs, "cpu").keep == 1  # a tie goes to less disk traffic


def test_needed_bandwidth_is_a_threshold():
    hw = P.Hardware(1e9, 1e9, device="cpu")
    w = w1(hw)
    got = P.needed_gbps(w, hw, P.Knobs(), keep=1)
    assert got is not None and 0.05 < got < 5
    ideal = P.simulate(w, P.Hardware(None, None, device="cpu"), P.Knobs(), 1)
    at = P.simulate(w, hw.scaled(got), P.Knobs(), 1, steps=0)
    assert at.step_seconds <= 1.03 * w.compute_seconds
    assert at.peak_resident_bytes <= ideal.peak_resident_bytes + 0.05 * w.total_bytes
    below = P.simulate(w, hw.scaled(got / 1.5), P.Knobs(), 1, steps=0)
    assert (
        below.step_seconds > 1.03 * w.compute_seconds
        or below.peak_resident_bytes > ideal.peak_resident_bytes + 0.05 * w.total_bytes
    )


def test_recompute_estimate():
    w = toy(blocks=3, fwd=1.0, bwd=2.0, head=2 * MiB)
    t, mem = P.recompute_estimate(w)
    assert t == pytest.approx(w.compute_seconds + 3.0)  # one more forward of every block
    # block 2 recomputed (16 MiB, its input included) with the inputs of blocks 0 and 1
    assert mem == 2 * 4 * MiB + 16 * MiB


# -- the trace reader ------------------------------------------------------------------------------
def fake_trace(path, steps=3):
    """tba's trace format: blocks are odd groups; group 5 is the head; block 2 (group 3) kept.
    q/k/v-style views count the storage once per view in packed/kept/keepable."""
    lines = [
        {"type": "meta", "version": 1, "pid": 1, "backend": "native", "future_key": [1, 2],
         "config": {"staging_bytes": 64 * MiB, "prefetch_bytes": 32 * MiB, "keep_last": 1,
                    "min_offload_bytes": MiB}},
    ]  # fmt: skip
    for s in range(1, steps + 1):
        slow = 5.0 if s == 1 else 1.0  # the first step is left out of the medians
        groups = [
            (0, False, 40_000, 0, 40_000, 0, 0.01, 0.02),
            (1, False, 12 * MiB, 8 * MiB, 64 << 10, 0, 0.5 * slow, 1.0 + 0.1 * s),
            (2, False, 0, 0, 0, 0, 0.0, 0.0),
            (3, True, 12 * MiB, 0, 12 * MiB, 12 * MiB - (64 << 10), 0.5, 1.0),
            (4, True, 3 * MiB, 0, 3 * MiB, 3 * MiB, 0.05, 0.1),
        ]
        for g, kept, packed, off, kb, keepable, f, b in groups:
            lines.append(
                {"type": "group", "step": s, "group": g, "kept": kept, "tensors": 5,
                 "packed_bytes": packed, "offloaded_bytes": off, "kept_bytes": kb,
                 "keepable_bytes": keepable, "fwd_seconds": f, "bwd_seconds": b,
                 "write_seconds": 0.1, "read_seconds": 0.1, "stall_seconds": 0.0,
                 "sync_loads": 0, "new_key": "ignored"}
            )  # fmt: skip
        lines.append(
            {"type": "step", "step": s, "forward_seconds": 1.0, "backward_seconds": 2.0,
             "step_seconds": 3.0 + s, "saved_bytes": 1, "peak_resident_bytes": 20 * MiB,
             "bytes_offloaded": 8 * MiB, "bytes_reloaded": 8 * MiB, "stall_seconds": 0.0,
             "write_bps": 1e9 * s, "read_bps": 2e9, "keep_last": 1, "keep_decision": {}}
        )  # fmt: skip
        lines.append({"type": "something_new", "x": 1})
    with open(path, "w") as f:
        for rec in lines:
            f.write(json.dumps(rec) + "\n")
        f.write("\n")
    return str(path)


def test_trace_reader_medians_and_bytes(tmp_path):
    w, info = P.read_trace(fake_trace(tmp_path / "t.jsonl"))
    assert [g.block for g in w.groups] == [False, True, False, True, False]
    assert w.blocks == 2
    g1, g3 = w.groups[1], w.groups[3]
    assert g1.fwd == 0.5  # median of steps 2 and 3; step 1 (5x slower) is left out
    assert g1.bwd == pytest.approx(1.25)
    small = lambda g: sum(x.nbytes for x in g.saved if x.small)  # noqa: E731
    offl = lambda g: sum(x.nbytes for x in g.saved if not x.small)  # noqa: E731
    assert offl(g1) == 8 * MiB and small(g1) == 64 << 10
    # the kept block: keepable counts views; the unique share from block 1 is 8/(12-1/16)
    assert small(g3) == 64 << 10
    assert offl(g3) == pytest.approx((12 * MiB - (64 << 10)) * 8 / (12 - 1 / 16), abs=16)
    assert offl(w.groups[4]) == 3 * MiB  # not a block: taken as it is
    assert info.write_bps == 2.5e9 and info.read_bps == 2e9 and info.keep_last == 1
    assert info.config["staging_bytes"] == 64 * MiB and info.steps == 3


def test_trace_reader_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "meta", "version": 1}\nnot json\n')
    with pytest.raises(P.PlanInputError, match="--trace: .* line 2 is not JSON"):
        P.read_trace(str(bad))
    bad.write_text('{"type": "meta", "version": 2}\n')
    with pytest.raises(P.PlanInputError, match="version 2"):
        P.read_trace(str(bad))
    bad.write_text('{"type": "meta", "version": 1}\n')
    with pytest.raises(P.PlanInputError, match="no group records"):
        P.read_trace(str(bad))
    with pytest.raises(P.PlanInputError, match="cannot read"):
        P.read_trace(str(tmp_path / "missing.jsonl"))


# -- the command -----------------------------------------------------------------------------------
SHAPE = "plan --layers 4 --hidden 256 --heads 4 --seq 256 --batch 2 --dtype bf16 --flops 1e12"
SHAPE = [*SHAPE.split(), "--write-gbps", "0.5", "--read-gbps", "1"]


def test_cli_json_keys(capsys):
    assert cli.main([*SHAPE, "--json", "--steps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = "per_layer_bytes per_step_bytes required_write_gbps required_read_gbps table"
    keys += " recommended rok needed_gbps_keep_1 knobs hardware"
    for key in keys.split():
        assert key in out
    assert [r["keep"] for r in out["table"]] == [0, 1, 2, 3, 4]
    for key in ("step_seconds", "stall_seconds", "peak_resident_bytes", "peak_device_bytes",
                "bytes_written", "staging_full_bytes"):  # fmt: skip
        assert key in out["table"][0]
    assert set(out["rok"]) == {"keep_all", "offload", "recompute"}
    assert out["recommended"]["keep"] in range(5)


def test_cli_text(capsys):
    assert cli.main([*SHAPE, "--drives", "2", "--prefetch", "8MiB", "--device-mem", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "recommended: TBA_KEEP_LAST=" in out and "recompute per block" in out
    assert "x 2 drives" in out and "prefetch 8.0 MiB" in out


def test_cli_trace(tmp_path, capsys):
    path = fake_trace(tmp_path / "t.jsonl")
    assert cli.main(["plan", "--trace", path, "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["knobs"]["staging_bytes"] == 64 * MiB and out["blocks"] == 2
    assert out["hardware"]["write_bps"] == 2.5e9
    assert cli.main(["plan", "--trace", path, "--write-gbps", "0.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["write_bps"] == 0.1e9


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--heads", "5"], "--heads: must divide --hidden"),
        (["--hidden", "abc"], "argument --hidden: 'abc' is invalid; expected a whole number >= 1"),
        (
            ["--dtype", "int4"],
            "argument --dtype: 'int4' is invalid; expected one of fp32|bf16|fp16|fp8",
        ),
        (["--write-gbps", "0"], "argument --write-gbps: '0' is invalid; expected a number above 0"),
        (["--prefetch", "lots"], "argument --prefetch: 'lots' is invalid; expected a size"),
        (["--attention", "sparse"], "argument --attention: invalid choice"),
        (["--tp", "3"], "--tp: must divide --heads"),
    ],
)
def test_cli_bad_input_exit_2(capsys, argv, words):
    args = list(SHAPE)
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert cli.main(args) == 2
    assert words in capsys.readouterr().err


def test_cli_missing_and_conflicting_flags(tmp_path, capsys):
    assert cli.main(["plan", "--layers", "2"]) == 2
    assert "--hidden: required" in capsys.readouterr().err
    no_rate = [a for a in SHAPE if a not in ("--write-gbps", "0.5")]
    assert cli.main(no_rate) == 2
    assert "--write-gbps: required" in capsys.readouterr().err
    no_flops = [a for a in SHAPE if a not in ("--flops", "1e12")]
    assert cli.main(no_flops) == 2
    assert "--flops: give the achieved FLOP/s" in capsys.readouterr().err
    path = fake_trace(tmp_path / "t.jsonl")
    assert cli.main(["plan", "--trace", path, "--layers", "3"]) == 2
    assert "--layers: describes a model shape" in capsys.readouterr().err


def test_projections_small():
    rows = P.projections(drives=(1,), batches=(1,), settings={"defaults": P.Knobs()})
    (r,) = rows
    assert r["per_layer_bytes"] == P.layer_bytes(P.ModelShape(batch=1, **P.LLAMA_7B))
    assert r["required_write_gbps"] == pytest.approx(
        r["per_layer_bytes"] / r["layer_forward_seconds"] / 1e9, rel=0.01
    )
    assert "recommended" in r and "needed_gbps_keep_1" in r
    text = P.render_projections(rows)
    assert "assumptions:" in text and "400 TFLOP/s" in text
