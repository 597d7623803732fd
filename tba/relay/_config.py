"""`RelayConfig`: where the relay keeps weights, optimizer state and the stash, and how it overlaps.

Storage settings (spill directory, backend, slab size, checksum, I/O threads, quota, staging
bytes) are not repeated here: they are the fields of :class:`tba.Config`, passed to the relay as
``storage``. ``TBA_ENABLED`` does not apply: a relay is not an activation offloader.
"""

from __future__ import annotations

import dataclasses

import torch

from ._errors import RelayConfigError

__all__ = ["EPS_TIERS", "STASH_PLACES", "RelayConfig", "check_arguments"]

EPS_TIERS = ("host", "ssd")
STASH_PLACES = ("memory", "ssd")


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    """Options of a :class:`tba.relay.Relay`. Every problem is reported in one RelayConfigError."""

    eps: str = "host"
    """Where the eager parameter server (EPS) keeps each layer's weights, gradients and optimizer
    state between uses. ``"host"`` (default, the L2L paper): host memory; on a CUDA host only the
    executing layer's weights are on the device. ``"ssd"``: tba slab files through tba's storage
    backend (O_DIRECT, nameless files: nothing survives the process, even SIGKILL); only the
    layers being fetched, computed or updated are in memory, so the model may be larger than host
    RAM. Costs one read of the weights per pass and, per step, one read and one write of the
    optimizer state and one write of the weights."""

    stash: str = "memory"
    """Where each layer's input is kept between the forward and the backward pass (with
    ``recompute=True``): ``"memory"`` (default) or ``"ssd"`` (written during the forward, read
    back one layer ahead in the backward). With ``"ssd"`` and ``eps="ssd"`` the relay's memory
    does not grow with depth."""

    recompute: bool = True
    """True (default, L2L): stash only each layer's input and recompute the layer's forward, one
    micro-batch at a time, in the backward pass. Activation memory is one layer's, whatever the
    depth, at the cost of one more forward pass (about a third more compute for transformer
    blocks). False: keep each layer's autograd graph from the forward pass; its saved activations
    stay in memory (as in plain training, so they grow with depth) but its weights do not (NOTE
    [Weights out of the graph]); no recompute."""

    overlap: bool = True
    """True (default): work that does not need the compute thread's cores runs while a layer
    computes: the next layers' weights and stashed inputs are read from the SSD ahead, and
    with ``workers`` the host copies and each layer's optimizer step run on worker threads.
    False: everything in turn on the calling thread (for measuring what overlap saves)."""

    workers: bool | None = None
    """Run the EPS's CPU work (host-tier weight copies, optimizer steps) on worker threads, so
    that layer l's optimizer step runs while layer l-1 computes. None (default): workers when
    layers compute on a CUDA device (the CPU is free then); on the CPU they would compete with
    compute for the same cores, so the compute thread runs that work itself, between layers
    (BENCHMARKS.md, "Relay", measures both). Disk I/O is asynchronous either way."""

    read_ahead: int = 1
    """How many layers' weights are fetched ahead of the executing one (with ``overlap``). Each
    costs one layer's weights in memory; 2 helps when a read from the SSD takes longer than a
    layer's compute."""

    max_pending_updates: int = 2
    """Most layers whose optimizer step is queued or running. A layer waiting for a free slot
    holds its gradients (and with ``eps="ssd"`` its weights and optimizer state) in memory, so
    this bounds memory when optimizer steps are slower than compute; the wait is counted in
    ``stats()["update_wait_seconds"]``."""

    device: str = "cpu"
    """Where layers compute: ``"cpu"`` or a CUDA device such as ``"cuda:0"`` (its tests,
    tests/relay/test_gpu.py, run in the GPU check); the EPS stays in host memory or on the SSD
    either way."""

    preserve_rng: bool = True
    """With ``recompute``: save the RNG state before each layer's forward on each micro-batch and
    restore it for the recompute, so that dropout draws the same masks twice."""

    def use_workers(self) -> bool:
        """Whether worker threads run the EPS's CPU work (see ``workers``)."""
        if not self.overlap:
            return False
        return (
            self.workers if self.workers is not None else torch.device(self.device).type == "cuda"
        )

    def __post_init__(self) -> None:
        problems = []
        if self.eps not in EPS_TIERS:
            problems.append(f"eps={self.eps!r} is invalid; expected one of {'|'.join(EPS_TIERS)}.")
        if self.stash not in STASH_PLACES:
            problems.append(
                f"stash={self.stash!r} is invalid; expected one of {'|'.join(STASH_PLACES)}."
            )
        if self.workers is not None and not isinstance(self.workers, bool):
            problems.append(f"workers={self.workers!r} is invalid; expected True, False or None.")
        for name in ("recompute", "overlap", "preserve_rng"):
            if not isinstance(getattr(self, name), bool):
                problems.append(
                    f"{name}={getattr(self, name)!r} is invalid; expected True or False."
                )
        if not _whole(self.read_ahead, 0, 4):
            problems.append(
                f"read_ahead={self.read_ahead!r} is invalid; expected a whole number from 0 to 4."
            )
        if not _whole(self.max_pending_updates, 1, 64):
            problems.append(
                f"max_pending_updates={self.max_pending_updates!r} is invalid; expected a whole "
                "number from 1 to 64."
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            problems.append(
                f"device={self.device!r} is invalid; expected a torch device such as 'cpu' or "
                "'cuda:0'."
            )
        if self.stash == "ssd" and self.recompute is False:
            problems.append(
                "stash='ssd' needs recompute=True: without recompute the relay keeps each "
                "layer's autograd graph, whose saved activations stay in memory. Use "
                "recompute=True, or stash='memory'."
            )
        if problems:
            raise RelayConfigError(problems)


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_arguments(config: object, micro_batches: object, optimizer: object) -> RelayConfig:
    """The Relay's own arguments, checked; returns the config (a default one for None)."""
    cfg = RelayConfig() if config is None else config
    if not isinstance(cfg, RelayConfig):
        raise RelayConfigError(f"config is a {type(cfg).__name__}; pass a RelayConfig.")
    if not _whole(micro_batches, 1, 1 << 20):
        raise RelayConfigError(
            f"micro_batches={micro_batches!r} is invalid; expected a whole number >= 1."
        )
    if not callable(optimizer):
        raise RelayConfigError(
            f"optimizer={optimizer!r} is not callable; pass a factory such as "
            "lambda params: torch.optim.AdamW(params, lr=1e-4)."
        )
    return cfg
