"""The relay on a CUDA device (``gpu`` marker: skipped without CUDA; run by
benchmarks/gpu/check.sh).

Exactness: the relay computing on the device against plain gradient accumulation on the same
device over the same micro-batches, 3 AdamW steps, under ``torch.use_deterministic_algorithms``
(without it two plain runs already differ on a GPU: BENCHMARKS.md, "The GPU check on an H200").
The relay's optimizer runs on the EPS, on the host, so the bit-for-bit reference runs its AdamW
on the host too, over CPU copies of the parameters (the CPU's own AdamW on the same gradients).
Against a reference whose AdamW runs on the device, only the first step's loss is bit-identical
(no update has run yet); later losses agree to a relative 1e-4: CUDA's AdamW (multi-tensor
kernels, compiled with fused multiply-adds) rounds differently from the CPU's, by an ulp or so
per update, and that difference then propagates through the forward.

Memory: the device's peak allocation during a step at depth 4, 8 and 16, with the host EPS and
the SSD stash (layer inputs leave the device), does not grow with depth; plain training's does.
"""

from __future__ import annotations

import copy
import dataclasses
import os

# cuBLAS is deterministic only with a fixed workspace, set before its first handle is made
# (as benchmarks/gpu/bench_gpu.py does): at import, that is at collection, before any test.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from tba.relay import Relay, RelayConfig, layers_of  # noqa: E402
from tba.testing import GPT, GPTConfig  # noqa: E402

from .conftest import adamw, relay_run, same_params, token_batches, total  # noqa: E402

pytestmark = pytest.mark.gpu

# Attention written out (matmuls, mask, softmax): every op has a deterministic CUDA kernel, so
# the comparison does not hang on which SDPA backend has one (the memory tests below use SDPA).
CFG = GPTConfig(vocab=128, seq=32, hidden=64, heads=4, layers=3, attention="explicit")
U = 4
STEPS = 3

MODES = {
    "host": dict(eps="host"),  # the CUDA defaults: workers on, one layer read ahead
    "host-serial": dict(eps="host", overlap=False),
    "host-graph": dict(eps="host", recompute=False),
    "host-ssd-stash": dict(eps="host", stash="ssd"),
    "ssd-ssd": dict(eps="ssd", stash="ssd"),
}


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def plain_on_device(model, batches, host_optimizer: bool) -> list[torch.Tensor]:
    """Gradient accumulation of a device copy of ``model`` over the micro-batches, then one
    AdamW step: on the host over ``model``'s own (CPU) parameters, as the relay's EPS runs
    it, or on the device. ``model`` ends with the trained values. Returns the losses (CPU)."""
    dev = copy.deepcopy(model).cuda()
    masters = list(model.parameters()) if host_optimizer else list(dev.parameters())
    opt = adamw(masters)
    out = []
    for x, y in batches:
        parts = []
        for xu, yu in zip(x.chunk(U), y.chunk(U)):
            loss = dev(xu.cuda(), yu.cuda()) / U
            loss.backward()
            parts.append(loss.detach())
        if host_optimizer:
            for m, p in zip(masters, dev.parameters()):
                m.grad, p.grad = p.grad.cpu(), None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(model.parameters(), dev.parameters()):
                if host_optimizer:
                    p.copy_(m)  # the updated masters go to the device for the next step
                else:
                    m.copy_(p)
        out.append(total(parts).cpu())
    return out


@pytest.fixture(scope="module")
def reference():
    """The initial model, the batches, and plain runs: host AdamW twice (the second is the
    control: if it differs from the first, bits say nothing here), then device AdamW."""
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        base = GPT(CFG)
        batches = token_batches(CFG.vocab, CFG.seq, 2 * U, steps=STEPS)
        runs = []
        for host in (True, True, False):
            m = copy.deepcopy(base)
            runs.append((plain_on_device(m, batches, host), m))
    finally:
        torch.use_deterministic_algorithms(False)
    (want, plain), (again, control) = runs[0], runs[1]
    if not (all(map(torch.equal, want, again)) and same_params(plain, control) == []):
        pytest.skip("plain accumulation differs from itself under deterministic algorithms")
    return base, batches, runs


