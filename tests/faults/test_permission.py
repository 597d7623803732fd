"""EACCES: the per-process spill directory made unwritable (``chmod 0500``, then ``0000``, by
root, from outside) while an Offloader runs as an unprivileged uid. Root would pass the
check, so the training runs in a child that drops to ``nobody`` before it makes the
Offloader. The slabs already open keep working; a new one cannot be made, so what does not
fit stays in memory as ``kept_reasons["permission"]``, exact, with a warning naming EACCES
and the fix."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json, logging, os, sys
    uid, gid, root, repo, warmup = sys.argv[1:6]
    sys.path.insert(0, repo)
    import torch
    import tba
    from tba.testing import warm_cpu_math
    from tests.faults.util import config, grads, make_batch, make_model, train_step

    # The interpreter may live where nobody cannot read (here: under /root, 0700), so every
    # module is loaded first, by one step as root in a directory of its own; then the
    # process drops to nobody, before the Offloader under test exists.
    warm_cpu_math()  # NOTE [First-call math]
    model = make_model()
    small, large = make_batch(0.25), make_batch(1)  # 2 MiB, then 8 MiB: a new slab
    with tba.Offloader(config(warmup)) as off:
        train_step(off, model, small)
    os.setgroups([])
    os.setgid(int(gid))
    os.setuid(int(uid))

    messages = []
    handler = logging.Handler()
    handler.emit = lambda r: messages.append((r.levelname, r.getMessage()))
    logging.getLogger().addHandler(handler)
    want = {id(small): grads(model, small), id(large): grads(model, large)}
    out = {"uid": os.geteuid()}
    off = tba.Offloader(config(root))
    try:
        for name, x in (("first", small), ("0500", large), ("0000", large)):
            if name != "first":  # the parent makes the directory that mode, then says go
                print("CHMOD", name, off.backend.spill_path, flush=True)
                sys.stdin.readline()
            st = train_step(off, model, x)
            wanted = want[id(x)]
            out[name] = {
                "exact": all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), wanted)),
                "offloaded": st["tensors_offloaded"],
                "kept_reasons": st["kept_reasons"],
            }
    except BaseException as e:
        out["error"] = f"{type(e).__module__}.{type(e).__qualname__}: {e}"
    finally:
        off.close()
    out["messages"] = messages
    print("RESULT", json.dumps(out), flush=True)
    """
)


def nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' to run the child as")


@pytest.mark.slow
def test_spill_dir_made_unwritable_under_an_unprivileged_uid(spill_fs, tmp_path):
    if os.geteuid() != 0:
        pytest.skip(f"needs root to run a child as another uid (running as uid {os.geteuid()})")
    who = nobody()
    os.chown(spill_fs.root, who.pw_uid, who.pw_gid)
    baseline = spill_fs.baseline()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"}
    args = [str(who.pw_uid), str(who.pw_gid), spill_fs.root, repo, str(tmp_path / "warmup")]
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",
    )
    try:
        for mode in ("0500", "0000"):
            line = proc.stdout.readline()
            assert line.startswith(f"CHMOD {mode} "), line + proc.stderr.read()
            os.chmod(line.split()[2], int(mode, 8))  # from outside, as root
            proc.stdin.write("go\n")
            proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert results, out + err
    res = json.loads(results[0].split(" ", 1)[1])
    assert res["uid"] == who.pw_uid
    assert "error" not in res, res["error"]
    first = res["first"]
    assert first["exact"] and first["offloaded"] > 0 and first["kept_reasons"] == {}, first
    for mode in ("0500", "0000"):
        blocked = res[mode]
        assert blocked["exact"], (mode, blocked)
        assert set(blocked["kept_reasons"]) == {"permission"}, (mode, blocked)
    text = "\n".join(m for _, m in res["messages"])
    assert "(permission)" in text and "EACCES" in text and "TBA_SPILL_DIR" in text, text
    warned = [m for lvl, m in res["messages"] if lvl == "WARNING"]
    assert len(warned) == 1, warned  # one cause (two chmods, two steps): one warning
    assert not [m for lvl, m in res["messages"] if lvl in ("ERROR", "CRITICAL")]
    spill_fs.assert_no_bytes_left(baseline)
