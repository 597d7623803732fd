"""DeepSpeed: an ``activation_offload`` section in ds_config, and one line to enable it.

    import tba.integrations.deepspeed as tba_ds
    engine, optimizer, _, _ = tba_ds.initialize(model=model, config="ds_config.json", ...)
    loss = engine(batch)          # the forward runs under the offloader
    engine.backward(loss)         # reads come back ahead of backward; accumulation works
    engine.step()

A ``PipelineEngine`` (a ``PipelineModule`` given to ``initialize``) trains through
``engine.train_batch(data_iter)``; there every micro-batch's forward on every stage runs under
the offloader, the last stage's loss included (NOTE [Pipeline engine] in ``_ds_pipeline.py``).

ds_config (every key optional; ``"auto"`` means "not set here": the ``TBA_*`` variable, else
tba's default; for ``keep_last``, ``"auto"`` is tba's adaptive choice)::

    "activation_offload": {
        "enabled": true,
        "nvme_path": "/local_nvme",
        "min_offload_bytes": "1MiB",
        "keep_last": "auto",
        "prefetch_bytes": "256MiB"
    },
    "aio": {"queue_depth": 32, "intra_op_parallelism": 4, "block_size": 8388608}

Keys of the section are the names of :class:`tba.Config` fields (``min_offload_bytes``,
``keep_last``, ``prefetch_bytes``, ``staging_bytes``, ``backend``, ``checksum``, ...) plus
``enabled`` and ``nvme_path``; an unknown key is a :class:`tba.ConfigError` naming the closest
valid one. Spill files go under ``{nvme_path}/activation_offload/rank{r}``; without
``nvme_path``, under ``TBA_SPILL_DIR`` as everywhere else.

DeepSpeed's own ``aio`` block carries over, so ``ds_nvme_tune`` output applies: ``queue_depth``
-> ``io_depth`` (native engine), ``intra_op_parallelism`` -> ``io_threads``, ``block_size`` ->
``gds_task_bytes`` (kvikio splits each transfer into tasks of this size; the other backends
issue one request per extent), ``use_gds: true`` -> the ``kvikio`` backend when kvikio reports
GPUDirect Storage, else a warning and the usual choice. The old ``thread_count`` is ignored by
DeepSpeed and by tba, with a warning. A key in ``activation_offload`` beats the ``aio`` block.

Precedence: ds_config > ``TBA_*`` environment > defaults (logged once, on rank 0), except that
``TBA_ENABLED=0`` turns offload off whatever ds_config says (see NOTE [Precedence] in
``_common.py``). Without the section and without ``TBA_ENABLED``, offload is on, configured
from the environment: calling this module is the opt-in.
"""

from __future__ import annotations

import atexit
import difflib
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

from ..config import Config
from ..datapath.offloader import Offloader
from ..errors import ConfigError, UsageError
from ._common import (
    build_config,
    describe_sources,
    env_config,
    env_kill_switch,
    unwrap_forward,
    wrap_forward,
    wrapped_offloader,
)
from ._ds_pipeline import (
    disable_pipeline,
    enable_pipeline,
    is_pipeline_engine,
    pipeline_offloader,
)

__all__ = ["SECTION", "initialize", "enable", "disable", "offloader_of", "resolve_config"]

log = logging.getLogger("tba.integrations.deepspeed")

SECTION = "activation_offload"
_NOT_KEYS = ("enabled", "spill_dir", "rank")  # set by the section's own keys or by DeepSpeed
_KEYS = ("enabled", "nvme_path") + tuple(
    name for name, _, _, _ in Config.describe() if name not in _NOT_KEYS
)
_ALIASES = {"spill_dir": "nvme_path", "path": "nvme_path", "enable": "enabled"}
# DeepSpeed's aio knob -> tba field
_AIO = {
    "queue_depth": "io_depth",
    "intra_op_parallelism": "io_threads",
    "block_size": "gds_task_bytes",
}

_logged_once = False  # the settings are logged once per process (on rank 0)


# keys whose "auto" is a value of their own (adaptive keep; the chooser of TBA_POLICY), not
# "not set here"
_AUTO_VALUED = ("keep_last", "policy")


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == "auto")


def _check_keys(section: Mapping[str, Any]) -> None:
    for key in section:
        if key in _KEYS:
            continue
        close = _ALIASES.get(key) or next(
            iter(difflib.get_close_matches(str(key), _KEYS, n=1, cutoff=0.5)), None
        )
        hint = f"did you mean '{close}'? " if close else ""
        raise ConfigError(
            f'ds_config "{SECTION}" has an unknown key {key!r}: {hint}Valid keys: '
            f"{', '.join(_KEYS)}."
        )


def _gds_status() -> tuple[bool, str]:
    """Whether kvikio reports GPUDirect Storage on a CUDA host, and why not."""
    import torch

    from ..storage.kvikio import kvikio_status

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    st = kvikio_status()
    if not st["importable"]:
        return False, st["reason"]
    if st["gds_available"] is False:
        return False, st["reason"]
    return True, st["reason"]


