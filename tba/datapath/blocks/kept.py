"""Blocks that tba keeps whole, left to autograd once measured.

# NOTE [Kept blocks without hooks]
A block whose saved tensors all stay in memory (a kept block; an offloaded block whose tensors
are all under TBA_MIN_OFFLOAD_BYTES) gains nothing from tba's pack and unpack hooks: each of its
tensors is kept as autograd would keep it, and the hooks only count. Yet inside the model each
call costs several microseconds (cold code between kernels), which on a launch-bound step is the
difference between tba costing nothing and costing a tenth of the step. So such a block is
measured once per signature and then run with tba's hooks popped off autograd's stack:

1. The signature: the block's index and action, and what a recomputed block's signature holds
   (item 5 of NOTE [Block policy] in tba/datapath/blocks/recompute.py: its arguments' shapes,
   dtypes and devices, its other arguments, its training flag, autocast's state), with whether
   tba already keeps each tensor argument's storage. The same module on the same signature
   saves the same tensors.
2. Measuring: the block runs with the hooks, and at its exit what it added is read off the step
   and its group: packs, kept tensors and their reasons, dedup hits, bytes, the storages it kept
   (charged to the resident count). It qualifies only when every pack it made was kept on the
   fast path or was another view of a storage tba keeps (NOTE [Hot path] in
   tba/datapath/pack.py): no offload, no weight recipe, no subclass, no general-path keep.
3. Credited: on a later step with the same signature, and only while tba's hooks are the top of
   autograd's stack (a user's own hooks inside the step win) and grad is enabled, the hooks are
   popped at the block's entry and pushed back at its exit (or at the end of the step, when the
   block raised). Autograd saves the block's tensors itself, which is what tba would have done,
   version checks included. At the exit the bytes it kept are charged to the resident count
   and the measurement's counts are queued, added to the step and the group when the step
   ends (``kept_credited`` says how many packs were credited), and the storages among its
   arguments and outputs that it kept are registered as kept, so that what saves them after
   the block counts them as it did when measured (a dedup hit, bytes counted once).
4. One hook on the gradient of the block's first output with a grad_fn marks where
   backward enters the block (its group's backward time, NOTE [Backward timing] in
   tba/records/step.py) and ends the charge; so does dropping the graph, which frees the hook
   and what it holds. The block's bytes are then still resident until its nodes have run, but
   the step's peak, recorded as bytes are charged, is behind by then. Backward leaves the
   block where the group below it starts; for the first block, a second hook on the gradient of
   its first input with a grad_fn marks it (a leaf's hooks would outlive the step). A block none
   of whose inputs requires grad, or a first block none of whose inputs has a grad_fn, is never
   credited: backward ends inside it, and only its unpacks could say when.
6. The head (what the forward saves after the last block until the step ends: the final norm,
   the LM head, the loss), when it is kept and nothing was offloaded earlier in the step, is a
   region of the same kind, entered at the last block's exit with the signature of what that
   block returned, and left when the step ends: its counts are credited then, and its charge
   ends when backward leaves it (a prehook on the last block's output node). Its own backward
   time is then not measured (nothing was offloaded: no read waits on it). A step that raises
   credits nothing of its head.
5. Measured again after REMEASURE credits of one signature, or when the signature changes; a
   block that did not qualify is tried again after REMEASURE steps. At most SIGNATURES
   signatures are remembered per block.
Not credited: compiled blocks, steps with a trace, and whenever the fast path is off (a chooser
measures what blocks save: TBA_POLICY=auto or selective, TBA_BLOCK_POLICY).
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch

from ...records.handle import Credit, KeptHandle, kept_alias
from ...records.index import Index
from ...records.step import GroupStat, StepState
from .recompute import signature

REMEASURE = 64  # credits of one signature between two measurements
HEAD = -1  # the block index the head is recorded under (item 6)
STEADY = {"group", "small", "recompute"}  # kept reasons that hold from one step to the next
SIGNATURES = 16  # per block, before the block's records are forgotten

_autograd: Any = torch._C._autograd
top_hooks = _autograd._top_saved_tensors_default_hooks  # (pack, unpack) innermost, or None
_pop = _autograd._pop_saved_tensors_default_hooks
_push = _autograd._push_saved_tensors_default_hooks
_Compiled = torch._dynamo.eval_frame.OptimizedModule


def _outputs(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [o for o in output if isinstance(o, torch.Tensor)]
    return []


def _add(step: StepState, m: Measured, gs: GroupStat) -> None:
    """Count a credited block's measurement into its step and group. Lock held."""
    step.packs += m.packs
    step.tensors_kept += m.kept
    step.kept_fast += m.fast
    step.kept_dedup += m.kept_dedup
    step.dedup_hits += m.dedup
    step.kept_credited += m.packs
    step.saved_bytes += m.saved
    reasons = step.kept_reasons
    for r, n in m.reason_items:
        reasons[r] += n
    gs.tensors += m.tensors
    gs.packed_bytes += m.packed
    gs.saved_bytes += m.saved
    gs.sizes.extend(m.sizes)
    gs.kept_bytes += m.kept_bytes
    gs.keepable_bytes += m.keepable


