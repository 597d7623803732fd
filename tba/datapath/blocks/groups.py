"""Groups: which block (or pack-order window) a saved tensor belongs to, and each block's action.

# NOTE [Groups]
With a model, groups are its blocks: the largest ``ModuleList``/``Sequential`` of modules of one
class (transformer layers), else its top-level children. A forward pre-hook and a forward hook
on each block mark which block is executing; they are installed once per model, the first time
it is given to a step (:meth:`GroupTracker.attach`), and do nothing outside this tracker's
steps. Each block has an action (NOTE [Block policy] in tba/datapath/blocks/recompute.py); with the
default policy, tensors packed from the first of the last ``keep_last`` blocks onwards (the head
included) are kept resident: backward needs them first; under adaptive keep the head is kept at
every K (NOTE [Head under adaptive keep]). Without a model, a new group starts
every ``group_bytes`` packed bytes, and the last ``keep_last`` groups of the previous step
decide which window is kept (none on the first step).

# NOTE [Compiled regions]
torch.compile turns a region into one autograd node that saves all its tensors when the region
ends and unpacks them all when its backward starts; inside it there are no block boundaries to
see. tba therefore stays out of dynamo's way at two boundaries: the saved-tensor hooks are
``torch.compiler.disable``d (tba/datapath/hook.py: autograd calls them while a compiled frame runs,
and dynamo would otherwise compile them as frames of their own), and the block hooks return at once
while dynamo traces them (``torch.compiler.is_compiling()``), so a traced model holds nothing of
tba and compiles to the same graphs as without it. Hooks on a block that is itself the compiled
unit (``model.blocks[i] = torch.compile(block)``) run eagerly around it and group as usual. When
the blocks run inside a larger compiled region, or compiled code was built before the hooks
existed, no block hook fires although tensors were packed: tba groups that model by pack-order
windows from then on, so that ``keep_last`` still means something, and warns once per model
when that changes a decision: ``keep_last`` not fixed at 0, or a block action other than the
keep-last rule (``TBA_POLICY=recompute`` or ``auto``, ``TBA_BLOCK_POLICY``), unless the Packer
has already said that the region holding them keeps its tensors (NOTE [Enclosing compiled
regions]). No block is then recomputed (item 6 of NOTE [Block policy]): the step's
``group_policy`` is empty and ``recomputed_groups`` 0, a region that encloses the blocks keeps
its tensors, what other regions save is offloaded, and ``auto`` stays ``offload``;
``TBA_POLICY=keep`` keeps every window. The recompute wrappers of the blocks whose action is
``recompute`` are still installed each step, so compiled code built in a step that installed
them (the first) stays valid; traced, they are the plain forward.

# NOTE [Head under adaptive keep]
The head is what the forward packs after its last block: the final norm, the LM head's input, the
logits' log-softmax. Backward unpacks it first, at once, and needs nearly all of it at the same
moment (the loss's backward), so offloading it cannot lower the step's peak: its bytes are resident
at the turn whether they were kept or written and read back. What offloading them does is cost a
write, a read (or a write nobody reads, when backward takes the bytes before the write completes)
and two checksum passes, and it puts the last block's reads behind the head's on the drive just when
backward wants them. With a large vocabulary the head is a large share of what a step saves, and
most of it, offloaded, is written and never read (backward takes it before the write completes). So
while adaptive keep decides (TBA_KEEP_LAST=auto, no assignment from TBA_POLICY or TBA_BLOCK_POLICY),
the head is kept at every K, K=0 included, and its simulation (``kept_from``) says the same. That
writes markedly less each step for a slightly higher peak (the final norm's and LM head's inputs,
resident until the turn rather than written; BENCHMARKS.md, "Defaults on a real model"). Slightly,
not nothing: on W1 at batch 39 the kept head put step 1's peak at 272 MB against 170 MB with it
offloaded, and under a memory cap step 1 is where a batch-size search is OOM-killed first
(BENCHMARKS.md, "Batch headroom"). So under TBA_MEMORY_BUDGET or TBA_POLICY=auto, step 1, which runs
before anything is measured (with no block kept: FIRST_K in tba/decide/adaptive.py), offloads the
head too (``head_held_back``); from step 2 the rule above holds, or auto's assignment decides. An
explicit TBA_KEEP_LAST=0 still offloads the head: it asks for everything that can be written. When
every block is recomputed (TBA_POLICY=recompute or selective) the head is kept too: the step's peak
is at the turn, where the head and every block's checkpointed inputs are resident, written or not.
Without blocks (pack-order windows) there is no head to tell apart, and neither is there when the
model has a second stack of repeated modules (``one_stack``): in T5 or BART the blocks found are the
encoder's, and what runs after the last of them is the whole decoder, whose tensors backward
consumes layer by layer and whose offload does lower the peak.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.nn as nn

from ...config import BY_BLOCK, RECOMPUTED, SELECTIVE
from ...decide.simulator import kept_from
from ...errors import UsageError, internal_error
from ...records.step import StepState
from .kept import KeptBlocks, top_hooks
from .recompute import USER, Recompute, user_checkpointed
from .selective import compiled

BARE = ("keep", "offload", "recompute")  # the actions a block may run without tba's hooks

# NOTE [Enclosing compiled regions]
# A compiled region hands autograd all its saved tensors when it ends, through the
# autograd.Function that AOTAutograd builds for it, and its backward unpacks them all when it
# starts. So when the region encloses the model's blocks (``torch.compile(model)``), every
# tensor it saves exists at once at the end of the forward and again at the start of backward,
# written or not: offloading them costs the writes, the reads and the drive's wear, and lowers
# no peak. The Packer keeps such a tensor (kept reason ``compiled``) and warns once, naming the
# fix: compile each block (:func:`compile_blocks`), whose regions end one by one, so that what
# a block saved can be written while the next ones run. What the forward saves after such a
# region (the loss's inputs) is the head, and stays as the head does under adaptive keep (NOTE
# [Head under adaptive keep]). A pack is recognised as a region's by the frames that call the
# hook: ``Function.apply`` of a class from torch._functorch (the runtime of AOTAutograd), and
# above it the module whose call ran the region: one that holds the model's blocks (or none: a
# compiled function) encloses them; a block compiled in place (``block.compile()``) or any
# other module does not, and its tensors are offloaded as usual. The frames are looked at only
# while a model was given and the forward is outside its blocks, so a block's eager forward never
# pays for the look.
_APPLY = torch.autograd.function.Function.apply.__func__.__code__  # type: ignore[attr-defined]
_CALL = nn.Module._call_impl.__code__
_UP_TO_APPLY = 10  # frames from the Packer to autograd's call of the hook, with room to spare
_UP_TO_MODULE = 24  # frames from there to the module call that ran the compiled code


def compiled_region() -> tuple[bool, nn.Module | None]:
    """Whether the pack hook runs for the saves of a torch.compile region, and the module whose
    call ran it (None: not found, e.g. a compiled function). NOTE [Enclosing compiled regions]."""
    f: FrameType | None = sys._getframe(1)
    for _ in range(_UP_TO_APPLY):
        if f is None:
            return False, None
        if f.f_code is _APPLY:
            break
        f = f.f_back
    else:
        return False, None
    if f is None or not getattr(f.f_locals.get("cls"), "__module__", "").startswith(
        "torch._functorch"
    ):
        return False, None
    for _ in range(_UP_TO_MODULE):
        f = f.f_back
        if f is None:
            break
        if f.f_code is _CALL:
            return True, f.f_locals.get("self")
    return True, None


def _repeated(mod: nn.Module) -> list[nn.Module]:
    """The children of a ``ModuleList``/``Sequential`` that share its most common class, when at
    least two do (a stack of repeated modules); else none."""
    if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
        return []
    cls, count = Counter(type(c) for c in mod).most_common(1)[0]
    return [c for c in mod if type(c) is cls] if count >= 2 else []


def detect_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (e.g. transformer layers), else its children."""
    best: list[nn.Module] = []
    for mod in model.modules():
        stack = _repeated(mod)
        if len(stack) > len(best):
            best = stack
    if best:
        return best
    children = list(model.children())
    return children if children else [model]