@pytest.mark.parametrize("mode", list(MODES))
def test_matches_plain_accumulation_with_host_adamw(mode, reference, storage, deterministic):
    base, batches, runs = reference
    want, plain = runs[0]
    model = copy.deepcopy(base)
    got, relay = relay_run(model, batches, U, storage=storage, device="cuda", **MODES[mode])
    assert all(g.device.type == "cuda" for g in got)
    assert [g.item() for g in got] == [w.item() for w in want]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    assert same_params(plain, model) == []
    st = relay.stats()
    assert st["weight_bytes_moved"] == 2 * relay.param_bytes
    assert st["updates"] == len(relay.modules)


def test_against_adamw_on_the_device(reference, storage, deterministic):
    base, batches, runs = reference
    want, _ = runs[2]
    got, _ = relay_run(copy.deepcopy(base), batches, U, storage=storage, device="cuda")
    got = [g.cpu() for g in got]
    assert torch.equal(got[0], want[0])  # before any update: the same kernels, the same bits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)  # AdamW's rounding, see top


def test_dropout_masks_replay_on_the_device(deterministic):
    """The recompute draws the dropout masks its forward drew from the CUDA generator (as
    tests/relay/test_behaviour.py checks on the CPU): graph mode and recompute agree; without
    the RNG state restored they do not."""
    cfg = dataclasses.replace(CFG, dropout=0.2)
    batches = token_batches(cfg.vocab, cfg.seq, 4, 2)
    trained = {}
    for name, kw in {
        "graph": dict(recompute=False),
        "replayed": dict(recompute=True),
        "not replayed": dict(recompute=True, preserve_rng=False),
    }.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        torch.manual_seed(7)  # every device's generator
        losses, _ = relay_run(model, batches, 2, device="cuda", **kw)
        trained[name] = ([v.item() for v in losses], model)
    assert trained["graph"][0] == trained["replayed"][0]
    assert same_params(trained["graph"][1], trained["replayed"][1]) == []
    assert same_params(trained["graph"][1], trained["not replayed"][1]) != []


# -- device memory by depth -----------------------------------------------------------------------
# Activations dominate a layer's weights here (hidden 128, 16 x 512 tokens per micro-batch), so
# that the few layers' weights and gradients in flight with workers move the peak by < 5%.
MEM = GPTConfig(vocab=256, seq=512, hidden=128, heads=4, layers=4)
MEM_U, MEM_MICRO = 2, 16
DEPTHS = (4, 8, 16)


def _step_peak(step) -> int:
    """Bytes allocated on the device at the peak of ``step()``, above what was allocated
    before it (a second step: the first one made the kernels' workspaces)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _batch():
    return token_batches(MEM.vocab, MEM.seq, MEM_U * MEM_MICRO, steps=1)[0]


def relay_peak(depth: int, storage, **cfg) -> int:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(MEM, layers=depth))
    x, y = _batch()
    relay = Relay(
        layers_of(model),
        optimizer=adamw,
        micro_batches=MEM_U,
        config=RelayConfig(device="cuda", **cfg),
        storage=storage,
    )
    try:
        relay.step(x, y)
        return _step_peak(lambda: relay.step(x, y).item())
    finally:
        relay.close(restore=False)


def plain_peak(depth: int) -> int:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(MEM, layers=depth)).cuda()
    opt = adamw(list(model.parameters()))
    x, y = (t.cuda() for t in _batch())

    def step():
        for xu, yu in zip(x.chunk(MEM_U), y.chunk(MEM_U)):
            (model(xu, yu) / MEM_U).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return _step_peak(step)


MEMORY_MODES = {
    "host, ssd stash": dict(eps="host", stash="ssd"),  # the CUDA defaults: workers on
    "host, ssd stash, serial": dict(eps="host", stash="ssd", overlap=False),
    "ssd, ssd stash": dict(eps="ssd", stash="ssd"),
}


@pytest.mark.parametrize("mode", list(MEMORY_MODES))
def test_device_memory_does_not_grow_with_depth(mode, storage):
    peaks = {d: relay_peak(d, storage, **MEMORY_MODES[mode]) for d in DEPTHS}
    spread = max(peaks.values()) / min(peaks.values()) - 1
    mib = {d: round(p / 2**20, 1) for d, p in peaks.items()}
    assert spread < 0.05, f"relay ({mode}) peak MiB by depth {mib}: {spread:.1%} apart"


def test_plain_device_memory_grows_with_depth():
    peaks = {d: plain_peak(d) for d in (DEPTHS[0], DEPTHS[-1])}
    mib = {d: round(p / 2**20, 1) for d, p in peaks.items()}
    assert peaks[DEPTHS[-1]] > 2 * peaks[DEPTHS[0]], f"plain peak MiB by depth {mib}"
