"""Every error a relay user can meet, pinned: type and message."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tba
from tba.relay import Layers, Relay, RelayConfig, RelayConfigError, layers_of
from tba.testing import GPT

from .conftest import TINY, adamw, token_batches


def relay_of(layers, **kw):
    kw.setdefault("optimizer", adamw)
    kw.setdefault("micro_batches", 2)
    return Relay(layers, **kw)


def mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def test_a_whole_model_cannot_be_split():
    with pytest.raises(
        tba.ConfigError,
        match=r"^tba\.relay: a GPT module cannot be split as it stands: the relay needs the model "
        r"as a list of layers, embed → blocks → head",
    ):
        relay_of(GPT(TINY))


def test_no_adapter_for_an_unknown_model():
    with pytest.raises(
        RelayConfigError, match=r"no adapter knows Linear \(known: LlamaForCausalLM"
    ):
        layers_of(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "layers, match",
    [
        ([], r"the layer list is empty"),
        ("embed", r"got str: the relay needs the model as a list of layers"),
        ([nn.Linear(2, 2), 3], r"layer 1 is a int, not an nn.Module or a function that builds one"),
    ],
)
def test_bad_layer_lists(layers, match):
    with pytest.raises(RelayConfigError, match=match):
        relay_of(layers, loss=mse)


def test_a_list_needs_a_loss():
    with pytest.raises(RelayConfigError, match=r"with a list of modules needs loss=loss\(output"):
        relay_of([nn.Linear(2, 2)])


def test_loss_given_twice():
    with pytest.raises(RelayConfigError, match=r"loss given both to Relay and inside its Layers"):
        relay_of(layers_of(GPT(TINY)), loss=mse)


def test_a_builder_must_return_a_module():
    with pytest.raises(RelayConfigError, match=r"the function given for layer 0 returned a str"):
        relay_of([lambda: "linear"], loss=mse)


def test_parameters_must_be_on_the_cpu():
    with pytest.raises(RelayConfigError, match=r"parameter 'weight' of layer 0 is on meta"):
        relay_of([nn.Linear(2, 2, device="meta")], loss=mse)


def test_nothing_to_train():
    layer = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RelayConfigError, match=r"no layer has a parameter with requires_grad=True"):
        relay_of([layer], loss=mse)


def test_optimizer_factory_must_return_an_optimizer():
    with pytest.raises(RelayConfigError, match=r"returned a list for layer 0; it must return a"):
        relay_of([nn.Linear(2, 2)], loss=mse, optimizer=lambda params: params)


def test_optimizer_must_be_built_from_its_argument():
    model = nn.Linear(2, 2)
    other = nn.Linear(2, 2)
    with pytest.raises(RelayConfigError, match=r"holds 0 of the 2 parameters it was given"):
        relay_of([model], loss=mse, optimizer=lambda params: adamw(other.parameters()))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(eps="nvme"), r"eps='nvme' is invalid; expected one of host\|ssd\."),
        (dict(stash="disk"), r"stash='disk' is invalid; expected one of memory\|ssd\."),
        (dict(read_ahead=9), r"read_ahead=9 is invalid; expected a whole number from 0 to 4"),
        (dict(max_pending_updates=0), r"max_pending_updates=0 is invalid"),
        (dict(overlap="yes"), r"overlap='yes' is invalid; expected True or False"),
        (dict(workers=1), r"workers=1 is invalid; expected True, False or None"),
        (dict(device="gpu"), r"device='gpu' is invalid; expected a torch device"),
        (dict(stash="ssd", recompute=False), r"stash='ssd' needs recompute=True"),
        (dict(eps="x", stash="y"), r"^tba\.relay: 2 problems:\n  - eps='x'"),
    ],
)
def test_config_values(kw, match):
    with pytest.raises(RelayConfigError, match=match):
        RelayConfig(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(micro_batches=0), r"micro_batches=0 is invalid; expected a whole number >= 1"),
        (dict(optimizer=None), r"optimizer=None is not callable"),
        (dict(config=tba.Config(environ={})), r"config is a Config; pass a RelayConfig"),
    ],
)
def test_relay_arguments(kw, match):
    with pytest.raises(RelayConfigError, match=match):
        relay_of(layers_of(GPT(TINY)), **kw)


def test_batch_not_divisible_names_both_numbers():
    relay = relay_of(layers_of(GPT(TINY)), micro_batches=4)
    x, y = token_batches(TINY.vocab, TINY.seq, 10, 1)[0]
    with pytest.raises(
        RelayConfigError,
        match=r"the batch has 10 rows, which micro_batches=4 cannot split into equal "
        r"micro-batches; pass a batch whose first dimension is a multiple of 4 \(e\.g\. 8 or 12\)",
    ):
        relay.step(x, y)
    with pytest.raises(RelayConfigError, match=r"the target has 6 rows, which micro_batches=4"):
        relay.step(x[:8], y[:6])
    relay.close()


@pytest.mark.parametrize(
    "batch, match",
    [
        ("tokens", r"the batch is a str; pass a tensor, or a dict, tuple or list of tensors"),
        (torch.tensor(1), r"the batch is a 0-dim tensor"),
        ({"a": torch.zeros(4, 1), "b": torch.zeros(2, 1)}, r"the parts of the batch have"),
    ],
)
def test_batch_shapes(batch, match):
    relay = relay_of([nn.Linear(1, 1)], loss=mse)
    with pytest.raises(RelayConfigError, match=match):
        relay.step(batch, torch.zeros(4, 1))
    relay.close()


def test_a_layer_must_pass_one_tensor():
    layers = Layers([nn.Linear(2, 2), nn.Linear(2, 2)], mse, call=lambda i, m, x, e: (m(x),))
    relay = relay_of(layers)
    with pytest.raises(RelayConfigError, match=r"layer 0 returned a tuple; the relay passes one"):
        relay.step(torch.zeros(4, 2), torch.zeros(4, 2))
    # nothing ran an optimizer step: the relay stays usable, and holds nothing
    assert relay.parameters_of(0)["weight"].shape == (2, 2)
    relay.close()


def test_loss_must_be_a_scalar():
    relay = relay_of([nn.Linear(2, 2)], loss=lambda out, target: out)
    with pytest.raises(RelayConfigError, match=r"loss\(\) returned a tensor of shape \(2, 2\)"):
        relay.step(torch.zeros(4, 2), torch.zeros(4, 2))
    relay.close()


def test_closed_relay():
    relay = relay_of([nn.Linear(2, 2)], loss=mse)
    relay.close()
    with pytest.raises(tba.UsageError, match=r"tba\.relay: the Relay is closed; create a new one"):
        relay.step(torch.zeros(4, 2), torch.zeros(4, 2))


class Failing(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("optimizer exploded")


def test_failed_update_makes_the_relay_refuse_further_steps():
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    factories = iter([lambda p: Failing(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)])
    relay = relay_of(layers, loss=mse, optimizer=lambda p: next(factories)(p))
    with pytest.raises(RuntimeError, match="optimizer exploded"):
        relay.step(torch.ones(4, 2), torch.zeros(4, 2))
    with pytest.raises(
        tba.UsageError,
        match=r"an earlier step failed after some layers' optimizer steps had run \(RuntimeError: "
        r"optimizer exploded\); the model is partly updated",
    ):
        relay.step(torch.ones(4, 2), torch.zeros(4, 2))
    relay.close()


def test_ssd_quota_too_small(tmp_path):
    storage = tba.Config(
        spill_dir=str(tmp_path),
        slab_bytes="1MiB",
        max_disk_bytes="64KiB",
        min_free_bytes=0,
        environ={},
    )
    with pytest.raises(
        tba.CapacityError,
        match=r"tba\.relay: the SSD EPS could not reserve 1052672 bytes for "
        r"layer 0's weights in .* \(quota: the per-process quota TBA_MAX_DISK_BYTES=65536 is "
        r"used .*\)\. Free space",
    ):
        relay_of([nn.Linear(512, 512)], loss=mse, config=RelayConfig(eps="ssd"), storage=storage)
