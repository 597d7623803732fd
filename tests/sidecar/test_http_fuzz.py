"""Malformed HTTP thrown at a real ``tba sidecar`` on loopback: every request it can answer gets
a 4xx, it keeps answering /healthz, and everything it logs is a JSON line."""

from __future__ import annotations

import json
import random
import re
import socket
import time

import pytest

from ._support import SidecarProc


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    (base / "metrics").mkdir()
    with SidecarProc(
        "--metrics-dir", str(base / "metrics"), "--spill-dir", str(base / "spill")
    ) as sc:
        yield sc


def exchange(port: int, data: bytes, timeout: float = 15) -> bytes:
    """Send ``data``, close our side, and return everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def not_json(lines: list[str]) -> list[str]:
    bad = []
    for line in lines:
        try:
            if not isinstance(json.loads(line), dict):
                bad.append(line)
        except ValueError:
            bad.append(line)
    return bad


def test_a_non_ascii_digit_in_content_length_is_a_400(sidecar):
    """'²' passes str.isdigit() but not int(): it used to drop the connection unanswered and
    print a plain-text traceback into the JSON log."""
    reply = exchange(sidecar.port, b"GET /healthz HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply
    assert sidecar.get("/healthz")[0] == 200
    assert not_json(sidecar.lines) == []


# -- the fuzz ------------------------------------------------------------------------------------

MALFORMED = {400, 408, 413, 414, 431, 501, 505}  # statuses of NOTE [Malformed requests] 1
ROUTED = {200, 404, 405}  # what the routes answer to a well-formed request
GOOD = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n",
    b"POST /status HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
    b"GET /status?pretty=1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
]
HOSTILE = [b"\x00", b"\r", b"\n", b"\r\n", b" ", b"\t", b":", b"\xb2", b"\xff", b"\x7f", b"9" * 40]
# (name, bytes sent, the status of the last response; None: no answer, nothing was asked)
NAMED = [
    ("superscript two", b"GET / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", 400),
    ("superscript three", b"GET / HTTP/1.1\r\nContent-Length: 1\xb3\r\n\r\n", 400),
    ("arabic-indic digit", "GET / HTTP/1.1\r\nContent-Length: ٣\r\n\r\n".encode(), 400),
    ("fullwidth digit", "GET / HTTP/1.1\r\nContent-Length: ５\r\n\r\n".encode(), 400),
    ("negative length", b"GET / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    ("plus sign", b"GET / HTTP/1.1\r\nContent-Length: +5\r\n\r\nhello", 400),
    ("hex length", b"GET / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n", 400),
    ("empty length", b"GET / HTTP/1.1\r\nContent-Length:\r\n\r\n", 400),
    ("huge length", b"GET / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", 413),
    ("5000-digit length", b"GET / HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", 413),
    (
        "zero-padded length",
        b"GET /healthz HTTP/1.1\r\nContent-Length: " + b"0" * 80 + b"\r\n\r\n",
        200,
    ),
    (
        "duplicate length",
        b"GET / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
        400,
    ),
    ("length list", b"GET / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\nhello", 400),
    (
        "conflicting lengths",
        b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 9\r\n\r\nx",
        400,
    ),
    ("body cut short", b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", 400),
    ("chunked", b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
    (
        "length and chunked",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        501,
    ),
    ("lower-case method", b"get /healthz HTTP/1.1\r\n\r\n", 405),
    ("unknown method", b"BREW /healthz HTTP/1.1\r\n\r\n", 405),
    ("method with a NUL", b"GE\x00T / HTTP/1.1\r\n\r\n", 400),
    ("method with a paren", b"GET( / HTTP/1.1\r\n\r\n", 400),
    ("non-ASCII method", "GÉT / HTTP/1.1\r\n\r\n".encode(), 400),
    ("no method", b" / HTTP/1.1\r\n\r\n", 400),
    ("two spaces", b"GET  / HTTP/1.1\r\n\r\n", 400),
    ("four parts", b"GET / HTTP/1.1 extra\r\n\r\n", 400),
    ("one word", b"GARBAGE\r\n\r\n", 400),
    ("control char in target", b"GET /a\x01b HTTP/1.1\r\n\r\n", 400),
    ("non-ASCII target", "GET /é HTTP/1.1\r\n\r\n".encode(), 400),
    ("unclosed IPv6 target", b"GET http://[::1/healthz HTTP/1.1\r\n\r\n", 400),
    ("absolute target", b"GET http://x/healthz HTTP/1.1\r\n\r\n", 200),
    ("HTTP/2.0", b"GET / HTTP/2.0\r\n\r\n", 505),
    ("HTTP/9.9", b"GET / HTTP/9.9\r\n\r\n", 505),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),  # NOTE [Malformed requests] 1
    ("lower-case version", b"GET / http/1.1\r\n\r\n", 400),
    ("version suffix", b"GET / HTTP/1.1x\r\n\r\n", 400),
    ("bare LF request line", b"GET /healthz HTTP/1.1\n\n", 400),
    ("bare LF header", b"GET /healthz HTTP/1.1\r\nHost: x\n\r\n", 400),
    ("bare CR", b"GET /healthz HTTP/1.1\rHost: x\r\n\r\n", 400),
    ("header without colon", b"GET / HTTP/1.1\r\nHost\r\n\r\n", 400),
    ("header name with space", b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", 400),
    ("space before colon", b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    ("empty header name", b"GET / HTTP/1.1\r\n: x\r\n\r\n", 400),
    ("NUL in header value", b"GET / HTTP/1.1\r\nHost: a\x00b\r\n\r\n", 400),
    ("obs-fold", b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
    ("latin-1 header value", b"GET /healthz HTTP/1.1\r\nX-Name: caf\xe9\r\n\r\n", 200),
    ("request line of 9000 bytes", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    ("header line of 9000 bytes", b"GET / HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", 431),
    ("101 header lines", b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
    ("request line cut short", b"GET /healthz HTT", 400),
    ("headers cut short", b"GET /healthz HTTP/1.1\r\nHost: x\r\n", 400),
    ("header cut short", b"GET /healthz HTTP/1.1\r\nHo", 400),
    ("only a CR", b"\r", 400),
    ("empty lines only", b"\r\n\r\n\r\n", None),
    ("nothing", b"", None),
    ("empty line, then a request", b"\r\nGET /healthz HTTP/1.1\r\n\r\n", 200),
    (
        "good, then bad",
        b"GET /healthz HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n",
        400,
    ),
    ("TLS hello", bytes.fromhex("16030100a5010000a10303") + bytes(range(256)), 400),
    ("binary garbage", bytes(range(256)) * 4, 400),
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """1 to 3 edits of ``data``: a byte flipped, inserted (often a hostile one), deleted, a line
    doubled, a cut, or random bytes spliced in."""
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(data) + 1)
        kind = rng.randrange(6)
        if kind == 0 and at < len(data):
            data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :]
        elif kind == 1:
            data = data[:at] + rng.choice(HOSTILE) + data[at:]
        elif kind == 2:
            data = data[:at] + data[at + 1 :]
        elif kind == 3:
            lines = data.split(b"\r\n")
            i = rng.randrange(len(lines))
            data = b"\r\n".join(lines[: i + 1] + lines[i:])
        elif kind == 4:
            data = data[:at]
        else:
            data = data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]
    return data


def responses(reply: bytes, head: bool = False) -> list[tuple[int, dict[bytes, bytes]]]:
    """The (status, headers) of each HTTP/1.1 response in ``reply``; AssertionError for
    anything else (a truncated response, bytes that are not one). ``head``: a request may have
    been a HEAD, whose response has no body."""
    out = []
    while reply:
        head, sep, reply = reply.partition(b"\r\n\r\n")
        assert sep, f"truncated response head: {head[:200]!r}"
        status_line, *lines = head.split(b"\r\n")
        assert re.fullmatch(rb"HTTP/1\.1 [1-5][0-9][0-9] [A-Za-z ]*", status_line), status_line
        headers = dict(line.split(b": ", 1) for line in lines)
        length = int(headers[b"Content-Length"])
        if head and (not reply or reply.startswith(b"HTTP/1.1 ")):
            length = 0  # the response to a HEAD
        assert len(reply) >= length, "truncated response body"
        reply = reply[length:]
        out.append((int(status_line[9:12]), headers))
    return out


def bad_request_records(sc: SidecarProc) -> dict[str, dict]:
    return {r["peer"]: r for r in sc.records() if r.get("event") == "http_bad_request"}


def check_logged(sc: SidecarProc, want: dict[str, int], timeout: float = 10) -> None:
    """Every peer in ``want`` has its http_bad_request line with that status (the sidecar's
    stderr is read by a thread: wait for it)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = bad_request_records(sc)
        missing = {p: s for p, s in want.items() if seen.get(p, {}).get("status") != s}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert missing == {}, f"no http_bad_request line for {len(missing)} of them"


