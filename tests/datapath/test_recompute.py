"""Block-level recompute (NOTE [Block policy] in tba/datapath/blocks/recompute.py): what reaches
tba's pack hook, the wrapper's lifetime, the user's own checkpointing, and the counts in stats()."""

from __future__ import annotations

import threading

import pytest
import torch

import tba
from tba.testing import GPT, GPTConfig, random_batch

CFG = GPTConfig(vocab=64, seq=32, hidden=32, heads=4, layers=3, dropout=0.1)


def run_step(off, model, seed=0):
    with off.step(model):
        loss = model(*random_batch(CFG, 4, seed=seed))
    return loss


def test_recompute_saves_never_reach_the_pack_hook(make_offloader):
    """Backward of a recomputed step run inside another step: the recompute's saves are
    checkpoint's, so the second step packs exactly what it packs on its own."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="recompute")
    loss = run_step(off, model, seed=1)
    with off.step(model):
        loss.backward()  # recomputes every block while this step's hooks are installed
        inner = model(*random_batch(CFG, 4, seed=2))
    packs_inside = off.stats()["packs"]
    inner.backward()
    alone = run_step(off, model, seed=2)
    assert off.stats()["packs"] == packs_inside
    alone.backward()


def test_wrapper_lives_for_the_forward_only(make_offloader):
    torch.manual_seed(0)
    model = GPT(CFG)
    mine = model.blocks[1].forward  # an instance forward the user set: put back after
    model.blocks[1].forward = mine
    off = make_offloader(policy="recompute")
    with off.step(model):
        assert all("forward" in b.__dict__ for b in model.blocks)
        assert model.blocks[1].__dict__["forward"] is not mine
        loss = model(*random_batch(CFG, 4))
    assert "forward" not in model.blocks[0].__dict__ and "forward" not in model.blocks[2].__dict__
    assert model.blocks[1].__dict__["forward"] is mine
    loss.backward()


def test_counts_and_saved_bytes_match_offload(make_offloader):
    """saved_bytes counts what the checkpointed blocks saved (what stays resident without
    tba), so it equals the offload policy's; the inputs of recomputed blocks are kept."""
    got = {}
    for policy in ("offload", "recompute"):
        torch.manual_seed(0)
        model = GPT(CFG)
        off = make_offloader(policy=policy, keep_last=0)
        run_step(off, model).backward()
        got[policy] = off.stats()
    rec, offl = got["recompute"], got["offload"]
    assert rec["saved_bytes"] == offl["saved_bytes"] > 0
    assert rec["group_policy"] == ["recompute"] * 3 and rec["recomputed_groups"] == 3
    assert rec["kept_reasons"]["recompute"] == 3  # one input per block
    assert rec["packs"] < offl["packs"]
    assert rec["peak_with_recompute_bytes"] > rec["peak_resident_bytes"]
    assert offl["peak_with_recompute_bytes"] == offl["peak_resident_bytes"]


