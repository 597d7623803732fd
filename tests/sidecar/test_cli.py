"""`tba sidecar`'s arguments: every bad one exits 2 with a message that names the fix."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tba.cli import build_parser, main
from tba.sidecar import DEFAULT_PORT

from ._support import REPO, env


@pytest.fixture(autouse=True)
def _no_tba_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("TBA_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--port", "70000"],
            "argument --port: '70000' is invalid; expected a TCP port from 0 to 65535 (0 picks a "
            "free one)",
        ),
        (["--port", "http"], "'http' is invalid; expected a TCP port from 0 to 65535"),
        (
            ["--interval", "0"],
            "argument --interval: '0' is invalid; expected a duration from 0.1 to 3600 seconds, "
            "such as 10 or 10s",
        ),
        (["--interval", "nan"], "expected a duration from 0.1 to 3600 seconds"),
        (["--rate-window", "1e9"], "expected a duration from 1 to 604800 seconds"),
        (
            ["--ssd-tbw", "lots"],
            "'lots' is invalid; expected the drive's rated endurance in terabytes written",
        ),
        (["--ssd-tbw", "-3"], "'-3' is invalid; expected a positive number of terabytes"),
        (["--log-level", "chatty"], "argument --log-level: invalid choice: 'CHATTY'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags(capsys, metrics_dir, args, message):
    assert main(["sidecar", "--metrics-dir", metrics_dir, *args]) == 2
    err = capsys.readouterr().err
    assert "usage: tba" in err and message in err


def test_durations_take_the_config_units():
    """--interval reads a duration as TBA_STAGING_WAIT does (one parser for both)."""
    args = build_parser().parse_args(["sidecar", "--interval", "500ms", "--rate-window", "2s"])
    assert (args.interval, args.rate_window) == (0.5, 2.0)


def test_no_metrics_dir(capsys):
    assert main(["sidecar"]) == 2
    err = capsys.readouterr().err
    assert "tba sidecar: error: no metrics directory: pass --metrics-dir DIR or set " in err
    assert "TBA_METRICS_DIR" in err


def test_rate_window_shorter_than_two_intervals(capsys, metrics_dir):
    code = main(
        ["sidecar", "--metrics-dir", metrics_dir, "--interval", "60", "--rate-window", "100"]
    )
    assert code == 2
    assert (
        "--rate-window 100 is shorter than two --interval periods (120 s): a rate needs at "
        "least two samples" in capsys.readouterr().err
    )


def test_bad_tba_env(capsys, metrics_dir, monkeypatch):
    monkeypatch.setenv("TBA_SSD_TBW", "many")
    assert main(["sidecar", "--metrics-dir", metrics_dir]) == 2
    assert "TBA_SSD_TBW='many' is invalid; expected the drive's rated endurance" in (
        capsys.readouterr().err
    )


def test_missing_metrics_dir(capsys, tmp_path):
    missing = str(tmp_path / "nope")
    assert main(["sidecar", "--metrics-dir", missing]) == 2
    err = capsys.readouterr().err
    assert f"tba.sidecar: metrics dir {missing} does not exist. Create it (mkdir -p)" in err
    assert "TBA_METRICS_DIR" in err and "--metrics-dir" in err


def test_metrics_dir_is_a_file_or_a_symlink(capsys, tmp_path, metrics_dir):
    f = tmp_path / "file"
    f.write_text("")
    assert main(["sidecar", "--metrics-dir", str(f)]) == 2
    assert f"metrics dir {f} is not a directory" in capsys.readouterr().err
    link = tmp_path / "link"
    link.symlink_to(metrics_dir)
    assert main(["sidecar", "--metrics-dir", str(link)]) == 2
    assert (
        f"metrics dir {link} is a symbolic link (to {metrics_dir}); the sidecar does not follow "
        "symlinks. Pass the real directory (realpath) instead." in capsys.readouterr().err
    )


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root passes every permission check (and the venv is not nobody's)"
)
def test_unwritable_metrics_dir(capsys, metrics_dir):
    os.chmod(metrics_dir, 0o500)
    try:
        assert main(["sidecar", "--metrics-dir", metrics_dir]) == 2
    finally:
        os.chmod(metrics_dir, 0o700)
    err = capsys.readouterr().err
    assert f"tba.sidecar: metrics dir {metrics_dir} is not readable and writable (the janitor " in (
        err
    )
    assert "or pass --no-janitor." in err


def test_port_in_use(metrics_dir, spill_root):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "tba.cli",
                "sidecar",
                "--metrics-dir",
                metrics_dir,
                "--spill-dir",
                spill_root,
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            env=env(),
            cwd=REPO,
            timeout=60,
        )
    assert p.returncode == 2, p.stderr
    assert (
        f"tba.sidecar: cannot listen on 127.0.0.1:{port}: Address already in use. Pick another "
        "--port (0 picks a free one) or --host." in p.stderr
    )


def test_defaults_come_from_the_environment(monkeypatch):
    args = build_parser().parse_args(["sidecar"])
    assert (args.host, args.port, args.interval, args.ssd_tbw) == (
        "127.0.0.1",
        DEFAULT_PORT,
        10.0,
        None,
    )
