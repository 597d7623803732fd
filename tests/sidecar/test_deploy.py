"""deploy/: the Kubernetes pod parses and is consistent, the systemd unit's command line is one
`tba sidecar` accepts, the Prometheus configs are valid, the dashboard is well formed. (The
dashboard's metric names are checked against a real scrape in test_e2e.py.)"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess

import pytest

from tba.cli import build_parser
from tba.sidecar import DEFAULT_PORT

from ._support import REPO

DEPLOY = REPO / "deploy"
yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra: pip install -e '.[test]'")


def _pod() -> dict:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes-pod.yaml").read_text()))
    assert len(docs) == 1
    return docs[0]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _mount_path(container: dict, volume: str) -> str:
    (m,) = [m for m in container["volumeMounts"] if m["name"] == volume]
    return m["mountPath"]


def test_kubernetes_pod_is_consistent():
    pod = _pod()
    assert (pod["apiVersion"], pod["kind"]) == ("v1", "Pod")
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True  # the janitor judges liveness by pid
    (trainer,) = spec["containers"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "tba-sidecar"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    # one image with tba installed runs both
    assert sidecar["image"] == trainer["image"] and ":" in trainer["image"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tba-metrics"]["emptyDir"] is not None
    assert volumes["tba-spill"]["hostPath"]["path"].startswith("/mnt/")
    every = [*spec["initContainers"], *spec["containers"]]
    for c in every:
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{c['name']} mounts an undefined volume {m['name']}"
    for c in (trainer, sidecar):
        env = _env(c)
        metrics = env["TBA_METRICS_DIR"]
        assert metrics == _mount_path(c, "tba-metrics"), c["name"]
        assert env["TBA_SPILL_DIR"].startswith(_mount_path(c, "tba-spill") + "/"), c["name"]
    assert _env(trainer)["TBA_METRICS_DIR"] == _env(sidecar)["TBA_METRICS_DIR"]
    assert _env(trainer)["TBA_SPILL_DIR"] == _env(sidecar)["TBA_SPILL_DIR"]
    # the sidecar's command is one `tba sidecar` accepts, and its port is the one probed
    cmd = sidecar["command"]
    assert cmd[:2] == ["tba", "sidecar"]
    args = build_parser().parse_args(cmd[1:])
    (port,) = sidecar["ports"]
    assert (
        args.port
        == port["containerPort"]
        == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    )
    assert args.host == "0.0.0.0"  # reachable from Prometheus
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    # the init container that owns the spill root gives it to the pod's user
    (owner,) = [c for c in spec["initContainers"] if c["name"] == "spill-dir-owner"]
    uid = spec["securityContext"]["runAsUser"]
    assert f"chown {uid}:{uid} {_env(trainer)['TBA_SPILL_DIR']}" in owner["command"][-1]


def _unit() -> dict[str, dict[str, list[str]]]:
    """The unit's sections as {section: {key: [values]}} (systemd allows repeated keys)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in (DEPLOY / "tba-sidecar.service").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert section is not None and key, line
        section.setdefault(key, []).append(value)
    return out


def test_systemd_unit_runs_a_valid_sidecar_command():
    unit = _unit()
    svc = unit["Service"]
    (exec_start,) = svc["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/bin/tba") and argv[1] == "sidecar"
    args = build_parser().parse_args(argv[1:])
    assert (args.host, args.port) == ("127.0.0.1", DEFAULT_PORT)
    env = dict(v.split("=", 1) for v in svc["Environment"])
    # the metrics dir is the runtime directory systemd makes and keeps across restarts
    assert env["TBA_METRICS_DIR"] == "/run/tba/metrics"
    assert "tba/metrics" in svc["RuntimeDirectory"][0].split()
    assert svc["RuntimeDirectoryPreserve"] == ["yes"]
    writable = svc["ReadWritePaths"][0].split()
    assert "/run/tba" in writable and f"-{env['TBA_SPILL_DIR']}" in writable
    assert svc["KillSignal"] == ["SIGTERM"]
    assert "PrivatePIDs" not in svc and "ProtectProc" not in svc  # it must see the ranks' pids
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    if shutil.which("systemd-analyze"):
        p = subprocess.run(
            ["systemd-analyze", "verify", str(DEPLOY / "tba-sidecar.service")],
            capture_output=True,
            text=True,
        )
        assert "Unknown key" not in p.stderr and "Unknown section" not in p.stderr, p.stderr


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-kubernetes.yml"])
def test_prometheus_configs(name):
    cfg = yaml.safe_load((DEPLOY / name).read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    if name == "prometheus.yml":
        targets = jobs["tba"]["static_configs"][0]["targets"]
        assert targets == [f"127.0.0.1:{DEFAULT_PORT}"]
        promtool = shutil.which("promtool")
        if promtool:  # Debian's build lacks Kubernetes discovery: only this file is checked
            p = subprocess.run(
                [promtool, "check", "config", str(DEPLOY / name)], capture_output=True, text=True
            )
            assert p.returncode == 0, p.stdout + p.stderr
    else:
        keep = jobs["tba-kubernetes-pods"]["relabel_configs"][1]
        pod = _pod()
        (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "tba-sidecar"]
        assert keep["regex"] == sidecar["ports"][0]["name"]


def test_dashboard_is_well_formed():
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"])
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "instance", "rank"}
