"""torch.compile with tba (NOTE [Compiled regions] in tba/datapath/blocks/groups.py): the same
graphs as without tba, counted with dynamo's own counters, bit-identical losses and gradients, no
recompilation from step to step, per-block compiled models grouped by block, block actions
(TBA_POLICY=recompute, auto, keep) applied where tba sees the blocks and said once where it
cannot, and the combinations that cannot work refused with tba's message."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import tba
import tba.integrations
from tba.config import RECOMPUTED

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS = 3


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, h: int = 32, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
        self.head = nn.Linear(h, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _graphs() -> tuple[int, int]:
    """(graphs dynamo compiled, graph breaks) so far, from dynamo's counters."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _train(make, off=None, model_for_step=True, sync=True, rows=16, stats=None):
    """STEPS steps of a fresh model; ``make(model)`` returns what to call. Returns the losses,
    gradients, dynamo's (graphs, breaks) after the first and the last step, and the model;
    each step's ``off.stats()`` is appended to ``stats`` when given."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MLP()
    fn = make(model)
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(1))
    losses, grads, seen = [], [], []
    for _ in range(STEPS):
        if off is None:
            loss = fn(x)
        else:
            with off.step(model if model_for_step else None):
                loss = fn(x)
                if sync:
                    # every write lands before the forward ends, so the read-ahead finds each
                    # original dead and backward reads from disk; a write still running when the
                    # forward ends is served from its own memory instead (NOTE [Forwarding] in
                    # tba/datapath/prefetch.py), which made bytes_reloaded 0 in some runs
                    off.synchronize()
        loss.backward()
        if stats is not None:
            stats.append(off.stats())
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        seen.append(_graphs())
    return losses, grads, (seen[0], seen[-1]), model, lambda: fn(x)


@contextlib.contextmanager
def no_tba_warnings():
    """Neither tba nor dynamo (about tracing tba's code) warns inside."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        yield
    about_tba = [str(w.message) for w in got if "tba" in str(w.message) or "tba" in w.filename]
    assert not about_tba


def assert_said_once_about_the_region(caplog, model: str) -> None:
    said = [r.getMessage() for r in caplog.records if r.name == "tba"]
    assert len(said) == 1, said
    assert f"the region encloses the blocks of {model}" in said[0]
    assert "tba.compile_blocks(model)" in said[0]


def _exact(a, b) -> bool:
    (la, ga), (lb, gb) = a[:2], b[:2]
    return all(torch.equal(x, y) for x, y in zip(la, lb)) and all(
        torch.equal(x, y) for gx, gy in zip(ga, gb) for x, y in zip(gx, gy)
    )


@pytest.fixture
def off(tmp_path):
    with tba.Offloader(
        tba.Config(spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=0, coalesce_bytes=0)
    ) as o:
        yield o


@pytest.mark.slow  # inductor builds C++ kernels: about a minute on a cold cache, 2 cores
@pytest.mark.parametrize(
    "options",
    [{}, {"fullgraph": True}, {"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}],
    ids=["default", "fullgraph", "max-autotune-no-cudagraphs"],
)
def test_compiled_model_same_graphs_and_exact(off, options, caplog):
    def make(model):
        return torch.compile(model, **options)

    ref = _train(make)
    with no_tba_warnings(), caplog.at_level(logging.WARNING, logger="tba"):
        got = _train(make, off)
    st = off.stats()
    # the region holds every block, head included: nothing is written, and tba says so once
    # (NOTE [Enclosing compiled regions])
    assert st["bytes_offloaded"] == 0 and st["kept_reasons"]["compiled"] == st["tensors_kept"] > 0
    assert_said_once_about_the_region(caplog, "MLP")
    (first, last), (ref_first, ref_last) = got[2], ref[2]
    assert first == ref_first and first[0] >= 1 and first[1] == 0  # same graphs, no breaks
    assert last == first  # no recompilation after the first step
    assert ref_last == ref_first
    assert _exact(got, ref)
    # the block hooks were installed once, at the first step, and are still the only ones
    assert all(len(b._forward_pre_hooks) == 1 for b in got[3].blocks)


def test_per_block_compile_groups_by_block(tmp_path):
    def make(model):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
        return model

    ref = _train(make)
    cfg = tba.Config(spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=1)
    with tba.Offloader(cfg) as off, no_tba_warnings():
        got = _train(make, off)
        st = off.stats()
    # hooks on each compiled block run eagerly around it: the last block and the head stay
    assert st["kept_groups"] == 1 and st["kept_reasons"].get("group", 0) > 0
    assert st["bytes_offloaded"] > 0
    assert got[2] == ref[2] and got[2][0][1] == 0
    assert _exact(got, ref)


def test_compile_blocks_compiles_each_block_and_tba_offloads_by_block(tmp_path):
    def make(model):
        return tba.compile_blocks(model, backend="aot_eager")

    ref = _train(make)
    cfg = tba.Config(spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=0, coalesce_bytes=0)
    steps: list[dict] = []
    with tba.Offloader(cfg) as off, no_tba_warnings():
        got = _train(make, off, stats=steps)
    model = got[3]
    assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in model.blocks)
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert got[2] == ref[2] and got[2][0][1] == 0  # the same graphs as per-block without tba
    assert _exact(got, ref)
    for st in steps:  # each region is one block's: written, grouped by block
        assert st["bytes_offloaded"] > 0 and "compiled" not in st["kept_reasons"]
        assert st["group_policy"] == ["offload"] * 3


def test_compile_blocks_needs_blocks():
    with pytest.raises(tba.UsageError, match=r"tba.compile_blocks: Linear has no blocks"):
        tba.compile_blocks(nn.Linear(2, 2))


def _whole_compiled_before_tba(model):
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(16, 32)).backward()  # compiled code built before tba's hooks exist
    model.zero_grad(set_to_none=True)
    return compiled


def _blocks_compiled_in_place(model):
    for block in model.blocks:
        block.compile(backend="aot_eager")  # each block's hooks run inside its own region
    return model


def test_a_model_compiled_before_tba_is_kept_whole(tmp_path, caplog):
    # Compiled code built before tba's hooks existed: one region that holds every block, so
    # its tensors all exist at once at its end and tba writes none of them.
    ref = _train(_whole_compiled_before_tba, rows=2048)
    cfg = tba.Config(spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=1, group_bytes="1MiB")
    steps: list[dict] = []
    quiet = caplog.at_level(logging.WARNING, logger="tba")
    with tba.Offloader(cfg) as off, no_tba_warnings(), quiet:
        got = _train(_whole_compiled_before_tba, off, rows=2048, stats=steps)
    assert all(st["bytes_offloaded"] == 0 and st["kept_reasons"]["compiled"] > 0 for st in steps)
    assert_said_once_about_the_region(caplog, "MLP")
    assert got[2] == ref[2]
    assert _exact(got, ref)


def test_blocks_compiled_in_place_warn_once_and_group_by_windows(tmp_path):
    # Each block's hooks run inside its own region (traced, they do nothing), so no block
    # boundary is seen. keep_last then counts pack-order windows, and tba says so once. Each
    # region is one block's: it does not enclose the others, and what it saves is written.
    make = _blocks_compiled_in_place
    ref = _train(make, rows=2048)  # about 8 MiB saved: 1 MiB windows
    cfg = tba.Config(spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=1, group_bytes="1MiB")
    with tba.Offloader(cfg) as off:
        with pytest.warns(UserWarning, match=r"none of the 3 blocks of MLP ran its module hooks"):
            got = _train(make, off, rows=2048)
        st = off.stats()  # the last step: its last window stayed in memory
        assert st["kept_groups"] == 1 and st["kept_reasons"].get("group", 0) > 0
        assert st["bytes_offloaded"] > 0 and "compiled" not in st["kept_reasons"]
        with no_tba_warnings(), off.step(got[3]):  # once per model
            loss = got[4]()
        loss.backward()
    assert got[2] == ref[2]
    assert _exact(got, ref)


def _per_block(model):
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager")
    return model


# (make, whether tba sees the blocks): whole-model compiles put every block inside one region
COMPILES = {
    "whole": (lambda m: torch.compile(m, backend="aot_eager"), False),
    "whole-fullgraph": (lambda m: torch.compile(m, backend="aot_eager", fullgraph=True), False),
    "per-block": (_per_block, True),
    "in-place": (_blocks_compiled_in_place, False),
}


@pytest.mark.parametrize("compiled", list(COMPILES))
@pytest.mark.parametrize("policy", ["recompute", "selective", "auto"])
def test_compiled_model_with_block_actions(tmp_path, policy, compiled, caplog):
    # recompute wraps each block's forward for the step (NOTE [Block policy] in
    # tba/datapath/blocks/recompute.py). Traced inside a compiled region, the wrapper is the plain
    # forward: the same graphs, no break, no "marked as skipped" under fullgraph, and tba says once
    # that no block is recomputed and how to compile so that they are. Per-block compile recomputes.
    make, by_block = COMPILES[compiled]
    ref = _train(make)
    cfg = tba.Config(
        spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=0, coalesce_bytes=0, policy=policy
    )
    steps: list[dict] = []
    with tba.Offloader(cfg) as off, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.WARNING, logger="tba"):
            got = _train(make, off, stats=steps)
    said = [str(w.message) for w in caught if "tba" in str(w.message) or "tba" in w.filename]
    (first, last), (ref_first, ref_last) = got[2], ref[2]
    assert first == ref_first and first[1] == 0 and last == first == ref_last
    assert _exact(got, ref)
    for st in steps:  # each step's stats say what backward recomputed, and no more
        assert st["recomputed_groups"] == len([a for a in st["group_policy"] if a in RECOMPUTED])
    if compiled.startswith("whole"):  # one region holds the blocks: kept, said once
        assert not said
        assert_said_once_about_the_region(caplog, "MLP")
        assert all(st["bytes_offloaded"] == 0 and st["recomputed_groups"] == 0 for st in steps)
        assert "torch.compile" in off.stats()["policy_decision"]["reason"]
        return
    every_block_recomputed = by_block and policy in ("recompute", "selective")
    # every block recomputed: the head is kept (NOTE [Head under adaptive keep]), nothing written
    assert all((st["bytes_offloaded"] > 0) != every_block_recomputed for st in steps)
    if by_block:
        assert not said
        if every_block_recomputed:  # a compiled block is recomputed whole
            for st in steps:
                assert st["group_policy"] == ["recompute"] * 3 and st["recomputed_groups"] == 3
                assert st["kept_reasons"]["recompute"] == 3  # each checkpoint's input
        return
    assert len(said) == 1, said
    assert f"TBA_POLICY={policy} cannot act on them: no block is recomputed" in said[0]
    assert "`model.layers[i] = torch.compile(model.layers[i])`" in said[0]
    assert all(st["group_policy"] == [] and st["recomputed_groups"] == 0 for st in steps)
    assert "kept_reasons" not in steps[-1] or "recompute" not in steps[-1]["kept_reasons"]
    assert "torch.compile" in off.stats()["policy_decision"]["reason"]


