"""The sidecar's HTTP/1.1 server, over real sockets: routes, persistent connections, bad
requests, and a clean SIGTERM that finishes the request in flight."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time

import pytest

from ._support import SidecarProc


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    base = tmp_path_factory.mktemp("http")
    (base / "metrics").mkdir()
    with SidecarProc(
        "--metrics-dir", str(base / "metrics"), "--spill-dir", str(base / "spill")
    ) as sc:
        yield sc


def raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_routes_on_one_persistent_connection(sidecar):
    conn = http.client.HTTPConnection("127.0.0.1", sidecar.port, timeout=10)
    try:
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        assert (r.status, r.read(), r.getheader("Connection")) == (200, b"ok\n", "keep-alive")
        conn.request("GET", "/status?pretty=1")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "application/json"
        status = json.loads(r.read())
        assert status["healthy"] is True and status["sidecar"]["scrapes"] == 0
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        body = r.read().decode()
        assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain")
        assert "\ntba_sidecar_up 1.0\n" in body
        conn.request("HEAD", "/metrics")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"" and int(r.getheader("Content-Length")) > 100
        conn.request("GET", "/nope")
        r = conn.getresponse()
        assert (r.status, r.read()) == (404, b"not found; try /metrics, /healthz or /status\n")
        conn.request("POST", "/metrics", body=b"x=1")
        r = conn.getresponse()
        assert (r.status, r.getheader("Allow")) == (405, "GET, HEAD")
        r.read()
    finally:
        conn.close()
    assert sidecar.status()["sidecar"]["scrapes"] == 2  # GET and HEAD of /metrics


def test_openmetrics_on_request(sidecar):
    code, headers, body = sidecar.get(
        "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert code == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GARBAGE\r\n\r\n", b"400 Bad Request"),
        (b"GET / HTTP/2.0\r\n\r\n", b"505 HTTP Version Not Supported"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"431 "),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", b"414 URI Too Long"),
        (b"GET / HTTP/1.1\r\n bad: fold\r\n\r\n", b"400 Bad Request"),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"501 Not Implemented"),
        (b"POST / HTTP/1.1\r\nContent-Length: 100000\r\n\r\n", b"413 Content Too Large"),
        (b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"400 Bad Request"),
    ],
)
def test_bad_requests_get_an_error_and_a_close(sidecar, request_bytes, status):
    reply = raw(sidecar.port, request_bytes)
    assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]
    assert b"\r\nConnection: close\r\n" in reply


def test_http10_closes_and_a_small_body_is_ignored(sidecar):
    reply = raw(sidecar.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b"\r\n\r\nok\n")
    assert b"\r\nConnection: close\r\n" in reply
    reply = raw(
        sidecar.port,
        b"GET /healthz HTTP/1.1\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
    )
    assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b"ok\n")


def test_sigterm_finishes_the_request_in_flight_and_exits_0(metrics_dir, spill_root):
    sc = SidecarProc("--metrics-dir", metrics_dir, "--spill-dir", spill_root)
    idle = socket.create_connection(("127.0.0.1", sc.port), timeout=10)
    busy = socket.create_connection(("127.0.0.1", sc.port), timeout=10)
    try:
        busy.sendall(b"GET /healthz HTTP/1.1\r\n")  # a request has started, not yet complete
        time.sleep(0.3)
        sc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert sc.proc.poll() is None  # waiting for the request in flight
        assert idle.recv(100) == b""  # the idle connection was closed at once
        busy.sendall(b"Host: x\r\n\r\n")
        reply = b""
        while chunk := busy.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b"ok\n")
        assert b"\r\nConnection: close\r\n" in reply
        assert sc.proc.wait(10) == 0
    finally:
        idle.close()
        busy.close()
        sc.stop(check=False)
    events = [r["event"] for r in sc.records()]
    assert events[-3:] == ["signal", "stopping", "stopped"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", sc.port), timeout=5)
