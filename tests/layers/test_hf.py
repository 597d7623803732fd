"""convert(preset=...) on random-init HF GPT-2, BERT, RoBERTa, Llama, Mistral, Qwen2 and Gemma.

Tolerances (float32, CPU), per parameter p: |grad - reference| <= RTOL * max|reference_p| +
ATOL * max over all parameters of |reference|. The layer-level bounds behind them are in
docs/layers.md: TempoGELU / TempoSiLU derivatives within 5e-6 (5e-4 within 0.05 of the
minimum), Tempo norms exact up to the rounding of y. ATOL covers gradients that are zero in exact
arithmetic (attention key biases) and come out as rounding noise on both sides.
"""

import copy

import pytest
import torch

import tba.layers as L

from ._hf import EXPECTED, FAMILIES, batch, build, class_counts, loss_and_grads

RTOL, ATOL = 1e-5, 1e-6


def assert_grads_close(got: dict, ref: dict, rtol=RTOL, atol=ATOL):
    assert set(got) == set(ref)
    top = max(float(g.abs().max()) for g in ref.values())
    for name, g in got.items():
        want = ref[name]
        err = float((g - want).abs().max())
        assert err <= rtol * float(want.abs().max()) + atol * top, (name, err)


@pytest.mark.parametrize("preset", ["exact", "approx"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_activation_and_norm_is_replaced(family, preset):
    model = build(family)
    acts, norms = EXPECTED[family]
    assert class_counts(model, {*acts, *norms}) == {**acts, **norms}  # the test knows the model
    report = L.convert(model, preset=f"{family}-{preset}")
    assert report.skipped == {} and report.kept == {}
    assert report.total == sum(acts.values()) + sum(norms.values())
    assert class_counts(model, {*acts, *norms}) == {}  # none left
    act_new = "TempoGELU" if preset == "exact" else "ReGELU2"
    if family in ("llama", "mistral", "qwen2"):
        act_new = "TempoSiLU" if preset == "exact" else "ReSiLU2"
    (act_cls,) = acts
    assert report.counts[f"{act_cls}->{act_new}"] == acts[act_cls]
    assert report.preset == f"{family}-{preset}"


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_preset_gradients_equal_stock(family):
    stock = build(family)
    model = copy.deepcopy(stock)
    params = dict(model.named_parameters())
    L.convert(model, preset="exact")
    assert dict(model.named_parameters()) == params  # same objects: optimizers stay valid
    assert set(model.state_dict()) == set(stock.state_dict())
    loss0, grads0 = loss_and_grads(stock, batch())
    loss1, grads1 = loss_and_grads(model, batch())
    assert abs(float(loss1 - loss0)) <= 1e-6 * abs(float(loss0))
    assert_grads_close(grads1, grads0)


STEP_C = {
    "gelu": (-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
    "silu": (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
}
STEP_A = {
    "gelu": (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286),
    "silu": (-0.04060357190528599, 1.080925428529668, -0.040321856624382146),
}


def with_step_backward(model, act_classes, which):
    """Approx-BP's definition, written on the stock model: the activation's backward is
    grad * d/dx sum_k a_k relu(x - c_k), computed from the input that hooks keep."""
    c, a = STEP_C[which], STEP_A[which]
    steps = torch.tensor([0.0, a[0], a[0] + a[1], a[0] + a[1] + a[2]], dtype=torch.float64)
    for module in model.modules():
        if type(module).__name__ not in act_classes:
            continue

        def keep(mod, args):
            mod.kept_input = args[0].detach()

        def step(mod, grad_input, grad_output):
            x = mod.kept_input
            flag = (x > c[0]).long() + (x > c[1]).long() + (x > c[2]).long()
            return ((grad_output[0].double() * steps[flag]).to(x.dtype),)

        module.register_forward_pre_hook(keep)
        module.register_full_backward_hook(step)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_approx_preset_matches_its_definition(family):
    """ReGELU2/ReSiLU2 are the step function; a merged norm feeds W' = W diag(gamma) and
    b' = b + W beta, so its consumer's weight gradient is the reference's minus db (x) beta,
    times diag(1 / gamma) (columns of a Linear's weight, rows of GPT-2's Conv1D weight)."""
    stock = build(family)
    acts, _norms = EXPECTED[family]
    which = "silu" if "SiLUActivation" in acts else "gelu"
    reference = with_step_backward(copy.deepcopy(stock), set(acts), which)
    model = copy.deepcopy(stock)
    report = L.convert(model, preset="approx")
    loss0, grads0 = loss_and_grads(reference, batch())
    loss1, grads1 = loss_and_grads(model, batch())
    assert abs(float(loss1 - loss0)) <= 1e-5 * abs(float(loss0))
    expected = dict(grads0)
    for norm_name, consumers in report.merge.merged.items():
        norm = stock.get_submodule(norm_name)
        for p, _ in norm.named_parameters():
            del expected[f"{norm_name}.{p}"]  # folded away
        gamma = norm.weight.detach() + (1.0 if family == "gemma" else 0.0)
        beta = getattr(norm, "bias", None)
        for lin in consumers:
            grad_w, grad_b = grads0[f"{lin}.weight"], grads0.get(f"{lin}.bias")
            if type(stock.get_submodule(lin)).__name__ == "Conv1D":  # weight stored (in, out)
                if beta is not None:
                    grad_w = grad_w - torch.outer(beta.detach(), grad_b)
                expected[f"{lin}.weight"] = grad_w / gamma.unsqueeze(1)
            else:
                if beta is not None:
                    grad_w = grad_w - torch.outer(grad_b, beta.detach())
                expected[f"{lin}.weight"] = grad_w / gamma
    post_ln = family in ("bert", "roberta")  # a norm's output also feeds the residual
    assert bool(report.merge.merged) != post_ln
    assert_grads_close(grads1, expected)


def test_family_presets_check_the_model_type():
    with pytest.raises(
        L.LayerOptionError,
        match=r"preset='llama-approx' is for config.model_type in \('llama',\), but the "
        r"model's is 'gpt2'\. Use preset='approx'",
    ):
        L.convert(build("gpt2"), preset="llama-approx")


def test_new_gelu_activation_keeps_four_tensors_and_tempo_keeps_a_bit():
    """docs/layers.md: HF's NewGELUActivation (Python formula) keeps 4 n b bytes; TempoGELU("tanh")
    keeps y, which the next Linear keeps anyway, and ceil(n / 8) bytes of branch bits."""
    from transformers.activations import NewGELUActivation

    from ._support import saved_bytes

    tokens, width = 24, 40
    lin = torch.nn.Linear(width, 8)
    x = torch.randn(tokens, width, requires_grad=True)
    n = tokens * width
    assert saved_bytes(lambda: NewGELUActivation()(x)) == 4 * n * 4
    stock = saved_bytes(lambda: lin(NewGELUActivation()(x)), list(lin.parameters()))
    lean = saved_bytes(lambda: lin(L.TempoGELU("tanh")(x)), list(lin.parameters()))
    assert stock - lean == 4 * n * 4 - -(-n // 8)
