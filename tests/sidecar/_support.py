"""Helpers for the sidecar tests: a real `tba sidecar` subprocess, real HTTP, and real
processes writing prometheus-client multiprocess files."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("_writer.py")


def env(**extra: str) -> dict[str, str]:
    """The test process's environment without TBA_* or PROMETHEUS_* settings, plus ``extra``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("TBA_", "PROMETHEUS_"))}
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    out.update(extra)
    return out


class SidecarProc:
    """``tba sidecar --port 0 ...`` in a subprocess; its JSON log lines are collected."""

    def __init__(self, *args: str, environ: dict[str, str] | None = None, timeout: float = 60):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tba.cli", "sidecar", "--port", "0", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ or env(),
            cwd=REPO,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.port is None:
            self.stop(check=False)
            raise RuntimeError(f"tba sidecar did not start:\n{self.log_text()}")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.port is None:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == "listening":
                    self.port = rec["port"]
                    self._ready.set()
        self._ready.set()

    def records(self) -> list[dict]:
        out = []
        for line in list(self.lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def log_text(self) -> str:
        return "\n".join(self.lines)

    def get(self, path: str, method: str = "GET", headers: dict | None = None):
        assert self.port is not None
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def status(self) -> dict:
        code, _, body = self.get("/status")
        assert code == 200, body
        return json.loads(body)

    def metrics(self) -> str:
        code, _, body = self.get("/metrics")
        assert code == 200, body
        return body.decode()

    def wait_scans(self, n: int = 1, timeout: float = 30) -> None:
        """Wait until ``n`` more janitor passes have run."""
        start = self.status()["janitor"]["runs"]
        deadline = time.monotonic() + timeout
        while self.status()["janitor"]["runs"] < start + n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no scan in {timeout} s:\n{self.log_text()}")
            time.sleep(0.05)

    def stop(self, check: bool = True) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(5)
        if check:
            assert rc == 0, f"exit {rc}:\n{self.log_text()}"
        return rc

    def __enter__(self) -> SidecarProc:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(check=exc[0] is None)


class Writer:
    """A process writing multiprocess files like a rank (see _writer.py). It stays alive until
    :meth:`exit` (or the end of the ``with``)."""

    def __init__(self, metrics_dir: str, rank: int, offloaded: int, spill_root: str | None = None):
        args = [sys.executable, str(WRITER), metrics_dir, str(rank), str(offloaded)]
        if spill_root:
            args.append(spill_root)
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env(), cwd=REPO
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"writer failed to start: {line!r}")
        self.pid = self.proc.pid
        self.spill_dir = line.split()[1] if len(line.split()) > 1 else None

    def exit(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.exit()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def samples(text: str, name: str) -> dict[frozenset, float]:
    """{frozenset(label pairs): value} of one sample name in a text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[frozenset, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[frozenset(s.labels.items())] = s.value
    return out


def sample_names(text: str) -> set[str]:
    """Every metric family name with at least one sample (counters with ``_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            names.add(s.name)
    return names
