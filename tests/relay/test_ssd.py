"""The SSD tiers leave nothing on disk: after close(), and after SIGKILL (nameless slabs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

import tba
from tba.relay import Relay, RelayConfig, layers_of
from tba.testing import GPT

from .conftest import TINY, adamw, token_batches

REPO = Path(__file__).resolve().parents[2]


def files_under(root: Path) -> list[str]:
    return [str(Path(d) / f) for d, _, fs in os.walk(root) for f in fs]


def test_close_removes_everything(tmp_path):
    root = tmp_path / "spill"
    storage = tba.Config(spill_dir=str(root), slab_bytes="4MiB", min_free_bytes=0, environ={})
    torch.manual_seed(0)
    relay = Relay(
        layers_of(GPT(TINY)),
        optimizer=adamw,
        micro_batches=2,
        config=RelayConfig(eps="ssd", stash="ssd"),
        storage=storage,
    )
    for x, y in token_batches(TINY.vocab, TINY.seq, 4, 2):
        relay.step(x, y)
    assert relay.stats()["eps_disk_bytes"] >= 3 * relay.param_bytes  # weights + AdamW state
    relay.close()
    assert not root.exists() or files_under(root) == [] and os.listdir(root) == []


def test_sigkill_leaves_no_bytes(tmp_path):
    root = tmp_path / "spill"
    script = f"""
import sys, time, torch
sys.path.insert(0, {str(REPO)!r})
import tba
from tba.relay import Relay, RelayConfig, layers_of
from tba.testing import GPT, GPTConfig, random_batch
cfg = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=3)
relay = Relay(layers_of(GPT(cfg)), optimizer=lambda p: torch.optim.AdamW(p), micro_batches=2,
              config=RelayConfig(eps="ssd", stash="ssd"),
              storage=tba.Config(spill_dir={str(root)!r}, slab_bytes="4MiB", min_free_bytes=0,
                                 environ={{}}))
relay.step(*random_batch(cfg, 4))
print(relay.stats()["eps_disk_bytes"], flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        on_disk = int(p.stdout.readline())
        assert on_disk > 0
        links = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
        assert any(str(root) in t and "(deleted)" in t for t in links)  # nameless slab files
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    assert files_under(root) == []  # at most the emptied per-process directory remains
