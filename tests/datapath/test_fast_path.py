"""What tba does per saved tensor and per block when nothing is moved (NOTE [Hot path] in
tba/datapath/pack.py): measured once where a measurement can be reused, and still exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tba.datapath.hook import OffloadHooks
from tba.testing import GPT, GPTConfig, random_batch

CFG = GPTConfig(vocab=64, seq=32, hidden=32, heads=4, layers=3, dropout=0.1)


def _step(off, model, batch=4, seq_seed=0):
    with off.step(model):
        loss = model(*random_batch(CFG, batch, seed=seq_seed))
    loss.backward()
    return off.stats()


def test_recompute_counts_a_blocks_saves_once_per_signature(make_offloader):
    """The counting hook runs in the first step of each block signature (item 5 of NOTE [Block
    policy]); later steps are credited what it counted, so saved_bytes and each block's
    hidden_bytes stay what a counted step measures."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="recompute")
    rec = off.groups.recompute
    calls = [0]
    count = rec.count

    def counting(t, st):
        calls[0] += 1
        return count(t, st)

    rec.count = counting
    first = _step(off, model)
    counted = calls[0]
    hidden = [r["hidden_bytes"] for r in off._last.group_records() if r["action"]]
    assert counted > 0 and all(h > 0 for h in hidden)
    for _ in range(2):
        again = _step(off, model)
        assert calls[0] == counted  # not counted again
        assert again["saved_bytes"] == first["saved_bytes"]
        assert [r["hidden_bytes"] for r in off._last.group_records() if r["action"]] == hidden
    longer = _step(off, model, batch=6)  # a new signature: counted again
    assert calls[0] > counted
    assert longer["saved_bytes"] > first["saved_bytes"]
    model.eval()  # so is a change of the training flag (dropout saves nothing in eval)
    before = calls[0]
    _step(off, model)
    assert calls[0] > before


def test_credited_steps_count_what_a_fresh_offloader_counts(make_offloader):
    """A block whose checkpointed forward saves its own output: the credited step marks that
    output counted, so the next block's checkpoint input is not counted twice."""

    class SavesOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return torch.tanh(self.lin(x))  # tanh saves its result: the block's output

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(SavesOutput() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)  # the next block's checkpoint saves it as its input
            return x.sum()

    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(8, 16)

    def run(off):
        with off.step(model):
            loss = model(x)
        loss.backward()
        return off.stats()["saved_bytes"]

    off = make_offloader(policy="recompute")
    measured = run(off)
    credited = [run(off) for _ in range(2)]
    assert credited == [measured, measured]
    assert run(make_offloader(policy="recompute")) == measured


def test_recompute_keeps_the_head(make_offloader):
    """TBA_POLICY=recompute: what the forward saves after the last block (final norm, LM head
    input, log-softmax) stays resident; nothing of it is written (NOTE [Head under adaptive
    keep]). An explicit offload policy with keep_last=0 still writes it."""
    torch.manual_seed(0)
    model = GPT(CFG)
    head = 2 * CFG.layers
    for policy, kept in (("recompute", True), ("offload", False)):
        off = make_offloader(policy=policy, keep_last=0)
        for _ in range(2):
            _step(off, model)
            rec = off._last.group_records()[head]
            assert rec["packed_bytes"] > 0
            if kept:
                assert rec["kept"] and rec["kept_bytes"] == rec["packed_bytes"]
                assert rec["offloaded_bytes"] == 0
            else:
                assert not rec["kept"] and rec["kept_bytes"] == 0
        off.synchronize()
        written = off.stats()["bytes_offloaded"]
        if kept:  # the lead group's few bytes at most: the head is not among them
            assert written < rec["packed_bytes"]