def test_whole_compiled_model_with_policy_keep_keeps_everything(tmp_path):
    # keep needs no block boundary: every pack-order window stays in memory, nothing written
    make = COMPILES["whole"][0]
    ref = _train(make)
    cfg = tba.Config(spill_dir=str(tmp_path), min_offload_bytes=1, keep_last=0, policy="keep")
    steps: list[dict] = []
    with tba.Offloader(cfg) as off, no_tba_warnings():
        got = _train(make, off, stats=steps)
    assert got[2] == ref[2] and got[2][0][1] == 0
    assert _exact(got, ref)
    assert all(st["bytes_offloaded"] == 0 and st["kept_reasons"]["group"] > 0 for st in steps)


def test_step_inside_compiled_code(off):
    def compile_model(model):
        return torch.compile(model)

    ref = _train(compile_model)

    def compile_the_step(model):
        @torch.compile
        def forward(x):
            with off.step(model):  # the step runs eagerly; the model inside is compiled
                return model(x)

        return forward

    got = _train(compile_the_step, off=None)
    assert got[2] == ref[2] and _exact(got, ref)
    off.synchronize()  # writes are counted once they land (NOTE [Counted once])
    st = off.stats()  # the model is compiled whole: kept (NOTE [Enclosing compiled regions])
    assert st["bytes_offloaded"] == 0 and st["kept_reasons"]["compiled"] > 0

    def compile_then_wrap(model):
        return tba.integrations.wrap(torch.compile(model, fullgraph=True), off)

    ref_full = _train(lambda m: torch.compile(m, fullgraph=True))
    got = _train(compile_then_wrap)
    assert got[2] == ref_full[2] and _exact(got, ref_full)