class Measured:
    """What one block added to its step and group on one signature (item 2)."""

    __slots__ = (
        "ok",
        "credits",
        "packs",
        "kept",
        "fast",
        "kept_dedup",
        "dedup",
        "reason_items",
        "saved",
        "tensors",
        "packed",
        "kept_bytes",
        "keepable",
        "sizes",
        "charge",
        "positions",
    )

    def __init__(self, ok: bool):
        self.ok = ok
        self.credits = 0
        self.packs = self.kept = self.fast = self.kept_dedup = self.dedup = self.saved = 0
        self.tensors = self.packed = self.kept_bytes = self.keepable = self.charge = 0
        self.reason_items: list[tuple[str, int]] = []  # kept reasons and their counts
        self.sizes: list[int] = []
        # indices into (inputs + outputs) of the tensors whose storages the block kept
        self.positions: list[int] = []


class _Open:
    """The block the forward is in: measuring it, or running it credited."""

    __slots__ = (
        "block",
        "records",
        "key",
        "inputs",
        "stat",
        "measured",
        "before",
        "popped",
        "ends",
    )

    def __init__(
        self,
        block: int,
        records: dict[Any, Measured],
        key: Any,
        inputs: list[torch.Tensor],
        stat: GroupStat,
    ):
        self.block = block
        self.records = records  # the block's measurements
        self.key = key
        self.inputs = inputs
        self.stat = stat
        self.measured: Measured | None = None  # credited: the measurement it is credited
        self.before: Any = None  # measuring: the step's counters and kept storages at entry
        self.popped: Any = None  # credited: tba's hooks, popped at entry
        self.ends: Any = None  # the head: the node whose prehook ends its charge


