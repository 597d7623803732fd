"""merge_norm_affine: fold gamma/beta into the consumer Linears and switch to MS norms."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tba.layers as L

from ._support import LlamaLike, TinyGPT, randomize_norms

IDX = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def outputs_match(a, b, idx=IDX, atol=1e-5):
    a.eval()
    b.eval()
    with torch.no_grad():
        return torch.allclose(a(idx), b(idx), rtol=1e-5, atol=atol)


def test_pre_ln_transformer():
    torch.manual_seed(0)
    model = TinyGPT()
    randomize_norms(model)
    original = copy.deepcopy(model)
    report = L.merge_norm_affine(model)
    assert report.merged == {
        "blocks.0.ln1": ["blocks.0.attn.qkv"],
        "blocks.0.ln2": ["blocks.0.mlp.fc1"],
        "blocks.1.ln1": ["blocks.1.attn.qkv"],
        "blocks.1.ln2": ["blocks.1.mlp.fc1"],
        "ln_f": ["lm_head"],
    }
    assert set(report.replaced.values()) == {"MSLayerNorm"}
    assert report.added_biases == ["lm_head"]  # beta of ln_f needs a bias there
    assert isinstance(model.blocks[0].ln1, L.MSLayerNorm)
    assert not any(k.startswith("ln_f") or ".ln" in k for k in model.state_dict())
    assert outputs_match(model, original)
    assert "blocks.0.ln1 -> blocks.0.attn.qkv" in str(report)


def test_parameters_keep_their_identity():
    model = TinyGPT()
    weight = model.blocks[0].attn.qkv.weight
    L.merge_norm_affine(model)
    assert model.blocks[0].attn.qkv.weight is weight


def test_llama_style_rmsnorm():
    torch.manual_seed(1)
    model = LlamaLike()
    randomize_norms(model)
    original = copy.deepcopy(model)
    report = L.merge_norm_affine(model, example_inputs=IDX)
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert report.merged["model.layers.0.input_layernorm"] == qkv
    assert report.merged["model.layers.1.post_attention_layernorm"] == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    assert report.merged["model.norm"] == ["lm_head"]
    assert report.verified and not report.added_biases
    assert isinstance(model.model.norm, L.MSRMSNorm)
    assert outputs_match(model, original)


class HFStyleRMSNorm(nn.Module):
    """Like transformers' LlamaRMSNorm: weight * x * rsqrt(mean(x^2) + variance_epsilon)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.variance_epsilon)).to(x.dtype)


def test_user_rmsnorm_class_via_rms_norm_types():
    model = LlamaLike(norm=HFStyleRMSNorm)
    randomize_norms(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, HFStyleRMSNorm):
                m.weight.uniform_(0.5, 1.5)
    original = copy.deepcopy(model)
    report = L.merge_norm_affine(model, rms_norm_types=(HFStyleRMSNorm,))
    assert len(report.merged) == 5
    assert model.model.norm.eps == 1e-6
    assert outputs_match(model, original)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.LayerNorm(8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.side = nn.Linear(8, 4)

    def forward(self, x):
        h = self.pre(x)
        return self.side(F.relu(self.a(h)) + self.b(h))


def test_explicit_mapping_and_unknown_consumers():
    model = Custom()
    randomize_norms(model)
    x = torch.randn(3, 8)
    with pytest.raises(
        L.NormMergeError,
        match=r"cannot determine the Linears fed by 'pre' \(LayerNorm\): no pattern for "
        r"attribute name 'pre'\. Pass mapping=",
    ):
        L.merge_norm_affine(model)
    assert isinstance(model.pre, nn.LayerNorm)  # nothing changed
    report = L.merge_norm_affine(copy.deepcopy(model), skip_unknown=True)
    assert report.skipped == {"pre": "no pattern for attribute name 'pre'"} and not report.merged
    merged = copy.deepcopy(model)
    report = L.merge_norm_affine(merged, {"pre": ["a", "b"]}, example_inputs=x)
    assert report.merged == {"pre": ["a", "b"]} and report.verified
    with torch.no_grad():
        assert torch.allclose(merged(x), model(x), atol=1e-6)


def test_mapping_errors():
    model = Custom()
    with pytest.raises(L.NormMergeError, match=r"mapping names 'a', which is not a LayerNorm"):
        L.merge_norm_affine(model, {"a": ["b"]})
    with pytest.raises(L.NormMergeError, match=r"consumer 'nope' of norm 'pre' is nothing"):
        L.merge_norm_affine(model, {"pre": ["nope"]})
    model.relu = nn.ReLU()
    with pytest.raises(L.NormMergeError, match=r"consumer 'relu' of norm 'pre' is ReLU, not"):
        L.merge_norm_affine(model, {"pre": ["relu"]})
    model.wide = nn.Linear(9, 8)
    with pytest.raises(L.NormMergeError, match=r"'wide' has in_features=9 but norm 'pre'"):
        L.merge_norm_affine(model, {"pre": ["wide"]})
    model.pre2 = nn.LayerNorm(8)
    with pytest.raises(L.NormMergeError, match=r"'a' is claimed by two norms, 'pre' and 'pre2'"):
        L.merge_norm_affine(model, {"pre": ["a"], "pre2": ["a"]})


def test_wrong_mapping_is_caught_by_the_flow_check_and_rolled_back():
    model = Custom()
    randomize_norms(model)
    x = torch.randn(3, 8)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        L.NormMergeError, match=r"'side' received a tensor that is not its output .* of 'pre'"
    ):
        L.merge_norm_affine(model, {"pre": ["a", "b", "side"]}, example_inputs=x)
    model.unused = nn.Linear(8, 8)
    with pytest.raises(L.NormMergeError, match=r"'unused' was not called \(checked with"):
        L.merge_norm_affine(model, {"pre": ["a", "unused"]}, example_inputs=x)
    assert isinstance(model.pre, nn.LayerNorm)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v)


