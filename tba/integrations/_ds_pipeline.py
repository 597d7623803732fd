"""DeepSpeed's ``PipelineEngine``: each micro-batch's forward, on every stage, runs under tba.

# NOTE [Pipeline engine]
``PipelineEngine.forward`` only raises (training goes through ``train_batch``), and its
``_exec_forward_pass`` calls ``DeepSpeedEngine.forward`` through ``super()``, so wrapping the
engine's ``forward`` as for the plain engine would leave every stage un-offloaded without a
word. The schedule runs each instruction through the class's ``_INSTRUCTION_MAP``
(``type(cmd) -> function``), looked up on the engine; tba gives the engine its own copy of that
map in which ``ForwardPass`` runs the original under ``offloader.step(stage_module)``. One
micro-batch's forward, the last stage's loss included, is one tba step, and the schedule's
backward of that micro-batch reads it back; under 1F1B several steps are pending at once and
the prefetcher serves the oldest first (NOTE [Plan order] in tba/datapath/prefetch.py). If this
DeepSpeed has no such map, :func:`enable_pipeline` raises; and if a ``train_batch`` ends
without tba's forward having run once, it raises there, rather than train silently without
offload.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ..datapath.hook import EagerScope
from ..errors import UsageError
from ._common import forward_scope

_FIX = (
    "Use the tested DeepSpeed (pip install 'tba[deepspeed]': deepspeed==0.19.8), or set "
    '"activation_offload": {"enabled": false} in ds_config.'
)


def is_pipeline_engine(engine: Any) -> bool:
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError:
        return False
    return isinstance(engine, PipelineEngine)


def enable_pipeline(engine: Any, offloader: Any, owned: bool) -> None:
    """Run every ``ForwardPass`` of ``engine``'s schedule under ``offloader`` (NOTE above)."""
    from deepspeed.runtime.pipe import schedule

    table = getattr(type(engine), "_INSTRUCTION_MAP", None)
    original = table.get(schedule.ForwardPass) if isinstance(table, Mapping) else None
    if original is None or not callable(getattr(engine, "_exec_schedule", None)):
        raise UsageError(
            f"tba.deepspeed: {type(engine).__name__} has no _INSTRUCTION_MAP entry for "
            "ForwardPass, through which tba runs each micro-batch's forward under the "
            f"offloader, so offload cannot be installed on this pipeline engine. {_FIX}"
        )
    stage = engine.module
    ran = [0]  # ForwardPass instructions run under tba

    @functools.wraps(original)
    def forward_pass(self: Any, *args: Any, **kwargs: Any) -> Any:
        ran[0] += 1
        with EagerScope(forward_scope(offloader, stage)):
            return original(self, *args, **kwargs)

    train_batch = engine.train_batch

    @functools.wraps(train_batch)
    def checked_train_batch(*args: Any, **kwargs: Any) -> Any:
        before = ran[0]
        out = train_batch(*args, **kwargs)
        if ran[0] == before:
            raise UsageError(
                f"tba.deepspeed: {type(engine).__name__}.train_batch ran without calling the "
                "ForwardPass entry of _INSTRUCTION_MAP, so nothing was offloaded on stage "
                f"{getattr(engine, 'stage_id', '?')}: this DeepSpeed runs its schedule another "
                f"way. {_FIX}"
            )
        return out

    checked_train_batch.tba_offloader = offloader  # type: ignore[attr-defined]
    checked_train_batch.tba_owned = owned  # type: ignore[attr-defined]
    engine._INSTRUCTION_MAP = {**table, schedule.ForwardPass: forward_pass}
    engine.train_batch = checked_train_batch


def pipeline_offloader(engine: Any) -> tuple[Any, bool]:
    """(the Offloader :func:`enable_pipeline` installed, whether enable() built it)."""
    got = engine.__dict__.get("train_batch")
    return getattr(got, "tba_offloader", None), getattr(got, "tba_owned", False)


def disable_pipeline(engine: Any) -> bool:
    """Undo :func:`enable_pipeline`; returns whether it was installed."""
    if pipeline_offloader(engine)[0] is None:
        return False
    del engine.__dict__["train_batch"]
    engine.__dict__.pop("_INSTRUCTION_MAP", None)
    return True
