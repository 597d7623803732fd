"""`tba plan` with the host tier (--host-tier, --host-tier-gbps): the simulation's Tiers rule,
and the recommendation with the tier beside the one without it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tba import cli
from tba import plan as P

MiB = 1 << 20
W1 = P.ModelShape(layers=6, hidden=512, heads=8, seq=512, batch=8, dtype_bytes=4, vocab=256)


def w1(hw: P.Hardware) -> P.Workload:
    return P.workload_from_shape(W1, dataclasses.replace(hw, layer_fwd_seconds=0.15))


def test_a_tier_that_holds_the_step_takes_every_byte_and_hides_a_slow_disk():
    slow = P.Hardware(30e6, 30e6)  # a disk far too slow for W1's layers
    tiered = dataclasses.replace(slow, host_tier_bytes=64 << 30)
    w = w1(slow)
    disk = P.simulate(w, slow, P.Knobs(), 0, steps=1)
    host = P.simulate(w, tiered, P.Knobs(), 0, steps=1)
    assert disk.ssd_bytes_written == disk.bytes_written > 0 and disk.host_bytes_written == 0
    assert disk.staging_full_bytes > 0  # the disk cannot drain staging: tensors stay on the GPU
    assert host.ssd_bytes_written == 0 and host.host_bytes_written == host.bytes_written
    assert host.staging_full_bytes == 0
    assert host.bytes_written == disk.bytes_written + disk.staging_full_bytes
    assert host.spill_groups == 0 and host.peak_host_tier_bytes > 0
    assert host.stall_seconds == 0.0 and host.step_seconds < disk.step_seconds
    assert host.peak_device_bytes < disk.peak_device_bytes


def test_a_short_tier_sends_the_earliest_layers_to_disk():
    hw = P.Hardware(300e6, 300e6)
    w = w1(hw)
    whole = P.simulate(w, dataclasses.replace(hw, host_tier_bytes=64 << 30), P.Knobs(), 0, 1)
    cap = whole.host_bytes_written // 2
    half = P.simulate(w, dataclasses.replace(hw, host_tier_bytes=cap), P.Knobs(), 0, 1)
    assert half.spill_groups > 0
    assert 0 < half.peak_host_tier_bytes <= cap
    moved = half.ssd_bytes_written + half.host_bytes_written
    assert moved == half.bytes_written and half.ssd_bytes_written > 0
    assert moved + half.staging_full_bytes == whole.bytes_written + whole.staging_full_bytes


def test_the_plan_shows_the_tier_beside_disk_only():
    hw = P.Hardware(30e6, 30e6, host_tier_bytes=64 << 30, host_tier_bps=50e9)
    p = P.make_plan(w1(hw), hw, P.Knobs(), steps=1, with_needed=False)
    t = p["host_tier"]
    assert t["host_tier_bytes"] == 64 << 30 and t["host_tier_bps"] == 50e9
    assert t["with"]["ssd_bytes_written"] == 0 and t["without"]["host_bytes_written"] == 0
    assert t["with"]["step_seconds"] <= t["without"]["step_seconds"]
    assert t["step_vs_without"] == pytest.approx(
        t["with"]["step_seconds"] / t["without"]["step_seconds"]
    )
    assert "host_tier" not in P.make_plan(
        w1(hw), dataclasses.replace(hw, host_tier_bytes=None), P.Knobs(), steps=1, with_needed=False
    )


SHAPE = "plan --layers 4 --hidden 256 --heads 4 --seq 256 --batch 2 --dtype bf16 --flops 1e12"
SHAPE = [*SHAPE.split(), "--write-gbps", "0.05", "--read-gbps", "0.05"]


def test_cli_flags_and_text(capsys):
    assert cli.main([*SHAPE, "--host-tier", "1GiB", "--host-tier-gbps", "50", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "host tier: 1.0 GiB of pinned memory at 50 GB/s" in out
    assert "disk only" in out and "disk-first blocks" in out
    assert cli.main([*SHAPE, "--host-tier", "1GiB", "--json", "--steps", "1"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["hardware"]["host_tier_bytes"] == 1 << 30 and p["host_tier"]["with"]["keep"] >= 0


def test_cli_refuses_a_bad_rate(capsys):
    assert cli.main([*SHAPE, "--host-tier", "1GiB", "--host-tier-gbps", "0"]) == 2
    assert "--host-tier-gbps" in capsys.readouterr().err