def compile_blocks(model: nn.Module, **options: Any) -> nn.Module:
    """Compile each block of ``model`` (the blocks tba groups by, :func:`detect_blocks`) as a
    region of its own, ``torch.compile(block, **options)`` put in its place, and leave the
    model uncompiled: tba then groups, keeps, offloads and recomputes by block as it does
    eagerly (NOTE [Enclosing compiled regions]). Blocks already compiled stay as they are.
    Returns ``model``."""
    blocks = detect_blocks(model)
    if blocks == [model]:
        raise UsageError(
            f"tba.compile_blocks: {type(model).__name__} has no blocks (no ModuleList or "
            "Sequential of repeated modules, no children) to compile one by one; compile the "
            "model itself, which tba keeps in memory as one region."
        )
    ours = {id(b) for b in blocks}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in ours and not isinstance(
                child, torch._dynamo.eval_frame.OptimizedModule
            ):
                setattr(parent, name, torch.compile(child, **options))
    return model


def one_stack(model: nn.Module, blocks: list[nn.Module]) -> bool:
    """Whether ``blocks`` are ``model``'s only stack of repeated modules (outside the blocks
    themselves): a decoder-only LM, not an encoder-decoder (T5, BART) or a model with a tower of
    its own. Only then is what runs after the last block known to be a head and not a second
    stack (NOTE [Head under adaptive keep])."""
    inside = {id(m) for b in blocks for m in b.modules()}
    ours = {id(b) for b in blocks}
    for mod in model.modules():
        if id(mod) in inside or any(id(c) in ours for c in mod.children()):
            continue  # within a block, or the blocks' own container
        if _repeated(mod):
            return False
    return True