class KeptBlocks:
    """Measures kept blocks and runs them credited, without tba's hooks (see the NOTE)."""

    def __init__(self, lock: Any, index: Index, allowed: bool):
        self.lock = lock
        self.index = index
        self.allowed = allowed  # off under a trace
        self.hooks: Any = None  # the step's OffloadHooks while it is entered
        # per block module (two models may take turns): signature -> its measurement
        self._records: weakref.WeakKeyDictionary[Any, dict[Any, Measured]] = (
            weakref.WeakKeyDictionary()
        )
        self._open: _Open | None = None  # the block the forward is in
        self._head: _Open | None = None  # the head, once the forward has left the last block
        self._pending: list[tuple[StepState, Measured, GroupStat]] = []  # credited, not counted

    def _ours(self, top: Any) -> bool:
        return top is not None and getattr(top[0], "__self__", None) is self.hooks is not None

    def enter(
        self,
        step: StepState,
        stat: GroupStat,
        block: int,
        action: str,
        args: Any,
        kwargs: Any,
        module: Any,
        top: Any,
    ) -> None:
        """The forward enters block ``block`` with its fast path open (NOTE [Hot path]);
        ``top``: the innermost saved-tensor hooks."""
        self._open = None
        if not self.allowed or not self._ours(top) or module is None:
            return
        if isinstance(module, _Compiled):
            return
        inputs: list[torch.Tensor] = []
        described = signature(module, args, kwargs or {}, inputs)
        kept = self.index.kept
        flags = []
        reached = False  # backward goes on below this block (item 4)
        for t in inputs:
            flags.append(t.untyped_storage()._cdata in kept)
            if t.grad_fn is not None or (block and t.requires_grad):
                reached = True
        if not reached:
            return  # backward ends in this block: only its unpacks can say when (item 4)
        key = (action, described, tuple(flags))
        op = self._region(step, stat, block, key, inputs, module)
        if op is not None and op.measured is not None:
            _pop()  # credited (item 3)
            op.popped = top
        self._open = op

    def enter_head(self, step: StepState | None, stat: GroupStat, module: Any, output: Any) -> None:
        """The forward leaves the last block (``module``, which returned ``output``) into the
        head, which is kept (item 6)."""
        self._head = None
        top = top_hooks(False)
        if not self.allowed or not self._ours(top) or module is None or step is None:
            return
        if step.entries:  # something was offloaded: the head's backward times its reads
            return
        ends = next((t.grad_fn for t in _outputs(output) if t.grad_fn is not None), None)
        if ends is None:
            return
        inputs: list[torch.Tensor] = []
        described = signature(module, (output,), {}, inputs)
        kept = self.index.kept
        flags = tuple([t.untyped_storage()._cdata in kept for t in inputs])
        op = self._region(step, stat, HEAD, ("head", described, flags), inputs, module)
        if op is not None:
            op.ends = ends
            if op.measured is not None:
                _pop()
                op.popped = top
        self._head = op

    def _region(
        self,
        step: StepState,
        stat: GroupStat,
        block: int,
        key: Any,
        inputs: list[torch.Tensor],
        module: Any,
    ) -> _Open | None:
        """The block (or head) entered, to be measured or credited (``measured`` set); None:
        neither."""
        records = self._records.get(module)
        if records is None:
            records = self._records[module] = {}
        m = records.get(key)
        op = _Open(block, records, key, inputs, stat)
        if m is not None and m.credits < REMEASURE:
            m.credits += 1
            if not m.ok:
                return None  # did not qualify: runs with the hooks until it is tried again
            op.measured = m
            return op
        if m is None and len(records) >= SIGNATURES:
            records.clear()
        with self.lock:
            op.before = (
                step.packs,
                step.tensors_kept,
                step.kept_fast,
                step.kept_dedup,
                step.dedup_hits,
                step.saved_bytes,
                Counter(step.kept_reasons),
                set(self.index.kept),
            )
        return op

    def exit(self, step: StepState, output: Any) -> int:
        """The block returned ``output``; returns the bytes a credited block adds to the
        tracker's pack count (0 otherwise)."""
        op = self._open
        if op is None:
            return 0
        self._open = None
        if op.popped is not None:
            _push(*op.popped)
            return self._credit(step, op, _outputs(output))
        self._measure(step, op, _outputs(output))
        return 0

    def restore(self, step: StepState | None, failed: bool) -> None:
        """The step ends (``failed``: by an exception): put tba's hooks back where a credited
        block raised (so its exit never ran) or the head runs without them, before the step's
        own exit pops them; then count what was credited."""
        op, head = self._open, self._head
        self._open = self._head = None
        if op is not None and op.popped is not None:
            _push(*op.popped)
        if head is not None and op is None:
            if head.popped is not None:
                _push(*head.popped)
                if not failed and step is not None:
                    self._credit(step, head, [])
            elif not failed and step is not None:
                self._measure(step, head, [])
        pending = self._pending
        if pending:
            with self.lock:
                for st, m, gs in pending:
                    _add(st, m, gs)
            pending.clear()

    def _measure(self, step: StepState, op: _Open, outs: list[torch.Tensor]) -> None:
        gs = op.stat
        with self.lock:
            packs, kept_n, fast, kdedup, dedup, saved, reasons, before = op.before
            m = Measured(False)
            m.packs = step.packs - packs
            m.kept = step.tensors_kept - kept_n
            m.fast = step.kept_fast - fast
            m.kept_dedup = step.kept_dedup - kdedup
            m.dedup = step.dedup_hits - dedup
            # less what a recomputed block's checkpoint saved: Recompute credits that itself
            m.saved = step.saved_bytes - saved - gs.hidden_bytes
            added = Counter(step.kept_reasons)
            added.subtract(reasons)
            added = +added
            m.reason_items = list(added.items())
            m.ok = (
                m.packs == m.kept + m.kept_dedup
                and m.dedup == m.kept_dedup
                and sum(added.values()) == m.kept
                and added.keys() <= STEADY
            )
            if m.ok:
                m.tensors = gs.tensors
                m.packed = gs.packed_bytes
                m.kept_bytes = gs.kept_bytes
                m.keepable = gs.keepable_bytes
                m.sizes = list(gs.sizes)
                new = {c: e for c, e in self.index.kept.items() if c not in before}
                charge = sum(e.nbytes for e in new.values())
                for i, t in enumerate(op.inputs + outs):
                    cdata = t.untyped_storage()._cdata
                    e = new.pop(cdata, None)
                    if e is not None:
                        m.positions.append(i)
                        charge -= e.nbytes
                m.charge = charge
        op.records[op.key] = m

    def _credit(self, step: StepState, op: _Open, outs: list[torch.Tensor]) -> int:
        m = op.measured
        assert m is not None
        gs = op.stat
        index = self.index
        credit = Credit(index.graveyard, m.charge)
        self._pending.append((step, m, gs))  # counted when the step ends, in one go
        with self.lock:
            index.charge(m.charge)
            if m.positions:
                both = op.inputs + outs
                held = []
                for i in m.positions:
                    t = both[i]
                    storage = t.untyped_storage()
                    cdata = storage._cdata
                    e = index.kept_entry(storage, cdata, storage.nbytes())
                    step.seen.setdefault(cdata, e)
                    held.append(KeptHandle(kept_alias(t), t._version, e, gs))
                credit.held = held
        clock = step.clock
        if op.ends is not None:  # the head: its charge ends as backward leaves it (item 6)
            op.ends.register_prehook(lambda grads: credit.release())
            return m.packed
        last = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
        if last is not None:  # item 4: backward enters the block

            def reached(grads: Any) -> None:
                gs.unpacked(clock())
                credit.release()

            last.register_prehook(reached)  # as a hook on the output's gradient, but cheaper
        if op.block == 0:  # where backward leaves the first block (item 4)
            first = next(t.grad_fn for t in op.inputs if t.grad_fn is not None)

            def left(grads: Any) -> None:
                gs.unpacked(clock())

            first.register_prehook(left)
        return m.packed