class LeakyBlock(nn.Module):
    """The norm output also feeds a residual: folding it into 'attn.qkv' alone is wrong."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(8)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(8, 8)

    def forward(self, x):
        h = self.ln1(x)
        return h + self.attn.qkv(h)


def test_extra_consumer_is_caught_by_the_output_check_and_rolled_back():
    model = LeakyBlock()
    randomize_norms(model)
    weight = model.attn.qkv.weight.detach().clone()
    with pytest.raises(
        L.NormMergeError, match=r"merging changed the model's outputs by .* the model was restored"
    ):
        L.merge_norm_affine(model, example_inputs=torch.randn(4, 8))
    assert isinstance(model.ln1, nn.LayerNorm)
    assert torch.equal(model.attn.qkv.weight, weight)
    assert model.attn.qkv.bias is not None


def test_tied_lm_head():
    model = LlamaLike(tie=True)
    randomize_norms(model)
    with pytest.raises(
        L.NormMergeError, match=r"lm_head.weight is shared with model.embed_tokens.weight"
    ):
        L.merge_norm_affine(model)
    original = copy.deepcopy(model)
    report = L.merge_norm_affine(model, untie=True)
    assert report.untied == ["lm_head.weight"]
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)
    assert outputs_match(model, original)


def test_pattern_without_linears_and_empty_mapping():
    model = nn.Module()
    model.ln_1 = nn.LayerNorm(8)
    model.attn = nn.Module()
    model.attn.c_attn = nn.Conv1d(8, 8, 1)  # torch's Conv1d (not HF's Conv1D) is not Linear
    with pytest.raises(
        L.NormMergeError,
        match=r"fed by 'ln_1' \(LayerNorm\): no candidate exists as nn.Linear or HF Conv1D "
        r"\(tried attn.c_attn; attn.qkv; attn.q_proj\+attn.k_proj\+attn.v_proj; qkv\)",
    ):
        L.merge_norm_affine(model)
    with pytest.raises(L.NormMergeError, match=r"'ln_1' \(LayerNorm\): mapping= lists no Linears"):
        L.merge_norm_affine(model, {"ln_1": []})


def test_affine_free_rmsnorm_and_multi_dim_rmsnorm():
    model = nn.Sequential(nn.RMSNorm(8, elementwise_affine=False), nn.Linear(8, 2))
    assert L.merge_norm_affine(model).replaced == {"0": "MSRMSNorm"}
    model = nn.Sequential(nn.RMSNorm((2, 4)))
    with pytest.raises(L.NormMergeError, match=r"'0' normalizes over \(2, 4\); only a last-dim"):
        L.merge_norm_affine(model)


def test_multi_dim_norm_is_refused():
    model = nn.Module()
    model.norm = nn.LayerNorm((2, 4))
    with pytest.raises(L.NormMergeError, match=r"'norm' normalizes over \(2, 4\); only a last-dim"):
        L.merge_norm_affine(model)


def test_affine_free_norms_are_swapped_without_consumers():
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False), nn.ReLU())
    report = L.merge_norm_affine(model)
    assert report.replaced == {"0": "MSLayerNorm"} and report.merged == {}


def test_rms_class_without_eps_is_refused():
    class NoEps(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    model = nn.Module()
    model.norm = NoEps()
    model.lm_head = nn.Linear(8, 3)
    with torch.no_grad():
        model.norm.weight.fill_(2.0)
    weight = model.lm_head.weight.detach().clone()
    with pytest.raises(L.NormMergeError, match=r"NoEps has neither 'eps' nor 'variance_epsilon'"):
        L.merge_norm_affine(model, rms_norm_types=(NoEps,))
    assert torch.equal(model.lm_head.weight, weight)  # refused before changing anything


def test_skip_tied_leaves_that_norm_and_merges_the_rest():
    model = LlamaLike(tie=True)
    randomize_norms(model)
    original = copy.deepcopy(model)
    report = L.merge_norm_affine(model, skip_tied=True, example_inputs=IDX)
    assert report.skipped == {
        "model.norm": "lm_head.weight is shared with model.embed_tokens.weight; folding gamma "
        "into it would change both"
    }
    assert len(report.merged) == 4 and report.verified
    assert isinstance(model.model.norm, nn.RMSNorm)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert outputs_match(model, original)


class Aliased(nn.Module):
    """One Linear registered under two names: one holder of its weight, not a tie."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(8)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(8, 8)
        self.alias = self.attn.qkv

    def forward(self, x):
        return self.attn.qkv(self.ln1(x))