def _from_aio(aio: Mapping[str, Any], values: dict, sources: dict, labels: dict) -> None:
    if "thread_count" in aio:
        warnings.warn(
            "tba.deepspeed: ds_config aio.thread_count is ignored (DeepSpeed ignores it too; it "
            "was renamed). Set aio.intra_op_parallelism, which tba uses as io_threads.",
            UserWarning,
            stacklevel=4,
        )
    for key, field in _AIO.items():
        if key in aio and not _unset(aio[key]):
            values[field] = aio[key]
            sources[field] = labels[field] = f"ds_config aio.{key}"
    if aio.get("use_gds") is True:
        ok, why = _gds_status()
        if ok:
            values["backend"] = "kvikio"
            sources["backend"] = labels["backend"] = "ds_config aio.use_gds"
        else:
            warnings.warn(
                f"tba.deepspeed: ds_config aio.use_gds is true, but GPUDirect Storage is not "
                f"available here ({why}); tba keeps backend="
                f"{values.get('backend', 'from TBA_BACKEND or auto')}. Install tba[gds] on a "
                "CUDA host with GDS, or set use_gds to false.",
                UserWarning,
                stacklevel=4,
            )


def resolve_config(ds_config: Mapping[str, Any], rank: int = 0) -> tuple[Config, dict[str, str]]:
    """The :class:`tba.Config` for this rank from a ds_config dict and the environment.

    Returns it with where each setting came from (fields not listed: environment or default).
    Raises :class:`tba.ConfigError` for an unknown key or a bad value, naming the ds_config key.
    """
    section = ds_config.get(SECTION) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(
            f'ds_config "{SECTION}" must be an object such as {{"enabled": true, "nvme_path": '
            f'"/local_nvme"}}, not {type(section).__name__}.'
        )
    _check_keys(section)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    labels: dict[str, str] = {}
    aio = ds_config.get("aio")
    if isinstance(aio, Mapping):
        _from_aio(aio, values, sources, labels)
    for key, raw in section.items():
        if key in ("enabled", "nvme_path") or (_unset(raw) and key not in _AUTO_VALUED):
            continue
        values[key] = raw
        sources[key] = labels[key] = f"ds_config {SECTION}.{key}"
    env = env_config()
    enabled = section.get("enabled")
    if env_kill_switch(env):
        values["enabled"], sources["enabled"] = False, "TBA_ENABLED=0 (beats ds_config)"
    elif not _unset(enabled):
        values["enabled"] = enabled
        sources["enabled"] = labels["enabled"] = f"ds_config {SECTION}.enabled"
    nvme = section.get("nvme_path")
    if not _unset(nvme):
        if not isinstance(nvme, str) or not nvme.strip():
            raise ConfigError(
                f"ds_config {SECTION}.nvme_path={nvme!r} is invalid; expected a directory on a "
                'local NVMe drive, such as "/local_nvme".'
            )
        values["spill_dir"] = os.path.join(nvme, SECTION, f"rank{rank}")
        sources["spill_dir"] = f"ds_config {SECTION}.nvme_path"
    values["rank"], sources["rank"] = rank, "torch.distributed rank"
    return build_config(values, labels), sources


def _param_dict(engine: Any) -> Mapping[str, Any]:
    # The parsed ds_config, whichever way it was given (dict, path, base64, args).
    got = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if isinstance(got, Mapping):
        return got
    if isinstance(getattr(engine, "config", None), Mapping):
        return engine.config
    raise UsageError(
        f"tba.deepspeed: cannot read the ds_config from a {type(engine).__name__} (it has no "
        "_config._param_dict). Pass the engine that deepspeed.initialize returned."
    )


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_config().rank


def enable(engine: Any, offloader: Offloader | None = None) -> Offloader | None:
    """Run the engine's forward under an Offloader configured from its ds_config.

    Returns the Offloader, or None when offload is off (``"enabled": false`` or
    ``TBA_ENABLED=0``). ``offloader``: use this one instead of building one from ds_config.
    """
    global _logged_once
    rank = _rank()
    owned = offloader is None
    if owned:
        cfg, sources = resolve_config(_param_dict(engine), rank)
        if rank == 0 and not _logged_once:
            _logged_once = True
            state = "on" if cfg.enabled else "off"
            log.info(
                "tba.deepspeed: activation offload %s. Settings (ds_config > TBA_* > default):\n%s",
                state,
                describe_sources(cfg, sources),
            )
        if not cfg.enabled:
            return None
        offloader = Offloader(cfg)
        atexit.register(offloader.close)
    elif not offloader.enabled:
        return None
    disable(engine)
    if is_pipeline_engine(engine):  # NOTE [Pipeline engine] in _ds_pipeline.py
        enable_pipeline(engine, offloader, owned)
        return offloader
    wrap_forward(engine, offloader, blocks_of=engine.module)
    engine.forward.tba_owned = owned  # disable() closes only an Offloader enable() made
    return offloader


def disable(engine: Any) -> None:
    """Undo :func:`enable`: the engine's forward is the original again, and the Offloader that
    :func:`enable` built is closed (one passed to it stays open)."""
    off, owned = pipeline_offloader(engine)
    if disable_pipeline(engine):
        if owned:
            off.close()
        return
    off = wrapped_offloader(engine)
    owned = getattr(engine.__dict__.get("forward"), "tba_owned", False)
    if unwrap_forward(engine) and off is not None and owned:
        off.close()


def offloader_of(engine: Any) -> Offloader | None:
    """The Offloader :func:`enable` attached to ``engine`` (None when offload is off)."""
    return pipeline_offloader(engine)[0] or wrapped_offloader(engine)


def initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize`` (same arguments, same return value), then :func:`enable`."""
    import deepspeed

    out = deepspeed.initialize(*args, **kwargs)
    enable(out[0])
    return out
