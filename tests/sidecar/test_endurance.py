"""SSD endurance: the rate window, the projection, and the devices found under a path."""

from __future__ import annotations

import math
import os

import pytest

from tba.sidecar import endurance
from tba.sidecar.endurance import RateWindow, days_left


def test_rate_over_the_window():
    w = RateWindow(window=10)
    assert w.rate() is None  # one sample is not a rate
    for t in range(0, 31):
        w.add(float(t), 100.0 * t)
    assert w.span() == 10 and w.rate() == 100.0  # only the last 10 s (plus the edge sample)
    assert len(w.samples) == 11


def test_a_drop_is_a_reset_not_a_negative_rate():
    w = RateWindow(window=100)
    for t, v in [(0, 1000), (1, 1500), (2, 200), (3, 700)]:  # reboot (or new files) at t=2
        w.add(float(t), float(v))
    assert w.increase() == 500 + 200 + 500
    assert w.rate() == 400.0


def test_days_left_arithmetic():
    tb = 1e12
    # 3500 TBW, 1000 TB written since boot, 10 TB/day: 250 days
    assert days_left(3500, 1000 * tb, 10 * tb / 86400) == pytest.approx(250)
    assert days_left(3500, 0, 0) == math.inf  # nothing written: no end in sight
    assert days_left(1, 5 * tb, 1e9) == 0.0  # past the rating


def test_docs_endurance_table_matches_the_arithmetic():
    """docs/observability.md's W1 figures ("SSD endurance") come from this arithmetic (789 MiB
    per step)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "observability.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("\n## SSD endurance\n") :]
    per_step = 789 * 2**20
    for step_s in (4.0, 1.0, 0.25):
        per_day = per_step * 86400 / step_s
        week_tb = per_day * 7 / 1e12
        assert f"{week_tb:,.0f} TB" in table, f"{step_s} s/step: {week_tb:,.0f} TB per week"
        assert f"{days_left(3500, 0, per_day / 86400):,.0f} days" in table
    # GPU speed: the drive writes flat out at 4 GB/s
    assert "| 4 GB/s | 346 TB | 2,419 TB | 69% | 10 days |" in table
    assert f"{4e9 * 86400 * 7 / 1e12:,.0f} TB" == "2,419 TB"
    assert f"{days_left(3500, 0, 4e9):,.0f} days" == "10 days"


def test_disks_for_a_real_path(tmp_path):
    disks, why = endurance.disks_for_path(str(tmp_path / "not" / "yet"))  # nearest parent
    if not disks:  # tmpfs or overlay (a container): no drive to wear, and it says so
        assert why, "no disk and no reason"
        pytest.skip(f"no block device under {tmp_path}: {why}")
    assert why == ""
    for d in disks:
        assert os.path.exists(f"/sys/block/{d}/stat")
        assert endurance.disk_of(f"/dev/{d}") == d
        assert endurance.sectors_written_bytes(d) % 512 == 0


def test_not_a_block_device():
    disks, why = endurance.disks_for_path("/proc/self")
    assert disks == [] and "is not on a block device (tmpfs, overlay or a network" in why
