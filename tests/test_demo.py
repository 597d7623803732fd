"""`make demo` (examples/train_gpt.py) at a tiny size: the table's four rows, loss parity, the
plot, and the hint when matplotlib is missing. Step times are printed, never judged here."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ("no offload", "checkpointing", "tba (your TBA_*)", "tba (budget 0.25)")  # fixture: two


@pytest.fixture
def demo(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TBA_")]:
        monkeypatch.delenv(k)
    # At the tiny size every tensor is under the default 1 MiB: offload them all, so that the
    # parity checked below is that of tensors written and read back.
    monkeypatch.setenv("TBA_MIN_OFFLOAD_BYTES", "1")
    monkeypatch.setenv("TBA_KEEP_LAST", "0")
    spec = importlib.util.spec_from_file_location("train_gpt", f"{ROOT}/examples/train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_demo(demo, tmp_path, capsys) -> str:
    spill = tmp_path / "spill"
    spill.mkdir()
    argv = ["--tiny", "--rounds", "2", "--out", str(tmp_path / "out"), "--spill-dir", str(spill)]
    assert demo.main(argv) == 0
    assert list(spill.iterdir()) == []  # the demo's spill dir is gone
    out = capsys.readouterr().out
    assert out.startswith("machine: ")
    rows = {}
    for label in ROWS:
        (line,) = [ln for ln in out.splitlines() if ln.startswith(label + " ")]
        rows[label] = line
    for label in ROWS[2:]:
        written = re.search(r"([\d.]+) MiB$", rows[label])
        assert written and float(written.group(1)) > 0, rows  # tba moved bytes in its last step
    for label in ROWS[:2]:
        assert rows[label].endswith(" 0.0 MiB"), rows  # the others write nothing
    parity = "losses and final weights bit-identical to no offload: "
    assert f"{parity}checkpointing yes, {ROWS[2]} yes, {ROWS[3]} yes" in out
    assert re.search(r"^tba \(budget 0.25\): [\d.]+x the step of no offload, [\d.]+x", out, re.M)
    assert re.search(r"^goal (not )?met: tba with your TBA_\* took [\d.]+x the step", out, re.M)
    return out


def test_demo_prints_the_table_and_plots(demo, tmp_path, capsys):
    out = run_demo(demo, tmp_path, capsys)
    png = tmp_path / "out" / "memory.png"
    if importlib.util.find_spec("matplotlib") is None:  # not in this venv: the hint instead
        assert "no plot: matplotlib is not installed" in out and not png.exists()
        return
    assert f"memory over one step: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_without_matplotlib_says_how_to_install_it(demo, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    out = run_demo(demo, tmp_path, capsys)
    assert "no plot: matplotlib is not installed. Install it with" in out
    assert "[plot]" in out
    assert not (tmp_path / "out").exists()


def test_verdict_comes_from_the_figures(demo):
    mib = 2**20
    med = {"none": 1.0, "checkpoint": 1.3, "tba": 1.04}
    peak = {"none": 100 * mib, "checkpoint": 40 * mib, "tba": 30 * mib}
    assert demo.verdict(med, peak, None) == (
        "goal met: tba's default took 1.040x the step of no offload (within 1.05x), with a "
        "peak 10.0 MiB below checkpointing's"
    )
    slow = demo.verdict({**med, "tba": 1.2}, peak, None)
    assert slow.startswith("goal not met: tba's default took 1.200x the step of no offload (over")
    big = demo.verdict(med, {**peak, "tba": 50 * mib}, None)
    assert big.startswith("goal not met") and "a peak 10.0 MiB above checkpointing's" in big
    first = demo.verdict(med, peak, 60 * mib)
    assert first.endswith("after its first step (which peaked at 60.0 MiB)")


def test_checkpointing_is_charged_for_what_backward_recomputes(demo, tmp_path):
    import time

    from tba.testing import GPT, random_batch

    base = GPT(demo.TINY)
    x, y = random_batch(demo.TINY, demo.TINY_BATCH)
    v = demo.Variant("checkpoint", base, str(tmp_path))
    v.recorded_step(x, y, interval=0.002)
    outer = demo.SavedBytes(v.model, time.perf_counter)  # an outer hook alone: the inputs
    with outer.hooks():
        v.model(x, y).backward()
    outer.flush()
    assert 0 < outer.peak < v.trace_peak == v.peak
    batch = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    assert outer.resident == v.trace[-1][1] == batch  # all freed but the batch, held here