def _tensor_bytes(args: Any) -> int:
    """Bytes of the distinct storages of the tensors among ``args``."""
    seen = {}
    for a in args:
        if isinstance(a, torch.Tensor):
            st = a.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class _Attached:
    """The block hooks installed on one model, and how its saved tensors are grouped."""

    __slots__ = ("name", "blocks", "handles", "windows", "one_stack", "holds_blocks")

    def __init__(self, model: nn.Module, blocks: list[nn.Module]):
        self.name = type(model).__name__
        self.blocks = blocks
        # per module that ran a compiled region: whether it holds blocks (and is not one)
        self.holds_blocks: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self.one_stack = one_stack(model, blocks)
        self.handles: list[Any] = []
        self.windows = False  # no block hook fires (NOTE [Compiled regions]): pack-order windows


def _enter_hook(tracker: weakref.ref[GroupTracker], rec: _Attached, i: int) -> Callable:
    def enter(module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return  # traced by dynamo: nothing of tba in the graph (NOTE [Compiled regions])
        t = tracker()
        if t is not None and t.current is rec:
            t.enter_block(i, args, module, kwargs)

    return enter


def _exit_hook(tracker: weakref.ref[GroupTracker], rec: _Attached) -> Callable:
    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        t = tracker()
        if t is not None and t.current is rec:
            t.exit_block(output, module)

    return leave


class GroupTracker:
    """Which group the forward is in, and whether that group stays resident."""

    def __init__(self, keep_last: int, group_bytes: int):
        self.keep_last = keep_last
        self.group_bytes = group_bytes
        self.prev_windows: int | None = None
        self.n_blocks = 0  # blocks of the model given to the last step (0: windows)
        # That model's blocks are its only stack (one_stack). Kept past end(), as n_blocks is:
        # adaptive keep's simulation asks kept_from after the step, once ``current`` is gone.
        self.one_stack = False
        self.assignment: dict[int, str] | None = None  # per-block actions (forced or chosen)
        # step 1 under a memory budget: the head is offloaded too (NOTE [Head under adaptive keep])
        self.head_held_back = False
        self.default_action: str | None = None  # blocks not in it; None: from keep_last
        self.recompute: Recompute | None = None  # installs recompute wrappers (the Offloader's)
        self.adaptive = False  # keep_last is chosen per step (TBA_KEEP_LAST=auto)
        # the pack hook's fast path (NOTE [Hot path] in tba/datapath/pack.py): allowed unless a
        # chooser measures what each block saves; open while the forward is in a block (or in
        # every window under TBA_POLICY=keep), with ``fast`` the reason the whole group keeps
        self.fast_allowed = True
        self.fast_ok = False
        self.fast: str | None = None
        # measures kept blocks and runs them without tba's hooks (NOTE [Kept blocks without
        # hooks] in tba/datapath/blocks/kept.py); the Packer's, None: never
        self.kept_blocks: KeptBlocks | None = None
        self.policy = "offload"  # TBA_POLICY (the Offloader's)
        self._unwrap: list[Callable[[], None]] = []
        self.actions_now: list[str] = []  # this step's action per block
        self._attached: weakref.WeakKeyDictionary[nn.Module, _Attached] = (
            weakref.WeakKeyDictionary()
        )
        self.reset(None)

    def kept_from(self, k: int, groups: int) -> int:
        """The first group index kept with ``keep_last=k``, for a step of ``groups`` groups: the
        simulator's rule (:func:`tba.decide.simulator.kept_from`) over this tracker's numbering.

        With a model, group 2i+1 is block i and the groups between and after blocks follow the
        block before them, except the head under adaptive keep (:attr:`head_kept`: group 2n,
        kept at every K); without one, groups are the pack-order windows, each a block for K.
        """
        if k <= 0 and self.head_kept:
            return min(groups, 2 * self.n_blocks)
        n = self.n_blocks
        blocks = [i % 2 == 1 and i < 2 * n for i in range(groups)] if n else [True] * groups
        return kept_from(blocks, k)

    @property
    def head_kept(self) -> bool:
        """Whether the head (what the forward packs after its last block) stays resident
        whatever the last block's action: under adaptive keep, while the keep-last rule decides,
        and when every block is recomputed (NOTE [Head under adaptive keep])."""
        if not (self.n_blocks > 0 and self.one_stack and self.assignment is None):
            return False  # pack-order windows have no head; the chooser's plan decides it
        if self.default_action is None:
            return self.adaptive and not self.head_held_back
        return self.default_action in RECOMPUTED

    def max_keep(self, groups: int) -> int:
        return self.n_blocks or groups

    def actions(self, n: int) -> list[str]:
        """The action of each of ``n`` blocks: the assignment's where it names the block, else
        ``default_action``, else keep for the last ``keep_last`` blocks and offload for the
        others."""
        first_kept = n - self.keep_last if self.keep_last else n
        got = self.assignment or {}
        other = self.default_action
        return [got.get(i, other or ("keep" if i >= first_kept else "offload")) for i in range(n)]

    def reset(self, step: StepState | None) -> None:
        self.step = step
        self.stat = step.group(0) if step is not None else None  # the current group's GroupStat
        self.group = 0
        self.kept = self.lead_kept and step is not None
        if self.kept:
            self.stat.kept = True
        self.recomputing = False
        self.inputs_offloaded = False  # recompute_offload: the checkpoint's inputs offloaded
        self.packed = 0
        self.window = 0  # the pack-order window of the last pack
        self.entered = 0  # block hooks that fired in this step
        self.block = -1  # the block the forward entered last
        self.first_kept: int | None = None  # windows: the first kept window
        self.by_model = False
        self.current: _Attached | None = None  # the model whose block hooks count now
        self.model: _Attached | None = None  # the model given to this step, by block or not
        self.after_region = False  # an enclosing compiled region has saved in this step
        self.lost_blocks = False  # this step found its model's blocks in a compiled region
        self.fast_ok = False
        self.fast = None

    @property
    def lead_kept(self) -> bool:
        """TBA_POLICY=keep: the group before the first block is kept too (every window, in
        pack-order windows)."""
        return self.policy == "keep"

    def attach(self, model: nn.Module) -> _Attached:
        """Install the block hooks on ``model``, once per model (NOTE [Groups]).

        The hooks stay for the model's life (or until :meth:`detach_all`) and act only while a
        step of this tracker runs with this model; a step adds and removes nothing, so compiled
        code built for the model stays valid from step to step.
        """
        rec = self._attached.get(model)
        if rec is None:
            rec = self._attached[model] = _Attached(model, detect_blocks(model))
            me = weakref.ref(self)
            for i, block in enumerate(rec.blocks):
                rec.handles.append(
                    block.register_forward_pre_hook(_enter_hook(me, rec, i), with_kwargs=True)
                )
                rec.handles.append(block.register_forward_hook(_exit_hook(me, rec)))
        return rec

    def detach_all(self) -> None:
        """Remove every block hook this tracker installed (the Offloader is closing)."""
        for rec in list(self._attached.values()):
            for h in rec.handles:
                h.remove()
            rec.handles.clear()
        self._attached = weakref.WeakKeyDictionary()

    def begin(self, step: StepState, model: nn.Module | None) -> None:
        self.reset(step)
        step.keep_last = self.keep_last
        self.stat.fwd_start = step.clock()
        if step.timeline is not None:  # NOTE [Device clock] in tba/host/clock.py
            step.edge(None, self.stat)
        rec = self.attach(model) if model is not None else None
        self.model = rec
        if rec is not None and not rec.windows:
            self.by_model = True
            self.current = rec
            n = self.n_blocks = len(rec.blocks)
            self.one_stack = rec.one_stack
            actions = self.actions_now = [
                "recompute" if a == SELECTIVE and compiled(b) else a
                for a, b in zip(self.actions(n), rec.blocks)
            ]
            step.kept_groups = actions.count("keep")
            step.group_policy = list(actions)
            self._wrap_recomputed(rec, actions)
            return
        self.n_blocks = 0
        self.one_stack = False
        self.actions_now = []
        if rec is not None:  # windows: the same wrappers, for compiled code's guards
            self._wrap_recomputed(rec, self.actions(len(rec.blocks)))
        if self.lead_kept:  # TBA_POLICY=keep: every window
            self.first_kept = 0
            step.kept_groups = self.prev_windows or 1
            self.fast_ok, self.fast = self.fast_allowed, "group"
        elif self.keep_last and self.prev_windows is not None:
            self.first_kept = max(0, self.prev_windows - self.keep_last)
            step.kept_groups = self.prev_windows - self.first_kept

    def _wrap_recomputed(self, rec: _Attached, actions: list[str]) -> None:
        """Install the recompute wrapper on each block whose action is recompute; by block,
        it runs them under checkpoint, in windows (NOTE [Compiled regions]) as they are."""
        if self.recompute is None:
            if any(a in RECOMPUTED for a in actions):
                raise internal_error("groups", "a recompute action without a Recompute")
            return
        for block, action in zip(rec.blocks, actions):
            if action in RECOMPUTED:
                self._unwrap.append(self.recompute.install(block, self._where, action))

    def _where(self) -> tuple[Any, Any]:
        """The (StepState, GroupStat) a recompute wrapper runs in; (None, None) in windows."""
        return (self.step, self.stat) if self.by_model else (None, None)

    def enter_block(
        self, i: int, args: Any, block: nn.Module | None = None, kwargs: Any = None
    ) -> None:
        self.entered += 1
        self.block = i
        self._switch(self.group + 1)
        top = top_hooks(False)
        if user_checkpointed(block, top):  # left as it is (NOTE [Block policy], item 4)
            act = USER
            if self.step is not None and i < len(self.step.group_policy):
                self.step.group_policy[i] = USER
        else:
            act = self.actions_now[i] if i < len(self.actions_now) else "offload"
        self.kept = act == "keep"
        self.recomputing = act in RECOMPUTED
        self.inputs_offloaded = act == "recompute_offload"
        self.fast_ok = self.fast_allowed and not self.after_region
        if self.kept:
            self.fast = "group"
        else:
            self.fast = "recompute" if self.recomputing and not self.inputs_offloaded else None
        if self.stat is not None:
            self.stat.kept = self.kept
            self.stat.action = act
            self.stat.input_bytes = _tensor_bytes(args)
            if self.recomputing and self.step is not None:
                self.step.recomputed_groups += 1
        kb = self.kept_blocks
        st, gs = self.step, self.stat
        if kb is not None and self.fast_ok and act in BARE and st and gs:
            kb.enter(st, gs, i, act, args, kwargs, block, top)

    def exit_block(self, output: Any = None, block: nn.Module | None = None) -> None:
        kb = self.kept_blocks
        if kb is not None and self.step is not None:
            self.packed += kb.exit(self.step, output)
        self._switch(self.group + 1)  # what runs between or after blocks is a group of its own
        self.recomputing = False
        self.fast_ok, self.fast = False, None
        last = self.block == self.n_blocks - 1
        if last and self.head_kept:
            self.kept = True
        if self.kept and self.stat is not None:
            self.stat.kept = True  # after a kept block (the head): kept too
            if last and kb is not None and self.fast_allowed and not self.after_region:
                kb.enter_head(self.step, self.stat, block, output)

    def _switch(self, group: int) -> None:
        """The forward moves on to ``group``: close the current group's forward time."""
        self.group = group
        step = self.step
        if step is not None:
            now = step.clock()
            ending = self.stat
            ending.fwd_end = now
            self.stat = step.group(group)
            self.stat.fwd_start = now
            if step.timeline is not None:
                step.edge(ending, self.stat)

    def outside_blocks(self) -> bool:
        """A model was given to this step and the forward is in none of its blocks: before the
        first, between two, after the last, or anywhere once its blocks are lost to a compiled
        region (NOTE [Enclosing compiled regions])."""
        return self.model is not None and not (self.by_model and self.group % 2)

    def in_enclosing_region(self) -> bool:
        """Whether this pack is a compiled region's that encloses the step's model's blocks
        (NOTE [Enclosing compiled regions]); call only while :meth:`outside_blocks`."""
        found, module = compiled_region()
        rec = self.model
        if not found or rec is None:
            return False
        if module is not None:
            holds = rec.holds_blocks.get(module)
            if holds is None:
                ours = {id(b) for b in rec.blocks}
                holds = id(module) not in ours and any(id(m) in ours for m in module.modules())
                rec.holds_blocks[module] = holds
            if not holds:
                return False
        self.after_region = True
        self.fast_ok = False
        return True

    def on_pack(self, nbytes: int, region: bool = False) -> bool | str:
        """Account a pack of ``nbytes`` (``region``: an enclosing compiled region's); True when
        it belongs to a kept group, "recompute" when to a recomputed block (its checkpoint's
        inputs: kept, NOTE [Block policy]; with recompute_offload, False: offloaded)."""
        self.window = window = self.packed // self.group_bytes
        self.packed += nbytes
        head = self.adaptive and not (self.assignment or self.default_action)
        if self.after_region and not region and head:
            return True  # after a region that holds the blocks: the head, kept as by block
        if self.by_model:
            if self.recomputing:
                return False if self.inputs_offloaded else "recompute"
            return self.kept
        if window != self.group:
            self._switch(window)
        kept = self.first_kept is not None and window >= self.first_kept
        if kept and self.stat is not None:
            self.stat.kept = True
        return kept

    def switch_kept(self, window: int) -> None:
        """The fast path's window switch under TBA_POLICY=keep (what :meth:`on_pack` does)."""
        self._switch(window)
        if self.stat is not None:
            self.stat.kept = True

    def end(self) -> None:
        self.fast_ok, self.fast = False, None
        if self.stat is not None:
            self.stat.fwd_end = self.step.clock()
            if self.step.timeline is not None:
                self.step.edge(self.stat, None)
        for undo in self._unwrap:
            undo()
        self._unwrap.clear()
        if self.by_model and not self.entered and self.packed:
            self._no_block_ran()
        if not self.by_model:
            self.prev_windows = self.window + 1 if self.packed else 0
        if self.step is not None:
            self.step.groups = self.group + (0 if self.by_model else 1)
        self.step = None
        self.stat = None
        self.current = None
        self.model = None

    def _no_block_ran(self) -> None:
        """Tensors were saved, but no block hook fired (NOTE [Compiled regions])."""
        rec = self.current
        rec.windows = self.lost_blocks = True
        self.by_model = False
        self.n_blocks = 0
        if self.step is not None:
            self.step.kept_groups = 1 if self.lead_kept else 0  # one window, kept by keep
            self.step.group_policy = []  # no block ran as a block
        by_block = self.policy in BY_BLOCK or bool(self.assignment)
        if not (self.keep_last or self.adaptive or by_block):
            return  # nothing is kept or recomputed by block: windows change no decision
        actions = ""
        if by_block:
            by_policy = self.policy in BY_BLOCK
            what = f"TBA_POLICY={self.policy}" if by_policy else "TBA_BLOCK_POLICY"
            instead = "kept (TBA_POLICY=keep)" if self.lead_kept else "offloaded"
            actions = (
                f" {what} cannot act on them: no block is recomputed "
                f"(stats()['recomputed_groups'] is 0) and their saved tensors are {instead}."
            )
        if self.step is not None and self.step.kept_reasons["compiled"]:
            return  # the Packer's warning about the region says it all, and names the fix
        warnings.warn(
            f"tba: none of the {len(rec.blocks)} blocks of {rec.name} ran its module hooks "
            "during this step, though tensors were saved: they ran inside a torch.compile "
            "region (or compiled code built before tba first saw the model), where tba cannot "
            f"see where a block starts.{actions} From now on this model's saved tensors are "
            "grouped by pack order (TBA_GROUP_BYTES windows) and keep_last counts those "
            "windows. To group, keep or recompute by block, compile each block as a module of "
            "its own (`model.layers[i] = torch.compile(model.layers[i])`; `block.compile()` in "
            "place does not do) and leave the model uncompiled.",
            UserWarning,
            stacklevel=5,
        )
