"""`tba.Offloader`: builds the parts of the data path from a Config and runs them step by step.

The parts, top to bottom (docs/design.md, tba.datapath): the hook (tba/datapath/hook.py) hands
each saved tensor to the Packer (tba/datapath/pack.py) and each unpack to the Reader
(tba/datapath/unpack.py); both work through the shared I/O state (tba/datapath/io.py) on the index
(tba/records/index.py), entries (tba/records/entry.py), coalescing, staging, device adapters and a
storage backend. This class owns their lifetimes, the step boundaries, and what is measured and
published between steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ..config import Config
from ..decide.adaptive import DepthController, KeepController, adapt
from ..decide.block_policy import DEFAULT_BUDGET_SHARE, PolicyController
from ..decide.budget import allowed_bytes
from ..decide.budget import decision as budget_decision
from ..decide.cadence import Cadence
from ..decide.keep import Policy
from ..decide.tiers import spill_groups
from ..errors import UsageError
from ..host.clock import SYSTEM, Clock
from ..metrics import RankMetrics
from ..records.index import Index
from ..records.step import StepState
from .blocks.groups import GroupTracker
from .blocks.recompute import Recompute
from .capture.dtensor import plain
from .hook import EagerScope, OffloadHooks
from .io import IO, check_host_memory, memory_bounded
from .pack import Packer
from .prefetch import Prefetcher
from .trace import TraceWriter
from .unpack import Reader

log = logging.getLogger("tba")

# NOTE [Hooks refused]
# Some code forbids saved-tensor hooks: torch.autograd.graph.disable_saved_tensors_hooks, and the
# torch.func transforms that differentiate (grad, vjp, jacrev, hessian), which disable them for
# the function they transform and refuse to start while hooks are installed. A step opened
# where hooks are disabled runs as without tba (nothing offloaded, said once). A transform
# started inside a step makes torch raise; the step turns that into a tba.UsageError naming the
# two ways out. Code that disables hooks inside a step makes torch raise the disabling code's
# own message when it saves a tensor, before any tba code runs: that one stays torch's.
_FUNC_REFUSES = "don't yet support saved tensor hooks"


class Offloader:
    """Offloads the tensors autograd saves during ``with off.step(): ...`` to local disk.

    Long-lived: it owns the spill files, the staging pool and the I/O threads. Use one per
    process (or per model) and call :meth:`close` at the end, or use it as a context manager.
    ``config`` (default: from the environment) takes ``overrides`` by field name. ``clock`` is
    what every timer of :meth:`stats` reads (tba/host/clock.py); tests pass a fake one.
    """

    def __init__(self, config: Config | None = None, *, clock: Clock = SYSTEM, **overrides: Any):
        if config is None:
            config = Config(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        self.clock = clock  # the one clock of every timer (tba/host/clock.py)
        if config.sources.get("log_level") != "default":
            log.setLevel(config.log_level)  # only when asked: the application owns logging
        self.enabled = config.enabled
        self.closed = False
        self._steps = 0
        self._current: StepState | None = None
        self._last: StepState | None = None
        self._active_thread: int | None = None
        # steps whose backward ran but whose device marks had not all passed when looked at
        # (NOTE [Device clock] in tba/host/clock.py): observed, in order, once they have
        self._unresolved: list[StepState] = []
        self._copy_bps: tuple[float | None, float | None] = (None, None)  # NOTE [Copy timing]
        self.metrics: RankMetrics | None = None
        if not self.enabled:
            self.backend = None
            return
        from ..storage import open_backend
        from ..storage.hosttier import with_host_tier

        check_host_memory(config)  # before any file exists
        backend = open_backend(config)
        try:  # NOTE [Host tier] in tba/storage/hosttier.py
            backend, self.host_tier = with_host_tier(config, backend, cuda_present())
        except BaseException:
            backend.close()
            raise
        self.backend = backend
        try:
            self.metrics = RankMetrics(config, backend)
        except BaseException:
            backend.close()
            raise
        self.keeper = KeepController(
            config.keep_last,
            config.prefetch_bytes,
            budget=config.memory_budget,
            cadence=Cadence(clock),
            max_slowdown=config.max_slowdown,
        )
        scaled = config.sources.get("prefetch_bytes") == "default"  # NOTE [Memory budget]
        self.depth = DepthController(config.prefetch_bytes, scaled=scaled)
        self.groups = GroupTracker(self.keeper.k, config.group_bytes)
        self.groups.adaptive = self.keeper.auto
        self.prefetcher = Prefetcher(config.prefetch_bytes, start=None)
        self.index = Index(on_resident=self._peak)
        self.io = IO(config, backend, self.index, self.metrics, clock)
        self.config = self.io.config  # as run: a budget's staging_full (tba/datapath/io.py)
        self.keeper.staging = (self.config.staging_bytes, self.config.staging_full == "wait")
        self.reader = Reader(self.io, self.index, self.prefetcher)
        self.prefetcher.start = self.reader.start_read  # the plan's reads
        self.index.on_dead = self.reader.retire  # an entry's last handle died: free it
        self.packer = Packer(self.io, self.index, Policy(config.min_offload_bytes), self.groups)
        self.policy = PolicyController(
            config.policy,
            config.block_policy,
            staging=(self.config.staging_bytes, self.config.staging_full == "wait"),
            cadence=Cadence(clock),
            max_slowdown=config.max_slowdown,  # NOTE [Slowdown under auto]
            # as _staging_limit bounds the run's staging (NOTE [Staging in the replays])
            staging_within_budget=(
                self.config.memory_budget is not None and self.config.staging_full == "wait"
            ),
        )
        self.groups.recompute = Recompute(
            self.packer.count_hidden,
            self._recomputing,
            self.packer.hold_cached,
            seen=self.packer.count_seen,
            measure_cacheable=self.packer.measure_cacheable,
        )
        self.groups.default_action = self.policy.default_action()
        self.groups.policy = config.policy
        self._logged_policy: list[str] | None = None
        self._storages = ModelStorages()
        self._trace: TraceWriter | None = None
        if config.trace:
            meta = {"pid": os.getpid(), "rank": config.rank, "backend": backend.name}
            meta.update(backend_reason=backend.reason, config=config.as_dict())
            self._trace = TraceWriter(config.trace, meta)

    # -- public surface -----------------------------------------------------------------------
    def step(self, model: nn.Module | None = None) -> contextlib.AbstractContextManager[Offloader]:
        """Offload what autograd saves inside this block. Backward may run after it ends.

        ``model`` lets tba take groups from its blocks (see NOTE [Groups] in
        tba/datapath/blocks/groups.py); without it, groups are pack-order windows. Opening it in
        code that torch.compile traces breaks the graph there (NOTE [Compiled regions]).
        """
        return EagerScope(self._step(model))

    @contextlib.contextmanager
    def _step(self, model: nn.Module | None) -> Iterator[Offloader]:
        if not self.enabled:
            yield self
            return
        if self.closed:
            raise UsageError("tba.offloader: step() on a closed Offloader; create a new one.")
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
            # NOTE [Hooks refused]: a region that forbids saved-tensor hooks runs as without tba
            self.io.warn_once(
                "hooks-disabled",
                "tba.offloader: saved-tensor hooks are disabled where this step opens "
                "(torch.autograd.graph.disable_saved_tensors_hooks, or the function given to a "
                "torch.func transform such as grad, vjp or jacrev): the step runs without tba "
                "and offloads nothing. Open the step outside that region to offload it.",
            )
            yield self
            return
        me = threading.get_ident()
        with self.io.lock:
            if self._active_thread is not None:
                raise UsageError(
                    "tba.offloader: step() is already active; steps do not nest. End the "
                    "current `with off.step():` block before starting another."
                )
            self._active_thread = me
            self.index.bury()
            # NOTE [Head under adaptive keep] in tba/datapath/blocks/groups.py: step 1, bounded
            # (set before the last step is observed: its decision is for this step)
            self.groups.head_held_back = self._steps == 0 and memory_bounded(self.config)
            self._observe_last()
            self._publish(settle=True)
            self.io.trim()  # forward runs without last backward's spare read buffers
            self.groups.keep_last = self.keeper.k
            self.groups.assignment = self.policy.assignment()
            self.io.limit_staging(self._staging_limit())
            self._steps += 1
            st = StepState(self._steps, self.clock, self.io.timeline(_device_of(model)))
            self._plan_tiers(st)
            self._current = st
            self.metrics.track(st)
            if model is not None:
                self.packer.param_storages = self._storages.of(model)
                if self.config.recompute_weights:  # NOTE [Weight-derived tensors], rule 5
                    self.packer.frozen.begin(model, self.packer.param_storages)
            elif (
                self.config.policy in ("recompute", "selective", "auto") or self.config.block_policy
            ):
                self.io.warn_once(
                    "policy-without-model",
                    f"tba.offloader: TBA_POLICY={self.config.policy} (like TBA_BLOCK_POLICY) acts "
                    "on blocks, which come from the model: pass it, `with off.step(model):`. "
                    "Without it, saved tensors are offloaded (TBA_POLICY=offload).",
                )
            self.groups.begin(st, model)
        try:
            with OffloadHooks(self.packer, self.reader, st):
                yield self
        except RuntimeError as e:
            if _FUNC_REFUSES not in str(e) or isinstance(e, UsageError):
                raise
            raise UsageError(
                f"tba.offloader: a torch.func transform ran inside `with off.step():` and "
                f"refused its saved-tensor hooks ({e}). Open the step inside the function "
                "given to the transform (it then runs without tba), or run the transform "
                "outside the step (NOTE [Hooks refused])."
            ) from e
        finally:
            with self.io.lock:
                self.index.bury()
                self.packer.seal_all()
                self.groups.end()
                if self.groups.lost_blocks:
                    self.policy.blocks_lost(st.index)
                self._log_policy(st)
                st.finish_forward()
                self._active_thread = None
                self.packer.param_storages = frozenset()
                self.packer.frozen.end()
                self._last = st
                if not self.depth.measured:  # NOTE [Memory budget]: the first step's window
                    self.prefetcher.budget = self.depth.first(st.saved_bytes, self._room(st))
                self.prefetcher.arm(st)
                self._publish(settle=False)

    def stats(self) -> dict[str, Any]:
        """Counters of the last step whose forward has ended (keys: docs/configuration.md)."""
        if not self.enabled:
            return (self._last or StepState(0, self.clock)).snapshot(0)
        with self.io.lock:
            self.index.bury()
            self._publish(settle=False)  # the metrics' totals now include these numbers
            last = self._last
            if last is not None and not last.resolved and last.backward_end():
                last.resolve()  # device times where its marks have passed (NOTE [Device clock])
            out = (last or StepState(0, self.clock)).snapshot(self.io.disk_in_use)
            out["backend"] = self.backend.name
            out["backend_reason"] = self.backend.reason
            out["keep_last"] = self.keeper.k
            out["keep_decision"] = dict(self.keeper.decision)
            out["prefetch_decision"] = dict(self.depth.decision)
            out["policy"] = self.config.policy
            out["policy_decision"] = dict(self.policy.decision)
            out["budget_decision"] = self._budget_decision()
            out["resident_bytes"] = self.index.resident
            out["prefetch_inflight_bytes"] = self.prefetcher.inflight
            out["live_entries"] = len(self.io.live)
            out.update(self._tier_stats())
            out["d2h_bps"], out["h2d_bps"] = self._copy_bps  # device-timed copies (CUDA)
            return out

    def synchronize(self) -> None:
        """Write what is still being coalesced, then wait for every write and read so far."""
        if self.enabled:
            with self.io.lock:
                self.packer.seal_all()
            self.io.drain()
            with self.io.lock:
                self.index.bury()

    def close(self) -> None:
        """Finish in-flight I/O, bring back what live graphs still need, close the files."""
        if self.closed or not self.enabled:
            self.closed = True
            return
        io = self.io
        with io.lock:
            self.closed = True
            self.prefetcher.drop_plans()
            self.packer.seal_all()
        io.drain()
        with io.lock:
            self.reader.read_back_live()
        io.drain()
        with io.lock:
            self.reader.keep_live_in_memory()
            self._observe_last(wait=True)  # not a step: the device marks may be waited for
            self._publish(settle=True)
            self.metrics.close()
            self.groups.detach_all()
        if self._trace is not None:
            self._trace.close()
        io.close()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- measurements (NOTE [Adaptive keep], tba/datapath/trace.py) --------------------------------
    def _observe_last(self, wait: bool = False) -> None:
        """Feed the last step to the keep controller and the trace once its backward has run,
        and on a device once its marks have passed (NOTE [Device clock]; ``wait``: wait for
        them, at close): a step whose marks have not is observed at a later step's start,
        before the steps after it."""
        st = self._last
        if st is not None and not st.observed and st not in self._unresolved and st.backward_end():
            self._unresolved.append(st)
        while self._unresolved:
            st = self._unresolved[0]
            if not st.resolve(wait):
                return  # the device is behind: later marks have not passed either
            del self._unresolved[0]
            self._observe(st)

    def _observe(self, st: StepState) -> None:
        st.observed = True
        records = st.group_records()
        # the disk's rates; a step whose offloaded bytes all went to the host tier measured
        # none, and the tier's own stand in, else its copies' (NOTE [Copy timing] in
        # tba/datapath/capture/device.py; NOTE [Host capture] in tba/datapath/pack.py)
        d2h, h2d = self._copy_bps = self.io.copy_rates()
        host = st.host_tier_bytes > 0
        w = _tier_rate(st.bandwidth(True), st.host_bandwidth(True), d2h, host)
        r = _tier_rate(st.bandwidth(False), st.host_bandwidth(False), h2d, host)
        n = len(records)
        kept_from = lambda k: self.groups.kept_from(k, n)  # noqa: E731
        largest = st.largest_read()
        self.prefetcher.budget = adapt(
            self.keeper,
            self.depth,
            st.index,
            records,
            w,
            r,
            kept_from,
            self.groups.max_keep(n),
            largest_read=largest,
            saved_bytes=st.saved_bytes,
            peak_bytes=st.peak_resident_bytes,
            # once auto has chosen, its own room bounds the window (NOTE [Window under auto])
            keeper_room=not self.policy.chosen,
        )
        peak = max(st.peak_resident_bytes, st.peak_with_recompute_bytes)
        self.policy.observe(
            st.index,
            records,
            w,
            r,
            self._memory_budget,
            self.depth.depth,
            peak=peak,
            largest_read=largest,
        )
        if self.policy.room is not None:  # NOTE [Window under auto] in tba/decide/block_policy.py
            self.depth.limit(st.index, self.policy.room, "cut to what auto's assignment leaves")
            self.prefetcher.budget = self.depth.depth
        self.depth.report(st.index)
        if self._trace is not None:
            backward = max(0.0, st.backward_end() - st.forward_end)
            self._trace.step(
                st.index,
                records,
                {
                    "forward_seconds": st.forward_seconds,
                    "backward_seconds": backward,
                    "step_seconds": st.forward_seconds + backward,
                    "saved_bytes": st.saved_bytes,
                    "peak_resident_bytes": st.peak_resident_bytes,
                    "bytes_offloaded": st.bytes_offloaded,
                    "bytes_reloaded": st.bytes_reloaded,
                    "stall_seconds": st.stall_seconds,
                    "sync_loads": st.sync_loads,
                    "write_bps": w,
                    "read_bps": r,
                    "host_tier_bytes": st.host_tier_bytes,
                    "ssd_tier_bytes": st.ssd_tier_bytes,
                    "host_tier_peak_bytes": st.host_tier_peak_bytes,
                    "host_tier_spill_groups": st.spill_groups,
                    "host_write_bps": st.host_bandwidth(True),
                    "host_read_bps": st.host_bandwidth(False),
                    "d2h_bps": d2h,
                    "h2d_bps": h2d,
                    "clock": "device" if st.timeline is not None else "host",
                    "keep_last": st.keep_last,
                    "keep_decision": self.keeper.decision,
                    "group_policy": st.group_policy,
                    "recomputed_groups": st.recomputed_groups,
                    "policy_decision": self.policy.decision,
                },
            )

    def _plan_tiers(self, st: StepState) -> None:
        """The leading groups of step ``st`` that go to the disk first, from the last step's
        bytes per group (NOTE [Tier order] in tba/decide/tiers.py). Lock held."""
        tier = self.io.tier
        if tier is None:
            return
        host = tier.host
        host.peak = host.used
        last = self._last
        spill = 0
        if last is not None:
            offloaded = [(g, gs.host_bytes + gs.ssd_bytes) for g, gs in last.by_group.items()]
            spill = spill_groups(offloaded, host.share() - host.used)
        self.io.spill_groups = st.spill_groups = spill
        bps = None
        if last is not None:  # the tier's copies, else the device copies (NOTE [Host capture])
            bps = _tier_rate(None, last.host_bandwidth(True), self._copy_bps[0], True)
        self.policy.host_tier = (host.share(), bps or math.inf)  # what auto's replays model

    def _tier_stats(self) -> dict[str, Any]:
        """The host tier's keys of :meth:`stats` (NOTE [Host tier]); lock held."""
        tier = self.io.tier
        out: dict[str, Any] = {
            "host_tier": "on" if tier is not None else "off",
            "host_tier_reason": self.host_tier.reason,
            "host_tier_bytes_in_use": 0,
            "host_tier_limit_bytes": 0,
            "host_tier_refusals": 0,
        }
        if tier is not None:
            host = tier.host
            out["host_tier_bytes_in_use"] = host.used
            out["host_tier_limit_bytes"] = host.limit
            out["host_tier_refusals"] = host.refusals
        return out

    def _memory_budget(self, saved_bytes: int) -> int | None:
        """The memory budget in bytes for the chooser (NOTE [Chooser]), for a step that saves
        ``saved_bytes``: TBA_MEMORY_BUDGET (NOTE [Memory budget]); without one None, and
        TBA_MAX_SLOWDOWN bounds auto instead (NOTE [Slowdown under auto]), or, with no
        slowdown bound either, DEFAULT_BUDGET_SHARE of them."""
        allowed = allowed_bytes(self.config.memory_budget, saved_bytes)
        if allowed is None and self.policy.max_slowdown is None:
            return int(DEFAULT_BUDGET_SHARE * saved_bytes)
        return allowed

    def _log_policy(self, st: StepState) -> None:
        """Log the per-block actions a forward ran with, once per change (lock held)."""
        if st.group_policy and st.group_policy != self._logged_policy:
            self._logged_policy = list(st.group_policy)
            log.info(
                "tba: step %d block actions (TBA_POLICY=%s): %s",
                st.index,
                self.config.policy,
                ",".join(st.group_policy),
            )

    def _recomputing(self, st: StepState, stat: Any) -> None:
        """Backward recomputes a block of ``st``: what is resident now plus what the block
        saves is the step's peak with recompute (NOTE [Block policy])."""
        with self.io.lock:
            self.index.bury()  # the saves of blocks backward is done with are freed by now
            now = self.index.resident + stat.hidden_bytes
            st.peak_with_recompute_bytes = max(st.peak_with_recompute_bytes, now)

    def _staging_limit(self) -> int | None:
        """Bytes in flight at most in the step about to run: under TBA_MEMORY_BUDGET with
        TBA_STAGING_FULL=wait, what the budget allows it (from the last step's saved bytes
        for a fraction; none before a first step), else no limit (NOTE [Staging within the
        budget] in tba/datapath/capture/staging.py)."""
        cfg = self.config
        if cfg.memory_budget is None or cfg.staging_full != "wait":
            return None
        last = self._last
        allowed = allowed_bytes(cfg.memory_budget, last.saved_bytes if last is not None else 0)
        return allowed or None

    def _room(self, st: StepState) -> int | None:
        """What TBA_MEMORY_BUDGET leaves for the read-ahead window of a step whose forward just
        ended (None: no budget): its allowed bytes less what is resident now."""
        allowed = allowed_bytes(self.config.memory_budget, st.saved_bytes)
        return None if allowed is None else allowed - self.index.resident

    def _budget_decision(self) -> dict[str, Any]:
        """``stats()["budget_decision"]``: the budget, the bytes it allowed the last step, the
        window and K it led to, and whether the step's peak kept within it."""
        st = self._last
        saved = st.saved_bytes if st is not None else 0
        allowed = allowed_bytes(self.config.memory_budget, saved)
        peak = st.peak_resident_bytes if st is not None else 0
        return budget_decision(
            self.config.memory_budget,
            saved,
            window_bytes=self.depth.depth,
            window_room_bytes=self.keeper.room,
            keep_last=self.keeper.k,
            peak_resident_bytes=peak,
            met=None if allowed is None or st is None else peak <= allowed,
        )

    def _publish(self, settle: bool) -> None:
        """Push counters and gauges to the metrics (NOTE [Metrics] in tba/metrics/__init__.py). With
        ``settle``, the steps that can no longer count are pushed one last time and forgotten:
        after its forward, only a step's live entries change its numbers. Lock held."""
        io = self.io
        busy = {e.step for e in io.live} if settle else None
        self.metrics.publish(
            busy, self.index.resident, io.staging_in_use(), io.disk_in_use, self.keeper.k
        )

    def _peak(self, resident: int) -> None:
        """The index's resident bytes grew: the current step's peak (lock held)."""
        st = self._current
        if st is not None and resident > st.peak_resident_bytes:
            st.peak_resident_bytes = resident


