"""The faults again, with a node quota (``TBA_NODE_MAX_DISK_BYTES``): every slab growth then
also updates the node ledger in the spill root, on the same failing filesystem. The kept
reason and the warning must still name the filesystem's fault (EROFS, EIO), not a node quota
"used up by the tba processes of this node". Nothing is left but the ledger, which outlives
every process by design and holds no bytes for them."""

from __future__ import annotations

import os

import pytest

from tba.storage.nodequota import read_ledger

from .util import (
    LoopExt4,
    assert_exact,
    grads,
    make_batch,
    make_model,
    sweep,
    train_step,
    warnings_text,
)

READ_ONLY = (
    lambda fs: fs.must_remount("ro"),
    lambda fs: fs.must_remount("rw"),
    "read_only",
    "EROFS",
)
SHUTDOWN = (LoopExt4.shutdown, LoopExt4.cycle, "io_error", "EIO")


@pytest.mark.parametrize("fault,repair,reason,errname", [READ_ONLY, SHUTDOWN], ids=["ro", "eio"])
def test_a_node_quota_does_not_hide_the_cause(
    loop_ext4, offloaders, caplog, fault, repair, reason, errname
):
    fs = loop_ext4
    model, x = make_model(), make_batch(0.5)
    want = grads(model, x)
    baseline = fs.baseline()
    off = offloaders(fs.root, backend="posix", node_max_disk_bytes="32MiB")
    fault(fs)
    st = train_step(off, model, x)
    assert_exact(model, want)
    assert st["tensors_offloaded"] == 0 and set(st["kept_reasons"]) == {reason}, st
    text = warnings_text(caplog)
    assert f"({reason})" in text and errname in text, text
    assert "used up by the tba processes" not in text, text
    assert f"update of 0 bytes at offset 0 in {fs.root}/.tba-node-quota" in text, text
    off.close()
    repair(fs)
    sweep(fs.root)  # the per-process directory close could not remove
    # The ledger stays (NOTE [Node quota] 1); the entry of the closed Offloader holds nothing.
    assert fs.files_under_root() == [".tba-node-quota"]
    assert read_ledger(fs.root)["used_bytes"] == 0
    os.unlink(os.path.join(fs.root, ".tba-node-quota"))
    fs.assert_no_bytes_left(baseline)
