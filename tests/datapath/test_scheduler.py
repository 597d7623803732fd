"""Groups from blocks or windows, and the reverse-order prefetch plan."""

from __future__ import annotations

import torch
import torch.nn as nn

from tba.datapath.blocks.groups import GroupTracker, detect_blocks
from tba.datapath.prefetch import Prefetcher
from tba.records.entry import CAPTURE, ON_DISK, WRITING
from tba.records.step import StepState
from tba.testing import GPT, GPTConfig


def test_detect_blocks_finds_transformer_layers():
    model = GPT(GPTConfig(layers=3))
    assert detect_blocks(model) == list(model.blocks)


def test_detect_blocks_falls_back_to_children():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    # a Sequential of mixed modules: two Linears of one class are the repeated blocks
    assert detect_blocks(model) == [model[0], model[2]]
    single = nn.Linear(2, 2)
    assert detect_blocks(single) == [single]


def test_keep_last_marks_the_last_blocks_and_the_head():
    model = GPT(GPTConfig(layers=4))
    g = GroupTracker(keep_last=2, group_bytes=1 << 20)
    st = StepState(1)
    seen = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, o, i=i: seen.append((i, g.on_pack(1))))
    g.begin(st, model)
    model(torch.randint(0, 256, (1, 8)))
    head_kept = g.on_pack(1)
    g.end()
    assert seen == [(0, False), (1, False), (2, True), (3, True)]
    assert head_kept and st.kept_groups == 2
    hooks = [(dict(b._forward_pre_hooks), dict(b._forward_hooks)) for b in model.blocks]
    assert all(len(pre) == 1 for pre, _ in hooks)  # installed once per model (NOTE [Groups])
    group = g.group
    model(torch.randint(0, 256, (1, 8)))  # a forward outside any step: the hooks do nothing
    assert g.group == group and g.step is None
    g.begin(StepState(2), model)  # the next step adds nothing
    model(torch.randint(0, 256, (1, 8)))
    g.end()
    assert [(dict(b._forward_pre_hooks), dict(b._forward_hooks)) for b in model.blocks] == hooks
    g.detach_all()  # the Offloader closes
    assert all(not b._forward_pre_hooks for b in model.blocks)


def test_windows_keep_last_uses_previous_step():
    g = GroupTracker(keep_last=1, group_bytes=100)
    g.begin(StepState(1), None)
    assert [g.on_pack(50) for _ in range(6)] == [False] * 6  # first step: nothing known
    g.end()
    assert g.prev_windows == 3
    g.begin(StepState(2), None)
    assert [g.on_pack(50) for _ in range(6)] == [False, False, False, False, True, True]
    g.end()


class FakeEntry:
    def __init__(self, seq, padded, state=ON_DISK):
        self.seq, self.padded, self.state = seq, padded, state
        self.host = None
        self.budgeted = 0
        self.want = False
        self.alive = False  # an original is alive (NOTE [Forwarding])
        self.dev_budgeted = 0
        self.reading = None
        self.deferred = False

    def originals_alive(self):
        return self.alive


def test_prefetch_reverse_order_within_budget():
    started = []
    p = Prefetcher(budget=300, start=started.append)
    st = StepState(1)
    entries = [FakeEntry(seq, 100) for seq in range(1, 7)]
    st.entries = list(entries)
    p.arm(st)
    assert [e.seq for e in started] == [6, 5, 4]  # the latest packed first, 300 bytes
    for e in list(started):
        e.host = object()
    p.give_back(started[0])
    p.pump()
    assert [e.seq for e in started] == [6, 5, 4, 3]


def test_prefetch_passes_over_live_originals_and_reads_them_once_they_die():
    started = []
    p = Prefetcher(budget=300, start=started.append)
    st = StepState(1)
    entries = [FakeEntry(seq, 100) for seq in range(1, 5)]
    entries[3].alive = entries[2].alive = True  # backward's first two: forwarded, never read
    st.entries = list(entries)
    p.arm(st)
    # the window is that of a plan without forwarding (4, 3, 2), but only 2 is read
    assert [e.seq for e in started] == [2] and p.inflight == 300
    assert [e.seq for e in st.deferred] == [4, 3]
    entries[2].alive = False  # seq 3's original died: read at the next pump, in its budget
    p.pump()
    assert [e.seq for e in started] == [2, 3] and [e.seq for e in st.deferred] == [4]
    entries[3].deferred = False  # unpacked (forwarded): forgotten, even once its original dies
    entries[3].alive = False
    p.give_back(entries[3])
    p.pump()
    assert [e.seq for e in started] == [2, 3, 1] and p.plans == []


def test_prefetch_always_allows_one_entry_and_defers_writing_ones():
    started = []
    p = Prefetcher(budget=10, start=started.append)
    st = StepState(1)
    big = FakeEntry(2, 1000)
    writing = FakeEntry(3, 5, state=WRITING)
    capturing = FakeEntry(1, 5, state=CAPTURE)
    st.entries = [big, writing, capturing]
    p.arm(st)
    assert writing.want and not started  # served from staging when its write ends
    p.give_back(writing)
    p.pump()
    assert started == [big]  # bigger than the budget, but nothing else is in flight
