"""Recognition by behaviour: every HF activation name and norm class the families use."""

import dataclasses

import pytest
import torch
from torch import nn

from tba.layers._detect import classify_activation, classify_norm, linear_weight

tf = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402

EXPECTED_KIND = {
    "gelu": "gelu",  # GELUActivation (BERT, RoBERTa)
    "gelu_python": "gelu",
    "gelu_new": "gelu-tanh",  # NewGELUActivation (GPT-2)
    "gelu_pytorch_tanh": "gelu-tanh",  # GELUTanh (Gemma)
    "gelu_python_tanh": "gelu-tanh",
    "gelu_fast": "gelu-tanh",  # the same curve with a 10-digit constant
    "gelu_accurate": "gelu-tanh",
    "silu": "silu",  # SiLUActivation (Llama, Mistral, Qwen2)
    "swish": "silu",
    "relu": "relu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "identity",
    "quick_gelu": None,  # x * sigmoid(1.702 x): no lean variant
    "gelu_10": None,  # clipped at +-10
    "mish": None,
    "laplace": None,
    "relu2": None,
}


@pytest.mark.parametrize("name", list(EXPECTED_KIND))
def test_hf_activation_names(name):
    result = classify_activation(ACT2FN[name])
    assert result is not None
    assert result.kind == EXPECTED_KIND[name], result.reason
    if result.kind is None:
        assert "no lean variant" in result.reason


@pytest.mark.parametrize(
    ("module", "kind"),
    [
        (nn.GELU(), "gelu"),
        (nn.GELU("tanh"), "gelu-tanh"),
        (nn.SiLU(), "silu"),
        (nn.ReLU(inplace=True), "relu"),
        (nn.Hardswish(), None),
    ],
)
def test_torch_activations(module, kind):
    assert classify_activation(module).kind == kind


@pytest.mark.parametrize(
    "module", [nn.Linear(2, 2), nn.Dropout(0.1), nn.Softmax(-1), nn.Identity(), nn.Sequential()]
)
def test_non_activations_are_not_candidates(module):
    assert classify_activation(module) is None


def test_hf_norm_classes():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    llama, qwen, gemma = LlamaRMSNorm(16, eps=1e-5), Qwen2RMSNorm(16), GemmaRMSNorm(16)
    assert dataclasses.astuple(classify_norm(llama)) == ("rms", 16, 1e-5, 0.0, "llama")
    assert dataclasses.astuple(classify_norm(qwen)) == ("rms", 16, 1e-6, 0.0, "llama")
    assert dataclasses.astuple(classify_norm(gemma)) == ("rms", 16, 1e-6, 1.0, "gemma")
    with torch.no_grad():  # still told apart when the weights look alike
        gemma.weight.fill_(1.0)
        llama.weight.fill_(0.0)
    assert classify_norm(gemma).offset == 1.0 and classify_norm(llama).offset == 0.0
    llama.variance_epsilon = 1e-2  # the probe checks eps: a wrong eps is not a match
    assert classify_norm(llama).eps == 1e-2
    assert dataclasses.astuple(classify_norm(nn.LayerNorm(16))) == ("layer", 16, 1e-5, 0.0, "layer")
    assert classify_norm(nn.BatchNorm1d(16)) is None


class LyingNorm(nn.Module):
    """Says eps=1e-6 but uses 1e-2: the probe at small scale tells."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2)


def test_wrong_eps_is_not_a_match():
    reason = classify_norm(LyingNorm())
    assert isinstance(reason, str) and "computes none of LayerNorm" in reason


def test_linear_weight_views():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(6, 4)  # nf=6 outputs, nx=4 inputs, weight stored (4, 6)
    view = linear_weight(conv)
    assert view.shape == (6, 4) and view.data_ptr() == conv.weight.data_ptr()
    assert linear_weight(nn.Linear(4, 6)).shape == (6, 4)
    assert linear_weight(nn.Conv1d(4, 6, 1)) is None