def test_a_module_registered_twice_is_folded_once():
    model = Aliased()
    randomize_norms(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = model(x)
    report = L.merge_norm_affine(model, example_inputs=x)
    assert report.merged == {"ln1": ["attn.qkv"]} and report.verified and not report.untied
    assert model.alias is model.attn.qkv
    with torch.no_grad():
        assert torch.allclose(model(x), before, atol=1e-6)


def test_two_consumers_sharing_one_weight_are_refused():
    model = Custom()
    model.b.weight = model.a.weight  # folding gamma into both would apply it twice
    with pytest.raises(
        L.NormMergeError,
        match=r"merge_norm_affine: a.weight is shared with b.weight; folding gamma into it would "
        r"change those too\. Pass untie=True to give 'a' its own copy, skip_tied=True",
    ):
        L.merge_norm_affine(model, {"pre": ["a", "b"]})
    report = L.merge_norm_affine(model, {"pre": ["a", "b"]}, untie=True)
    assert report.untied == ["a.weight", "b.weight"]
    assert model.a.weight is not model.b.weight


def test_flow_failure_with_skip_unknown_skips_only_that_norm():
    model = LlamaLike()
    randomize_norms(model)
    original = copy.deepcopy(model)
    wrong = {"model.layers.0.input_layernorm": ["model.layers.0.self_attn.o_proj"]}
    report = L.merge_norm_affine(model, wrong, skip_unknown=True, example_inputs=IDX)
    assert report.skipped == {
        "model.layers.0.input_layernorm": "tba.layers.merge_norm_affine: "
        "'model.layers.0.self_attn.o_proj' received a tensor that is not its output (checked with "
        "example_inputs), so it is not a consumer of 'model.layers.0.input_layernorm'. Fix "
        "mapping= for 'model.layers.0.input_layernorm' or leave it out with skip_unknown=True."
    }
    assert len(report.merged) == 4 and report.verified
    assert outputs_match(model, original)


class OnePlusWeightNorm(nn.Module):
    """Gemma's (1 + weight) RMSNorm: recognised by behaviour, gamma = 1 + weight."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def test_one_plus_weight_norms_are_recognised_and_folded_with_gamma_plus_one():
    model = LlamaLike(norm=OnePlusWeightNorm)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, OnePlusWeightNorm):
                m.weight.uniform_(-0.5, 0.5)
    original = copy.deepcopy(model)
    report = L.merge_norm_affine(model, example_inputs=IDX)
    assert len(report.merged) == 5 and set(report.replaced.values()) == {"MSRMSNorm"}
    assert model.model.norm.eps == 1e-6
    assert outputs_match(model, original)
