"""convert: swaps modules in place and reports exactly what it changed."""

import copy

import pytest
import torch
from torch import nn

import tba.layers as L

from ._support import LlamaLike, TinyGPT, randomize_norms

IDX = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_tempo_everything_reports_names_and_keeps_parameters():
    model = TinyGPT()
    params = {n: p for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    report = L.convert(model, gelu="tempo", norm="tempo")
    assert report.counts == {"GELU->TempoGELU": 2, "LayerNorm->TempoLayerNorm": 5}
    assert report.replaced["GELU->TempoGELU"] == ["blocks.0.mlp.act", "blocks.1.mlp.act"]
    assert report.replaced["LayerNorm->TempoLayerNorm"][-1] == "ln_f"
    assert report.total == 7 and report.skipped == {}
    assert isinstance(model.blocks[1].mlp.act, L.TempoGELU)
    assert isinstance(model.ln_f, L.TempoLayerNorm)
    assert set(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert "GELU->TempoGELU: 2 (blocks.0.mlp.act, blocks.1.mlp.act)" in str(report)


def test_outputs_unchanged_by_exact_conversions():
    model = TinyGPT()
    randomize_norms(model)
    ref = copy.deepcopy(model)
    L.convert(model, gelu="tempo", norm="ms")
    with torch.no_grad():
        assert torch.allclose(model(IDX), ref(IDX), atol=1e-5)


def test_both_gelu_forms_are_handled():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(approximate="tanh"), nn.GELU())
    converted = copy.deepcopy(model)
    report = L.convert(converted, gelu="tempo")
    assert report.counts == {"GELU->TempoGELU": 2} and report.skipped == {}
    assert converted[1].approximate == "tanh" and converted[2].approximate == "none"
    converted = copy.deepcopy(model)
    report = L.convert(converted, gelu="regelu2")
    assert report.counts == {"GELU->ReGELU2": 2}
    assert converted[1].approximate == "tanh"


def test_silu_and_rmsnorm():
    model = LlamaLike()
    randomize_norms(model)
    ref = copy.deepcopy(model)
    tempo = copy.deepcopy(model)
    report = L.convert(tempo, silu="tempo", norm="tempo")
    assert report.counts == {"SiLU->TempoSiLU": 2, "RMSNorm->TempoRMSNorm": 5}
    assert report.skipped == {}
    assert isinstance(tempo.model.norm, L.TempoRMSNorm) and tempo.model.norm.style == "torch"
    report = L.convert(model, silu="resilu2", norm="ms", example_inputs=IDX)
    assert report.counts == {"SiLU->ReSiLU2": 2, "RMSNorm->MSRMSNorm": 5}
    assert report.merge is not None and report.merge.verified
    with torch.no_grad():  # both conversions keep the forward exact
        assert torch.allclose(model(IDX), ref(IDX), atol=1e-5)
        assert torch.equal(tempo(IDX), ref(IDX))


def test_shared_module_stays_shared_and_root_is_left_alone():
    act = nn.GELU()
    model = nn.Sequential(nn.Linear(3, 3), act, nn.Linear(3, 3), act)
    report = L.convert(model, gelu="tempo")
    assert report.replaced == {"GELU->TempoGELU": ["1", "3"]}
    assert model[1] is model[3] and isinstance(model[3], L.TempoGELU)
    bare = nn.GELU()
    assert L.convert(bare, gelu="tempo").total == 0


def test_nothing_requested_changes_nothing():
    model = TinyGPT()
    assert L.convert(model).total == 0


def test_bad_options_name_the_option_and_the_accepted_values():
    model = TinyGPT()
    with pytest.raises(
        L.LayerOptionError,
        match=r"convert: gelu='fast' is not accepted; use one of 'tempo', 'regelu2', None\.",
    ):
        L.convert(model, gelu="fast")
    with pytest.raises(
        ValueError, match=r"silu='fast' is not accepted; use one of 'tempo', 'resilu2', None"
    ):
        L.convert(model, silu="fast")
    with pytest.raises(
        L.LayerOptionError,
        match=r"norm='rms' is not accepted; use one of 'tempo', 'ms', 'ms-or-tempo', None",
    ):
        L.convert(model, norm="rms")
    with pytest.raises(
        L.LayerOptionError,
        match=r"convert: preset='fast' is not accepted; use one of 'exact', 'approx', "
        r"'gpt2-exact', 'gpt2-approx', 'bert-exact'",
    ):
        L.convert(model, preset="fast")
    with pytest.raises(L.LayerOptionError, match=r"preset='exact' and gelu/silu/norm were both"):
        L.convert(model, preset="exact", gelu="tempo")
    with pytest.raises(
        L.LayerOptionError,
        match=r"preset='llama-exact' is for config.model_type in \('llama',\), "
        r"but the model's is None",
    ):
        L.convert(model, preset="llama-exact")
    with pytest.raises(L.LayerOptionError, match=r"norm=True is not accepted"):
        L.convert(model, norm=True)
    with pytest.raises(L.LayerTypeError, match=r"model must be a torch.nn.Module, got OrderedDict"):
        L.convert(model.state_dict(), gelu="tempo")
    assert isinstance(model.blocks[0].mlp.act, nn.GELU)  # validated before changing anything


class QuickGELU(nn.Module):  # CLIP's x * sigmoid(1.702 x): close to GELU, but not GELU
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class PairActivation(nn.Module):  # an "activation" that needs two inputs
    def forward(self, x, gate):
        return x * gate


class FancyNorm(nn.Module):  # named like a norm, computes something else
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.eps = 1e-5

    def forward(self, x):
        return x * self.weight


class NoEpsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x


def test_unknown_activations_and_norms_are_reported_never_skipped_silently():
    model = nn.Sequential(
        nn.Linear(4, 4),
        QuickGELU(),
        nn.Mish(),
        nn.PReLU(),
        PairActivation(),
        nn.Tanh(),
        nn.ReLU(),
        FancyNorm(),
        NoEpsNorm(),
        nn.SiLU(),
    )
    report = L.convert(model, preset="exact")
    assert report.counts == {"SiLU->TempoSiLU": 1}
    assert report.skipped == {
        "1": "QuickGELU computes none of GELU (erf), GELU (tanh), SiLU on a probe; no lean "
        "variant of it exists",
        "2": "Mish computes none of GELU (erf), GELU (tanh), SiLU on a probe; no lean variant "
        "of it exists",
        "3": "PReLU has parameters; no lean variant of it exists",
        "4": "PairActivation could not be probed (TypeError: PairActivation.forward() missing 1 "
        "required positional argument: 'gate')",
        "7": "FancyNorm computes none of LayerNorm, weight * x_hat, (1 + weight) * x_hat on a "
        "probe with its own eps=1e-05",
        "8": "NoEpsNorm has none of the attributes eps, variance_epsilon, epsilon",
    }
    assert report.kept == {
        "5": "tanh: saves only its output, or nothing",
        "6": "relu: saves only its output, or nothing",
    }
    text = str(report)
    assert "tba.layers.convert: replaced 1 modules (preset 'exact')" in text
    assert "  skipped 3: PReLU has parameters" in text and "  kept 5: tanh" in text


def test_gelu_only_leaves_silu_unreported():
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), nn.GELU(), QuickGELU())
    report = L.convert(model, gelu="tempo")
    assert report.counts == {"GELU->TempoGELU": 1}
    assert set(report.skipped) == {"3"}  # the unknown one is still reported
    assert isinstance(model[1], nn.SiLU)


def test_approx_recipe_on_a_plain_model_merges_and_falls_back():
    model = LlamaLike(tie=True)
    randomize_norms(model)
    ref = copy.deepcopy(model)
    report = L.convert(model, silu="resilu2", norm="ms-or-tempo", example_inputs=IDX)
    assert report.counts == {
        "RMSNorm->MSRMSNorm": 4,
        "SiLU->ReSiLU2": 2,
        "RMSNorm->TempoRMSNorm": 1,
    }
    assert report.replaced["RMSNorm->TempoRMSNorm"] == ["model.norm"]  # its lm_head is tied
    assert report.skipped == {} and report.merge.verified
    assert report.merge.skipped == {
        "model.norm": "lm_head.weight is shared with model.embed_tokens.weight; folding gamma "
        "into it would change both"
    }
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is kept
    with torch.no_grad():
        assert torch.allclose(model(IDX), ref(IDX), atol=1e-5)


def test_multi_dim_layernorm_still_converts_to_tempo():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm((2, 4)))
    report = L.convert(model, norm="tempo")
    assert report.counts == {"LayerNorm->TempoLayerNorm": 1}
    assert model[1].normalized_shape == (2, 4)