def test_model_storages_follow_the_model(make_offloader):
    """The storages of a model's weights are found once and checked each step (NOTE [Model
    storages]): after a frozen weight is replaced through ``.data``, or by a new frozen
    parameter, each step counts what a fresh Offloader counts."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
            for p in self.layers[1].parameters():
                p.requires_grad_(False)  # frozen: saved by linear, never counted nor written

        def forward(self, x):
            for m in self.layers:
                x = torch.tanh(m(x))
            return x.sum()

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(16, 32, requires_grad=True)

    def saved(off):
        with off.step(net):
            loss = net(x)
        loss.backward()
        return off.stats()["saved_bytes"], off.stats()["packs"]

    off = make_offloader()
    assert saved(off) == saved(make_offloader())
    w = net.layers[1].weight
    w.data = torch.randn(32, 32)  # a new storage behind the same Parameter
    assert saved(off) == saved(make_offloader())
    net.layers[1].weight = nn.Parameter(torch.randn(32, 32), requires_grad=False)
    assert saved(off) == saved(make_offloader())


def test_hooks_are_plain_functions_dynamo_skips():
    """The pack and unpack hooks carry no per-call wrapper (tba/datapath/hook.py,
    ``eager_only``): they are the functions themselves, marked for dynamo to skip."""
    assert OffloadHooks.pack.__qualname__ == "OffloadHooks.pack"
    assert not hasattr(OffloadHooks.pack, "_torchdynamo_disable")
    assert not hasattr(OffloadHooks.unpack, "_torchdynamo_disable")


def test_compiled_code_runs_with_the_hooks_installed(make_offloader):
    """A compiled block runs with tba's hooks installed, and compiles the graphs it compiles
    without them (dynamo never compiles the hooks as frames of their own)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    fast = torch.compile(block, backend="aot_eager")
    x = torch.randn(8, 16, requires_grad=True)
    fast(x).sum().backward()
    without = dict(counters["frames"])
    off = make_offloader(min_offload_bytes=1)
    with off.step():
        loss = fast(x).sum()
    loss.backward()
    assert dict(counters["frames"]) == without
    assert off.stats()["packs"] > 0


RECORD_KEYS = ("saved_bytes", "packed_bytes", "kept_bytes", "keepable_bytes", "tensors", "kept")
STAT_KEYS = ("saved_bytes", "tensors_kept", "kept_reasons", "dedup_hits", "packs")
STAT_KEYS += ("peak_resident_bytes", "tensors_offloaded", "recomputed_tensors", "groups")


def _counted(make_offloader, fast: bool, model_given: bool, **cfg):
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(**cfg)
    off.groups.fast_allowed = fast
    out = []
    for s in range(2):
        with off.step(model if model_given else None):
            loss = model(*random_batch(CFG, 4, seed=s))
        loss.backward()
        off.synchronize()
        st = off.stats()
        recs = [{k: r[k] for k in RECORD_KEYS} for r in off._last.group_records()]
        out.append(({k: st[k] for k in STAT_KEYS}, recs, st["kept_fast"]))
    return out


@pytest.mark.parametrize(
    "cfg,model_given",
    [
        ({"policy": "keep"}, True),
        ({"policy": "keep"}, False),  # pack-order windows, every one kept
        ({"keep_last": 1, "min_offload_bytes": "4KiB"}, True),  # a kept block, small tensors
        ({"policy": "recompute"}, True),  # the checkpoints' inputs
    ],
)
def test_fast_path_counts_what_the_general_path_counts(make_offloader, cfg, model_given):
    """The fast path (NOTE [Hot path]) is a shortcut, not another policy: every stat and every
    group record is what the general path gives for the same steps."""
    fast = _counted(make_offloader, True, model_given, **cfg)
    slow = _counted(make_offloader, False, model_given, **cfg)
    for (fs, frec, fcount), (ss, srec, scount) in zip(fast, slow):
        assert fcount > 0 and scount == 0
        if fs["tensors_offloaded"]:  # staging's share of the peak depends on when writes end
            del fs["peak_resident_bytes"], ss["peak_resident_bytes"]
        assert fs == ss
        assert frec == srec


def _views_saved_twice(x):
    h = x * 2
    y = h.sin() * h.t().cos()  # sin saves h, cos its transpose: one storage, two views
    return (y * y).sum()  # y saved twice by one mul


def test_a_kept_storage_saved_again_is_one_more_handle(make_offloader):
    """Another view of a storage tba keeps, and the same tensor saved twice, are dedup hits on
    its KeptEntry: its bytes are counted and charged once, and each handle holds it."""
    off = make_offloader(policy="keep")
    x = torch.randn(64, 64, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    _views_saved_twice(ref).backward()
    with off.step():
        z = _views_saved_twice(x)
    z.backward()
    st = off.stats()
    assert torch.equal(x.grad, ref.grad)
    assert st["dedup_hits"] == 2 and st["kept_fast"] == st["tensors_kept"]
    assert st["packs"] == st["tensors_kept"] + 2
    assert st["peak_resident_bytes"] == st["saved_bytes"]  # each storage charged once
    assert st["saved_bytes"] >= 4 * x.nbytes