def cuda_present() -> bool:
    """Whether this process can use CUDA (NOTE [Host tier] 1); tests with a fake CUDA patch it."""
    return torch.cuda.is_available()


def _device_of(model: nn.Module | None) -> torch.device | None:
    """Where ``model`` computes: its first parameter's (or buffer's) device; None: unknown."""
    if model is None:
        return None
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return None


def _tier_rate(
    disk: float | None, host: float | None, copy: float | None, host_used: bool
) -> float | None:
    """The rate the controllers get: the disk's, else the host tier's, else (bytes went to the
    tier but its transfers were the device copies themselves) the copies'; bounded by the
    copies' either way."""
    rate = disk or host
    if rate is None and host_used:
        rate = copy
    return _slower(rate, copy)


def _slower(tier: float | None, copy: float | None) -> float | None:
    """A tier's bandwidth measured this step (None: not), bounded by its copies' (None: none
    timed, or not a device)."""
    if tier is None or copy is None:
        return tier
    return min(tier, copy)


# NOTE [Model storages]
# Each step needs the storages of its model's parameters and buffers (a saved tensor on one of
# them is passed through, never written). Walking the module tree for them costs about as much as
# a few hundred saved tensors' hooks, so the set is kept per model and checked each step against
# what can change it: a parameter, buffer or module registered anywhere (torch's global
# registration hooks bump a counter), a tensor whose storage was replaced (``model.to()``,
# ``p.data = ...``: each tensor's storage is compared). A parameter written into a module's
# ``_parameters`` dictionary directly, behind ``setattr``, is seen at the next registration
# anywhere; until then a saved tensor on it is treated as an activation. The record holds the
# tensors (a parameter does not hold its module), not the model.
_registrations = [0]


def _registered(*args: Any) -> None:
    _registrations[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_registered)
nn.modules.module.register_module_buffer_registration_hook(_registered)
nn.modules.module.register_module_module_registration_hook(_registered)


class ModelStorages:
    """The storages of a model's parameters and buffers (of their shards: NOTE [DTensor]), found
    once and checked at every step (NOTE [Model storages])."""

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()

    def of(self, model: nn.Module) -> frozenset[int]:
        got = self._known.get(model)
        if got is not None:
            count, tensors, cdatas, found = got
            if count == _registrations[0] and cdatas == [
                t.untyped_storage()._cdata for t in tensors
            ]:
                return found
        tensors = [plain(p) for p in (*model.parameters(), *model.buffers())]
        tensors = [t for t in tensors if t.layout is torch.strided]
        cdatas = [t.untyped_storage()._cdata for t in tensors]
        found = frozenset(cdatas)
        self._known[model] = (_registrations[0], tensors, cdatas, found)
        return found