# After dynamo has raised Unsupported out of a fullgraph trace, this process's frames hold one
# more reference to their locals than before (torch 2.13, Python 3.11: a fresh object's
# sys.getrefcount in a loop reads 5 instead of 4, saved tensors stay alive longer). That would
# change what later tests in the same process see, so the refusal runs in a child process.
_FULLGRAPH_CHILD = """
import sys, tempfile, torch
sys.path.insert(0, {root!r})
import tba, tba.integrations
from tba.datapath.hook import COMPILED_STEP
from tests.integrations.test_compile import _train
with tba.Offloader(tba.Config(spill_dir=tempfile.mkdtemp(dir={tmp!r}), min_offload_bytes=1,
                              keep_last=0, coalesce_bytes=0)) as off:
    try:
        _train(lambda m: torch.compile(tba.integrations.wrap(m, off), fullgraph=True))
    except torch._dynamo.exc.Unsupported as err:
        print("REFUSED", COMPILED_STEP in str(err))
    else:
        print("NOT REFUSED")
"""


def test_wrap_then_compile_fullgraph_is_refused_with_tbas_reason(tmp_path):
    # fullgraph=True forbids the graph break a step needs; dynamo's error carries tba's reason
    root = str(Path(__file__).resolve().parents[2])
    code = _FULLGRAPH_CHILD.format(root=root, tmp=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root
    )
    assert "REFUSED True" in out.stdout, out.stdout + out.stderr[-3000:]
