"""``tba bench``: the memory timeline of one step, with and without tba, on a tiny model."""

from __future__ import annotations

import csv
import os
import sys

import pytest
import torch

from tba import bench, cli

# 4 blocks, H=128, S=128, batch 4: each block saves a few MiB, so with the small offload
# threshold, one kept block and a 1 MiB read-ahead tba holds well under the baseline.
TINY = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "128", "--batch", "4"]


@pytest.fixture
def tba_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("TBA_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TBA_KEEP_LAST", "1")
    monkeypatch.setenv("TBA_MIN_OFFLOAD_BYTES", "64KiB")
    monkeypatch.setenv("TBA_PREFETCH_BYTES", "1MiB")
    monkeypatch.setenv("TBA_STAGING_BYTES", "16MiB")
    monkeypatch.setenv("TBA_SLAB_BYTES", "16MiB")
    monkeypatch.setenv("TBA_MIN_FREE_BYTES", "0")
    return ["--spill-dir", str(tmp_path / "spill")]


def read_csv(path) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            kinds = out.setdefault(row["mode"], {})
            sec = float(row["seconds"]) if row["seconds"] else None
            val = int(row["bytes"]) if row["bytes"] else None
            kinds.setdefault(row["kind"], []).append((sec, val))
    return out


def test_csv_timeline_is_sane(tba_env, tmp_path, capsys):
    path = tmp_path / "t.csv"
    assert cli.main(["bench", *TINY, *tba_env, "--csv", str(path)]) == 0
    data = read_csv(path)
    assert set(data) == {"none", "tba"}
    peaks, saved = {}, {}
    for mode, kinds in data.items():
        fwd = kinds["forward_end"][0][0]
        bwd = kinds["backward_end"][0][0]
        assert 0 < fwd < bwd
        samples = kinds["saved"]
        assert len(samples) >= 3
        assert all(s >= 0 for s, _ in samples)
        assert [s for s, _ in samples] == sorted(s for s, _ in samples)
        assert samples[-1][1] == 0, f"{mode}: saved tensors still resident after backward"
        peaks[mode] = max(v for _, v in samples)
        saved[mode] = kinds["saved_bytes"][0][1]
    # both count unique storages, parameters excluded: the same bytes
    assert saved["none"] == pytest.approx(saved["tba"], rel=0.01)
    # without offload every saved tensor lives until backward: the peak is saved_bytes
    assert peaks["none"] == pytest.approx(saved["none"], rel=0.02)
    assert peaks["tba"] < 0.7 * peaks["none"]
    out = capsys.readouterr().out
    assert "peak resident" in out and "saved_bytes" in out and "tba peak / baseline peak" in out


def test_plot_without_matplotlib_exits_2_with_the_hint(tba_env, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    png = tmp_path / "t.png"
    assert cli.main(["bench", *TINY, *tba_env, "--plot", str(png)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "pip install 'tba[plot]'" in err
    assert not png.exists()


def test_plot_writes_a_png(tba_env, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    csv_path = tmp_path / "t.csv"
    argv = ["bench", *TINY, *tba_env, "--steps", "1", "--plot", str(png), "--csv", str(csv_path)]
    assert cli.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    assert csv_path.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--hidden", "100", "--heads", "8"],  # not a multiple
        ["--batch", "0"],
        ["--interval-ms", "0"],
        ["--layers", "x"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert cli.main(["bench", *argv]) == cli.EXIT_USAGE


def test_meter_counts_each_storage_once_and_releases_it():
    lin = torch.nn.Linear(64, 64)
    meter = bench.SavedTensorMeter(lin)
    meter.reset()
    x = torch.randn(32, 64)
    with meter.hooks():
        h = lin(x).relu()  # saves x (not a parameter) and relu's output; lin.weight is excluded
        q, k = h.split(32, dim=1)  # two views of one storage, each saved by mul
        loss = (q * k).sum()
    meter.flush()
    assert meter.resident == x.nbytes + h.nbytes
    assert meter.saved_bytes == x.nbytes + h.nbytes
    del h, q, k
    loss.backward()
    del loss
    meter.flush()
    assert meter.resident == 0
    assert meter.events[-1][1] == 0
    times = [t for t, _ in meter.events]
    assert times == sorted(times)
