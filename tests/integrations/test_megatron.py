"""tba.integrations.megatron: the --tba-* flags, and a real megatron-core GPTModel on the CPU
driven by megatron-core's own schedule (get_forward_backward_func, 2 micro-batches)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import warnings

import pytest
import torch

import tba
from tba.integrations import megatron as tba_mg

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
]


def _parse(*argv: str) -> argparse.Namespace:
    return tba_mg.add_args(argparse.ArgumentParser(prog="pretrain_gpt.py")).parse_args(argv)


# -- flags --------------------------------------------------------------------------------------
def test_every_field_is_a_kebab_case_flag_with_its_docstring_as_help():
    parser = tba_mg.add_args(argparse.ArgumentParser())
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    docs = tba_mg._docstrings(tba_mg.OffloadArgs)
    for f in dataclasses.fields(tba_mg.OffloadArgs):
        name = "--tba-" + f.name.replace("_", "-")
        assert helps[name] == docs[f.name] and len(docs[f.name]) > 20
    for name in ("--tba-activation-offload", "--tba-spill-dir", "--tba-keep-last"):
        assert name in helps
    assert "--tba-min-offload-bytes" in helps


def test_flags_configure_and_zero_means_off(tmp_path):
    args = _parse(
        "--tba-activation-offload",
        "--tba-spill-dir",
        str(tmp_path),
        "--tba-keep-last",
        "0",
        "--tba-min-offload-bytes",
        "0",
        "--tba-max-disk-bytes",
        "0",
        "--tba-prefetch-bytes",
        "64MiB",
    )
    cfg, sources = tba_mg.config_from_args(args)
    assert cfg.enabled and cfg.spill_dir == str(tmp_path)
    assert cfg.keep_last == 0 and cfg.min_offload_bytes == 0 and cfg.max_disk_bytes is None
    assert cfg.prefetch_bytes == 64 << 20
    assert sources["keep_last"] == "--tba-keep-last"


def test_bad_flag_is_rejected_at_parse_time_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _parse("--tba-keep-last", "-1")
    assert "argument --tba-keep-last: '-1' is invalid; expected 'auto' or a whole number" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        _parse("--tba-io-threads", "0")
    assert "argument --tba-io-threads: '0' is invalid; expected a whole number >= 1" in (
        capsys.readouterr().err
    )


def test_bad_value_in_a_namespace_names_the_flag():
    ns = argparse.Namespace(tba_activation_offload=True, tba_prefetch_bytes="lots")
    with pytest.raises(tba.ConfigError, match=r"--tba-prefetch-bytes='lots' is invalid; expected"):
        tba_mg.config_from_args(ns)


def test_enabling(monkeypatch):
    assert not tba_mg.config_from_args(_parse())[0].enabled  # Megatron: off without the flag
    assert tba_mg.config_from_args(_parse("--tba-activation-offload"))[0].enabled
    with pytest.warns(UserWarning, match=r"--tba-spill-dir given, but activation offload is off"):
        tba_mg.config_from_args(_parse("--tba-spill-dir", "/x"))
    monkeypatch.setenv("TBA_ENABLED", "1")  # the environment alone turns it on
    assert tba_mg.config_from_args(None)[0].enabled
    monkeypatch.setenv("TBA_ENABLED", "0")  # and off, over the flag
    cfg, sources = tba_mg.config_from_args(_parse("--tba-activation-offload"))
    assert not cfg.enabled and sources["enabled"].startswith("TBA_ENABLED=0")


def test_misuse_is_named():
    @dataclasses.dataclass
    class NoDocs:
        spill_dir: str | None = None

    with pytest.raises(TypeError, match=r"NoDocs\.spill_dir has no docstring"):
        tba_mg.add_args(argparse.ArgumentParser(), NoDocs)
    with pytest.raises(tba.UsageError, match=r"offloader\(\) takes the function wrap_forward_step"):
        tba_mg.offloader(lambda: None)


def test_a_list_of_chunks_warns_once(monkeypatch):
    monkeypatch.setattr(tba_mg, "_warned_chunk_list", False)
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.warns(UserWarning, match=r"list of 2 model chunks, so tba cannot tell which"):
        assert tba_mg._find_model(1, (None, chunks), {}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tba_mg._find_model(1, (None, chunks), {}) is None  # once
        assert tba_mg._find_model(1, (None, chunks[:1]), {}) is chunks[0]


def test_wrapper_keeps_the_signature():
    def forward_step(data_iterator, model, checkpoint_activations_microbatch=None):
        return None

    wrapped = tba_mg.wrap_forward_step(forward_step)
    assert inspect.signature(wrapped) == inspect.signature(forward_step)
    assert tba_mg.offloader(wrapped) is None  # not built before the first forward


# -- a real GPTModel through megatron-core's schedule -------------------------------------------
SEQ, VOCAB, MICRO = 32, 128, 2


def _gpt(**extra):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.1,  # masks are saved for backward too; seeded identically per run
        attention_dropout=0.1,
        **extra,  # e.g. megatron-core's own recompute_granularity
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule scales loss in place

    return output, loss_func


def _run(step_func, iterations: int = 2, **extra):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _gpt(**extra)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(iterations):
        data = [
            (
                torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
                torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
            )
            for _ in range(2)
        ]
        torch.manual_seed(2)  # dropout
        out = get_forward_backward_func()(
            forward_step_func=step_func,
            data_iterator=iter(data),
            model=[model],
            num_microbatches=2,
            seq_length=SEQ,
            micro_batch_size=MICRO,
        )
        losses += [d["loss"] for d in out]
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return losses, grads


@pytest.fixture
def megatron(world_of_one, tmp_path):
    from ._frameworks import megatron_cpu

    with megatron_cpu(tmp_path):
        yield


def test_gpt_model_exact_gradients_with_two_micro_batches(megatron, tmp_path):
    ref_losses, ref_grads = _run(forward_step)
    args = _parse(
        "--tba-activation-offload",
        "--tba-spill-dir",
        str(tmp_path / "spill"),
        "--tba-keep-last",
        "0",
        "--tba-min-offload-bytes",
        "1",
    )
    wrapped = tba_mg.wrap_forward_step(forward_step, args=args)

    def then_sync(data_iterator, model):
        # wait for tba's writes before the schedule's backward, so that backward reads from disk
        out = wrapped(data_iterator, model)
        tba_mg.offloader(wrapped).synchronize()
        return out

    losses, grads = _run(then_sync)
    off = tba_mg.offloader(wrapped)
    try:
        st = off.stats()
        # back from disk, or from staging when the read-ahead wanted it while its write ran
        assert st["bytes_offloaded"] > 0 and st["bytes_reloaded"] + st["forwarded"] > 0
        assert off.backend.spill_path.startswith(str(tmp_path / "spill"))
        assert len(losses) == 4 and all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        for g, r in zip(grads, ref_grads):
            assert len(g) == len(r) and all(torch.equal(a, b) for a, b in zip(g, r))
    finally:
        off.close()


def test_env_only(megatron, tmp_path, monkeypatch):
    monkeypatch.setenv("TBA_ENABLED", "1")
    monkeypatch.setenv("TBA_SPILL_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("TBA_MIN_OFFLOAD_BYTES", "1")
    wrapped = tba_mg.wrap_forward_step(forward_step)  # no flags parsed: environment only
    _run(wrapped, iterations=1)
    off = tba_mg.offloader(wrapped)
    try:
        off.synchronize()  # writes are counted once they land (NOTE [Counted once])
        assert off.stats()["bytes_offloaded"] > 0
        assert off.backend.spill_path.startswith(str(tmp_path / "env"))
    finally:
        off.close()
    monkeypatch.setenv("TBA_ENABLED", "0")
    wrapped = tba_mg.wrap_forward_step(forward_step, args=_parse("--tba-activation-offload"))
    _run(wrapped, iterations=1)
    assert tba_mg.offloader(wrapped) is None


# -- block policies (NOTE [Block policy] in tba/datapath/blocks/recompute.py) ----------------------
TBA_FLAGS = ("--tba-activation-offload", "--tba-keep-last", "0", "--tba-min-offload-bytes", "1")
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _policy_run(tmp_path, **extra):
    """``_run`` under ``wrap_forward_step`` with the flags (the policy comes from TBA_*), each
    forward's writes awaited; returns losses, gradients and the last step's stats."""
    args = _parse(*TBA_FLAGS, "--tba-spill-dir", str(tmp_path / "spill"))
    wrapped = tba_mg.wrap_forward_step(forward_step, args=args)

    def then_sync(data_iterator, model):
        out = wrapped(data_iterator, model)
        tba_mg.offloader(wrapped).synchronize()
        return out

    losses, grads = _run(then_sync, **extra)
    off = tba_mg.offloader(wrapped)
    try:
        off.synchronize()
        return losses, grads, off.stats()
    finally:
        off.close()


def _same(losses, grads, ref_losses, ref_grads) -> bool:
    return (
        len(losses) == len(ref_losses) == 4
        and all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        and len(grads) == len(ref_grads) == 2
        and all(
            len(g) == len(r) and all(torch.equal(a, b) for a, b in zip(g, r))
            for g, r in zip(grads, ref_grads)
        )
    )


@pytest.mark.parametrize("policy", ["recompute", "auto", "mixed"])
def test_gpt_model_exact_under_block_policies(megatron, tmp_path, monkeypatch, policy):
    """TBA_POLICY=recompute, auto and TBA_BLOCK_POLICY alternating recompute and offload, through
    megatron-core's schedule with dropout on: losses and gradients of both iterations (after a
    weight update between them) bit-identical to no tba; the layers ran as the policy says."""
    from ._frameworks import POLICY_ENV, policy_problems

    ref_losses, ref_grads = _run(forward_step)
    for key, value in POLICY_ENV[policy].items():
        monkeypatch.setenv(key, value)
    losses, grads, st = _policy_run(tmp_path)
    assert policy_problems(st, policy, 3) == []
    assert _same(losses, grads, ref_losses, ref_grads)


def test_recompute_over_selective_recompute_exact(megatron, tmp_path, monkeypatch):
    """megatron-core's selective recompute (core attention under its own checkpoint, inside
    each layer) with TBA_POLICY=recompute: tba checkpoints the layers around it, and it stays
    exact."""
    from ._frameworks import policy_problems

    extra = {"recompute_granularity": "selective"}
    ref_losses, ref_grads = _run(forward_step, **extra)
    monkeypatch.setenv("TBA_POLICY", "recompute")
    losses, grads, st = _policy_run(tmp_path, **extra)
    assert policy_problems(st, "recompute", 3) == []
    assert _same(losses, grads, ref_losses, ref_grads)


class NotLeftAsUser(AssertionError):
    """The user's checkpointed blocks are not recorded as ``user``."""


def test_recompute_leaves_full_recompute_to_megatron(megatron, tmp_path, monkeypatch):
    """megatron-core's own full recompute with TBA_POLICY=recompute: exact (asserted first; a
    difference fails this test outright), and every layer left to megatron-core (``user``)."""
    ref_losses, ref_grads = _run(forward_step, **FULL)
    monkeypatch.setenv("TBA_POLICY", "recompute")
    losses, grads, st = _policy_run(tmp_path, **FULL)
    assert _same(losses, grads, ref_losses, ref_grads)
    assert st["disk_bytes_in_use"] == 0
    if st["group_policy"] != ["user"] * 3 or st["recomputed_groups"] != 0:
        raise NotLeftAsUser(f"{st['group_policy']}, recomputed_groups {st['recomputed_groups']}")
