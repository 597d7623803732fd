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


def test_regelu2_handles_the_tanh_form_and_tempo_skips_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(approximate="tanh"), nn.GELU())
    report = L.convert(copy.deepcopy(model), gelu="tempo")
    assert report.counts == {"GELU->TempoGELU": 1}
    assert report.skipped == {"1": "TempoGELU supports approximate='none' only, got 'tanh'"}
    converted = copy.deepcopy(model)
    report = L.convert(converted, gelu="regelu2")
    assert report.counts == {"GELU->ReGELU2": 2}
    assert converted[1].approximate == "tanh"


def test_silu_and_rmsnorm():
    model = LlamaLike()
    randomize_norms(model)
    ref = copy.deepcopy(model)
    report = L.convert(copy.deepcopy(model), silu="resilu2", norm="tempo")
    assert report.counts == {"SiLU->ReSiLU2": 2}
    assert len(report.skipped) == 5
    assert report.skipped["model.norm"] == (
        "Tempo has no RMSNorm variant; use norm='ms' to make RMSNorms lean"
    )
    report = L.convert(model, silu="resilu2", norm="ms", example_inputs=IDX)
    assert report.counts == {"SiLU->ReSiLU2": 2, "RMSNorm->MSRMSNorm": 5}
    assert report.merge is not None and report.merge.verified
    with torch.no_grad():  # both conversions keep the forward exact
        assert torch.allclose(model(IDX), ref(IDX), atol=1e-5)


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
        ValueError, match=r"silu='tempo' is not accepted; use one of 'resilu2', None"
    ):
        L.convert(model, silu="tempo")
    with pytest.raises(
        L.LayerOptionError, match=r"norm='rms' is not accepted; use one of 'tempo', 'ms', None"
    ):
        L.convert(model, norm="rms")
    with pytest.raises(L.LayerOptionError, match=r"norm=True is not accepted"):
        L.convert(model, norm=True)
    with pytest.raises(L.LayerTypeError, match=r"model must be a torch.nn.Module, got OrderedDict"):
        L.convert(model.state_dict(), gelu="tempo")
    assert isinstance(model.blocks[0].mlp.act, nn.GELU)  # validated before changing anything
