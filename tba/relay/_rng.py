"""RNG state per layer and micro-batch, so that a recompute draws what its forward drew."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["replaying", "rng_state"]


def rng_state(device: torch.device):
    """The CPU generator's state (and the CUDA device's, when layers compute there)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replaying(state, device: torch.device):
    """Run with the RNG state a layer's forward had; the caller's state is restored after.
    ``state`` None: run as is."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