def test_user_checkpointed_blocks_are_left_alone(make_offloader, caplog):
    torch.manual_seed(0)
    model = GPT(CFG)
    model.checkpoint_blocks = True
    off = make_offloader(policy="recompute", log_level="INFO")
    with caplog.at_level("INFO", logger="tba"):
        run_step(off, model).backward()
        run_step(off, model, seed=1).backward()
    st = off.stats()
    assert st["group_policy"] == ["user"] * 3 and st["user_checkpointed_groups"] == 3
    assert st["recomputed_groups"] == 0
    lines = [r.getMessage() for r in caplog.records if "block actions" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("user,user,user")  # as run, once per change


def test_forced_assignment_and_keep_policy(make_offloader):
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(block_policy="keep,recompute,offload", keep_last=0)
    run_step(off, model).backward()
    st = off.stats()
    assert st["group_policy"] == ["keep", "recompute", "offload"]
    assert st["kept_groups"] == 1 and st["recomputed_groups"] == 1
    assert st["kept_reasons"]["group"] > 0 and st["kept_reasons"]["recompute"] == 1
    off2 = make_offloader(policy="keep")
    run_step(off2, model).backward()
    st2 = off2.stats()
    assert st2["tensors_offloaded"] == 0 and st2["group_policy"] == ["keep"] * 3


@pytest.mark.parametrize(
    "raw,want",
    [
        ("recompute,offload,keep", ((0, "recompute"), (1, "offload"), (2, "keep"))),
        ("2:keep, 0:Recompute", ((0, "recompute"), (2, "keep"))),
        ({1: "offload"}, ((1, "offload"),)),
        (["keep", "keep"], ((0, "keep"), (1, "keep"))),
        ("none", None),
    ],
)
def test_block_policy_parses(raw, want):
    assert tba.Config(environ={}, block_policy=raw).block_policy == want


@pytest.mark.parametrize("raw", ["zap", "0:keep,recompute", "0:keep,0:offload", "x:keep"])
def test_bad_block_policy_names_the_variable(raw):
    with pytest.raises(tba.ConfigError, match="TBA_BLOCK_POLICY"):
        tba.Config(environ={"TBA_BLOCK_POLICY": raw})


def test_policy_from_env_and_default():
    assert tba.Config(environ={}).policy == "offload"
    assert tba.Config(environ={"TBA_POLICY": "Auto"}).policy == "auto"
    with pytest.raises(tba.ConfigError, match="TBA_POLICY"):
        tba.Config(environ={"TBA_POLICY": "swap"})


def test_policy_without_a_model_warns_once_and_offloads(make_offloader, caplog):
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(policy="recompute")
    with caplog.at_level("WARNING", logger="tba"):
        for seed in range(2):
            with off.step():
                loss = model(*random_batch(CFG, 4, seed=seed))
            loss.backward()
    warned = [r.getMessage() for r in caplog.records if "TBA_POLICY=recompute" in r.getMessage()]
    assert len(warned) == 1 and "off.step(model)" in warned[0]
    off.synchronize()  # writes are counted once they land (NOTE [Counted once])
    st = off.stats()
    assert st["group_policy"] == [] and st["tensors_offloaded"] > 0


def test_peak_with_recompute_counts_no_block_backward_is_done_with(make_offloader):
    """While backward recomputes a block, the kept block after it has had its backward: its
    saves are gone and must not count (they did, until the deferred releases were accounted
    first, which put W1's keep-last/recompute-rest step at 0.39 of saved_bytes for 0.24)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(block_policy="recompute,recompute,keep")
    run_step(off, model).backward()
    st = off.stats()
    assert st["group_policy"] == ["recompute", "recompute", "keep"]
    hidden = [r["hidden_bytes"] for r in off._last.group_records() if r["hidden_bytes"]]
    assert len(hidden) == 2
    # The kept block and everything after it are resident at the end of forward (the step's
    # resident peak); a recompute adds one block's saves to what is left once they are freed.
    assert st["peak_resident_bytes"] <= st["peak_with_recompute_bytes"]
    assert st["peak_with_recompute_bytes"] < st["peak_resident_bytes"] + min(hidden)


def test_recompute_offload_offloads_the_checkpoint_inputs_and_stays_exact(make_offloader):
    """recompute_offload: the block is recomputed as with recompute, but the inputs its
    checkpoint saves are offloaded (none is kept for reason ``recompute``) and backward reads
    them back before it runs the forward again; gradients are those of plain training."""

    def grads(off):
        torch.manual_seed(0)
        model = GPT(CFG)
        torch.manual_seed(1)  # dropout
        loss = model(*random_batch(CFG, 4)) if off is None else run_step(off, model)
        loss.backward()
        return [p.grad for p in model.parameters()]

    base = grads(None)
    for action, kept_inputs in (("recompute", 3), ("recompute_offload", 0)):
        off = make_offloader(block_policy=",".join([action] * 3), keep_last=0, min_offload_bytes=1)
        got = grads(off)
        assert all(torch.equal(a, b) for a, b in zip(base, got)), action
        st = off.stats()
        assert st["group_policy"] == [action] * 3 and st["recomputed_groups"] == 3
        assert st["kept_reasons"].get("recompute", 0) == kept_inputs
        recs = [r for r in off._last.group_records() if r["action"]]
        if action == "recompute_offload":  # each block's input went to disk and came back
            assert all(r["offloaded_bytes"] >= r["input_bytes"] > 0 for r in recs)
            # back from disk, or from memory where the original was still alive (a live
            # original is handed back rather than read: which one is up to the GC's timing)
            assert st["bytes_reloaded"] + st["forwarded"] > 0
        assert st["disk_bytes_in_use"] == 0


def test_recompute_seconds_time_backwards_forward_again(make_offloader):
    """A recomputed block's record says how long backward's run of its forward took (NOTE
    [Recompute cost] in tba/decide/block_policy.py); other groups say 0."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(block_policy="recompute,offload,recompute_offload")
    run_step(off, model).backward()
    recs = off._last.group_records()
    timed = {r["action"]: r["recompute_seconds"] for r in recs if r["action"]}
    assert timed["recompute"] > 0 and timed["recompute_offload"] > 0 and timed["offload"] == 0
    assert all(r["recompute_seconds"] == 0 for r in recs if not r["action"])
    for r in recs:  # backward's time of a recomputed block includes its recompute
        if r["recompute_seconds"]:
            assert r["bwd_seconds"] >= r["recompute_seconds"]


def test_hooks_time_themselves_per_group(make_offloader):
    """NOTE [Hook time]: each group's record says how long tba's pack and unpack hooks took
    for its tensors, stalls excluded; an offloaded block spends more in them than a kept one,
    and no group spends more in them than its forward and backward took."""
    torch.manual_seed(0)
    model = GPT(CFG)
    off = make_offloader(block_policy="offload,keep,recompute")
    run_step(off, model).backward()
    recs = off._last.group_records()
    by = {r["action"]: r for r in recs if r["action"]}
    assert by["offload"]["pack_seconds"] > 0 and by["offload"]["unpack_seconds"] > 0
    assert by["keep"]["pack_seconds"] > 0 and by["keep"]["unpack_seconds"] > 0
    for r in recs:
        assert 0 <= r["pack_seconds"] <= r["fwd_seconds"]
        assert r["unpack_seconds"] >= 0


def test_packs_waiting_for_staging_are_not_the_blocks_compute(make_offloader, monkeypatch):
    """A pack that waits for a full staging (NOTE [Staging backpressure]) stalls; its group's
    record says so in ``pack_stall_seconds`` and leaves it out of ``fwd_seconds``, which the
    chooser and adaptive keep read as compute. Counted in, W1's first auto step at 20 MB/s
    made each block's forward look 9 s long and every recompute dear. Writes are held until a
    pack waits, so that one does, however fast or slow this host runs."""
    from concurrent.futures import Future

    from tba.datapath.capture.staging import StagingPool

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=256, hidden=128, heads=4, layers=3)
    model = GPT(cfg)
    off = make_offloader(keep_last=0, staging_bytes="4MiB", staging_full="wait")
    waiting = threading.Event()
    real_wait = StagingPool.wait_for

    def wait_for(self, *args, **kwargs):
        waiting.set()
        return real_wait(self, *args, **kwargs)

    monkeypatch.setattr(StagingPool, "wait_for", wait_for)
    backend = off.io.backend
    real_write = backend.write

    def held_write(*args, **kwargs):
        outer: Future = Future()

        def later():
            waiting.wait(60)
            inner = real_write(*args, **kwargs)
            inner.add_done_callback(
                lambda f: (
                    outer.set_exception(f.exception())
                    if f.exception() is not None
                    else outer.set_result(f.result())
                )
            )

        threading.Thread(target=later, daemon=True).start()
        return outer

    monkeypatch.setattr(backend, "write", held_write)
    with off.step(model):
        loss = model(*random_batch(cfg, 4, seed=0))
    loss.backward()
    st, recs = off.stats(), off._last.group_records()
    waited = [r["pack_stall_seconds"] for r in recs]
    assert waiting.is_set()
    assert st["pack_stall_seconds"] > 0 and "staging_full" not in st["kept_reasons"]
    assert sum(waited) == pytest.approx(st["pack_stall_seconds"])  # every pack is in a group
    assert sum(waited[1::2]) > 0  # the blocks' own packs waited
    for r in recs:
        assert r["fwd_seconds"] >= 0 and r["pack_seconds"] <= r["fwd_seconds"] + 1e-9
    # the groups' forwards and their waits tile the step's forward, each second counted once
    assert sum(r["fwd_seconds"] for r in recs) + sum(waited) <= st["forward_seconds"] + 1e-3