def send_case(port: int, data: bytes, chunk: int = 0) -> tuple[str, bytes]:
    """(our address as the sidecar logs it, its reply); ``chunk`` > 0 sends that many bytes at
    a time, 2 ms apart (a slow client)."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        peer = "{}:{}".format(*s.getsockname()[:2])
        if chunk:
            for at in range(0, len(data), chunk):
                s.sendall(data[at : at + chunk])
                time.sleep(0.002)
        else:
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while piece := s.recv(65536):
            chunks.append(piece)
    return peer, b"".join(chunks)


def run_case(port: int, data: bytes, chunk: int = 0) -> tuple[str, int | None]:
    """Send one case; check the reply's shape; return (peer, last status or None)."""
    peer, reply = send_case(port, data, chunk)
    got = responses(reply, head=b"HEAD" in data)
    if not got:
        assert data.replace(b"\r\n", b"") == b"", f"no answer to {data[:120]!r}"
        return peer, None
    for status, _ in got[:-1]:
        assert status in ROUTED, (status, data[:120])
    status, headers = got[-1]
    assert status in MALFORMED | ROUTED, (status, data[:120])
    if status in MALFORMED:
        assert headers[b"Connection"] == b"close", data[:120]
    return peer, status


@pytest.mark.parametrize("name, data, status", NAMED, ids=[n for n, _, _ in NAMED])
def test_named_malformed_requests(sidecar, name, data, status):
    peer, got = run_case(sidecar.port, data)
    assert got == status, f"{name}: {got} instead of {status}"
    if status in MALFORMED:
        check_logged(sidecar, {peer: status})


def test_fuzzed_requests_each_get_an_answer_and_a_log_line(sidecar):
    """300 mutations of well-formed requests (seeded, so a failure repeats), every 10th sent
    in 7-byte pieces: each gets well-formed responses, the malformed ones an error status, a
    close and a JSON log line; /healthz answers throughout."""
    rng = random.Random(15)
    logged: dict[str, int] = {}
    statuses: set[int] = set()
    for i in range(300):
        data = mutate(rng, rng.choice(GOOD))
        peer, status = run_case(sidecar.port, data, chunk=7 if i % 10 == 0 else 0)
        statuses.add(status or 0)
        if status in MALFORMED:
            logged[peer] = status
        if i % 50 == 0:
            assert sidecar.get("/healthz")[0] == 200
    check_logged(sidecar, logged)
    assert len(logged) > 100 and {200, 400} <= statuses  # the mix is neither all good nor all bad
    assert sidecar.get("/healthz")[0] == 200


@pytest.mark.slow
def test_stalled_and_trickled_requests_get_a_408(sidecar):
    """Requests that stop coming, or come a byte every 0.5 s, are answered 408 after the
    sidecar's 10 s read timeout; the sidecar answers others meanwhile."""
    partial = [
        b"GET /healthz HT",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
        b"POST /healthz HTTP/1.1\r\nContent-Length: 100\r\n\r\nabc",
    ]
    socks = []
    try:
        for data in partial:
            s = socket.create_connection(("127.0.0.1", sidecar.port), timeout=20)
            socks.append(s)
            s.sendall(data)
        trickle = socket.create_connection(("127.0.0.1", sidecar.port), timeout=20)
        socks.append(trickle)
        started = time.monotonic()
        for byte in b"GET /healthz HTTP/1.1\r\n" * 2:
            if time.monotonic() - started > 11:
                break
            assert sidecar.get("/healthz")[0] == 200
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                break  # answered and closed: collected below
            time.sleep(0.5)
        want = {}
        for s in socks:
            peer = "{}:{}".format(*s.getsockname()[:2])
            reply = b""
            while piece := s.recv(65536):
                reply += piece
            ((status, headers),) = responses(reply)
            assert (status, headers[b"Connection"]) == (408, b"close")
            want[peer] = 408
        assert 9 < time.monotonic() - started < 15
    finally:
        for s in socks:
            s.close()
    check_logged(sidecar, want)


def test_everything_logged_is_json(sidecar):
    """Last in this module: after all the above, the log holds JSON lines only, and no error
    of the server itself."""
    assert sidecar.get("/healthz")[0] == 200
    assert not_json(sidecar.lines) == []
    events = {r["event"] for r in sidecar.records()}
    assert not events & {"http_internal_error", "asyncio_error", "uncaught_exception"}


def test_a_shutdown_with_idle_connections_logs_only_json(metrics_dir, spill_root):
    """SIGTERM cancels idle keep-alive connections: Python 3.11's asyncio used to report each
    as a plain-text 'Exception in callback ... CancelledError' traceback."""
    sc = SidecarProc("--metrics-dir", metrics_dir, "--spill-dir", spill_root)
    idle = [socket.create_connection(("127.0.0.1", sc.port), timeout=10) for _ in range(3)]
    try:
        idle[0].sendall(b"GET /healthz HTTP/1.1\r\n\r\n")  # one has had a request already
        assert idle[0].recv(4096).startswith(b"HTTP/1.1 200 OK")
        assert sc.stop() == 0
    finally:
        for s in idle:
            s.close()
    assert not_json(sc.lines) == []
    assert [r["event"] for r in sc.records()][-3:] == ["signal", "stopping", "stopped"]
