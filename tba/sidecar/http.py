"""A small HTTP/1.1 server on asyncio streams, for GET and HEAD of a few paths.

Why not ``http.server`` or aiohttp: the former is thread-per-request and blocks on slow clients;
the latter is a dependency for three routes. This one supports what scrapers and probes send:
persistent connections (HTTP/1.1 default, ``Connection: close``, HTTP/1.0 without keep-alive),
small request bodies (read and ignored), and nothing else. Limits: a request line or header line
of at most 8 KiB, 100 header lines, bodies of at most 64 KiB (413), no ``Transfer-Encoding``
(501); an idle connection is closed after ``idle_timeout`` seconds.

NOTE [Malformed requests]
1. Every request the server cannot take gets an error status, ``Connection: close``, and one
   JSON log line (``http_bad_request``, at warning level: status, reason, peer, the request
   line as far as it came). Nothing that comes off the wire reaches ``int()``, ``urlsplit`` or
   a route before it is checked. A malformed request (syntax, framing, size, time) is a 4xx.
   Two kinds of well-formed request, for what this server does not implement, get the 5xx
   that the RFCs name for them instead, on purpose: a body sent with ``Transfer-Encoding``
   (chunked or any other coding) is a 501 Not Implemented (RFC 9112 6.1: a transfer coding the
   server does not implement; no route takes a body, so only ``Content-Length`` bodies are
   read, and ignored), and a request line naming another major version (``HTTP/2.0``) is a 505
   HTTP Version Not Supported (RFC 9110 15.6.6; HTTP/2 with prior knowledge, whose preface
   starts ``PRI * HTTP/2.0``, gets the same 505). A 4xx would tell the client that its request
   is wrong where it is only unsupported here. Neither is a fault of the server: both are
   logged like the 4xx, never as errors, and the server goes on answering.
2. Strict parsing, as RFC 9112 allows: every line ends in CRLF (a bare LF is a 400, at once,
   not a wait for a CRLF that never comes); the method and header names are tokens; the target
   is visible ASCII; header values hold no control characters but TAB; ``Content-Length`` is
   ASCII digits only (``str.isdigit()`` also passes "²", which ``int()`` refuses), one value
   (a repeated header is a 400), and a number too long to be a size is a 413.
3. Time: ``idle_timeout`` between requests (no answer: nothing was asked), ``read_timeout`` for
   a whole request from its first byte (408), so a client trickling bytes cannot hold a
   connection. A request cut short by the client's end of stream is answered (400) while the
   socket still takes writes; a reset connection is just closed. After an error answer the
   server ends its side and drains the client's input for a bounded time before it closes
   (a close with unread input would reset the connection and could destroy the answer).
4. A bug in the server or a route never escapes as a plain-text traceback: a route's exception
   is a 500, anything else is logged as JSON (``http_internal_error``, with the traceback as a
   field) and answered with a 500 when the response has not started.

:meth:`HttpServer.shutdown` stops accepting, closes idle connections, lets requests in flight
finish (their responses carry ``Connection: close``) for up to ``grace`` seconds, then cancels
what is left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import logging
import re
import traceback
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from .jsonlog import event

__all__ = ["HttpServer", "Request", "Response"]

_LINE_LIMIT = 8192
_MAX_HEADERS = 100
_MAX_BODY = 65536
_SHOWN = 200  # bytes of a bad request line quoted in the log
_LINGER_SECONDS = 2.0  # after an error answer, see _linger
_LINGER_BYTES = 1 << 20

# RFC 9110 5.6.2 token; 5.5 field-value (visible ASCII, obs-text, SP and HTAB); 9112 3.2 target.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_HTTP_VERSION = re.compile(rb"HTTP/[0-9]\.[0-9]")
_DIGITS = re.compile(r"[0-9]+")

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


@dataclasses.dataclass
class Request:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]


@dataclasses.dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response]]


class _BadRequest(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status
        self.text = text


@dataclasses.dataclass
class _Conn:
    busy: bool = False
    line: bytes = b""  # the request line of the request being read (for the log)


class HttpServer:
    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        idle_timeout: float = 30.0,
        read_timeout: float = 10.0,
    ):
        self.handler = handler
        self.host = host
        self.port = port
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        self._server: asyncio.base_events.Server | None = None
        self._conns: dict[asyncio.Task, _Conn] = {}
        self._closing = False

    @property
    def connections(self) -> int:
        return len(self._conns)

    async def start(self) -> tuple[str, int]:
        """Listen; return the bound address (the real port when ``port`` was 0)."""
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=_LINE_LIMIT, reuse_address=True
        )
        sock = self._server.sockets[0].getsockname()
        return sock[0], sock[1]

    async def shutdown(self, grace: float) -> int:
        """Stop; return how many connections had to be cancelled after ``grace`` seconds."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task, conn in list(self._conns.items()):
            if not conn.busy:
                task.cancel()
        pending = [t for t in self._conns if not t.done()]
        if pending:
            _done, still = await asyncio.wait(pending, timeout=grace)
            for t in still:
                t.cancel()
            if still:
                await asyncio.wait(still)
            cancelled = len(still)
        else:
            cancelled = 0
        if self._server is not None:
            await self._server.wait_closed()
        return cancelled

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # always inside a task: start_server runs callbacks as tasks
        conn = self._conns[task] = _Conn()
        answered = True  # no request is waiting for its response
        try:
            while not self._closing:
                try:  # NOTE [Malformed requests] 3: idle between requests
                    first = await asyncio.wait_for(reader.readexactly(1), self.idle_timeout)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    break
                conn.busy, conn.line, answered = True, first, False
                try:
                    request = await asyncio.wait_for(
                        self._read_request(first, reader, conn), self.read_timeout
                    )
                except asyncio.TimeoutError:
                    bad = _BadRequest(408, f"request not received within {self.read_timeout:g} s")
                    await self._refuse(reader, writer, conn, bad)
                    break
                except _BadRequest as bad:
                    await self._refuse(reader, writer, conn, bad)
                    break
                if request is None:  # an empty line before a request line (RFC 9112 2.2)
                    conn.busy, answered = False, True
                    continue
                try:
                    response = await self.handler(request)
                except Exception as e:  # a bug in a route must not take the server down
                    event(logging.ERROR, "http_handler_failed", path=request.path, error=repr(e))
                    response = _error(500, "internal error; see the sidecar's log")
                close = self._closing or _wants_close(request)
                answered = True
                await self._send(writer, request, response, close)
                conn.busy = False
                if close:
                    break
        except ConnectionError:
            pass  # the client went away: nobody to answer
        except asyncio.CancelledError:
            # shutdown() cancelled us; end normally, since Python 3.11's start_server callback
            # calls exception() on a cancelled task and reports that CancelledError as an error
            pass
        except Exception as e:  # NOTE [Malformed requests] 4
            event(
                logging.ERROR,
                "http_internal_error",
                peer=_peer(writer),
                request_line=_shown(conn.line),
                error=repr(e),
                traceback="".join(traceback.format_exception(e)),
            )
            if not answered:
                try:
                    await self._send(writer, None, _error(500, "internal error"), True)
                except Exception:
                    pass  # best effort, on a connection that is failing already
        finally:
            self._conns.pop(task, None)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def _refuse(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: _Conn,
        bad: _BadRequest,
    ) -> None:
        """NOTE [Malformed requests] 1: log the bad request, answer it, linger, close."""
        event(
            logging.WARNING,
            "http_bad_request",
            status=bad.status,
            reason=bad.text,
            peer=_peer(writer),
            request_line=_shown(conn.line),
        )
        await self._send(writer, None, _error(bad.status, bad.text), True)
        await _linger(reader, writer)

    async def _read_request(
        self, first: bytes, reader: asyncio.StreamReader, conn: _Conn
    ) -> Request | None:
        """The rest of a request whose first byte is ``first``; None for an empty line."""
        line = first if first == b"\n" else first + await _read_line(reader, 414, "request line")
        conn.line = line
        if line == b"\r\n":
            return None
        if not line.endswith(b"\r\n"):
            raise _BadRequest(400, "request line not ended by CRLF")
        parts = line[:-2].split(b" ")
        if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
            raise _BadRequest(400, "malformed request line")
        method, target, version = (p.decode("ascii", "replace") for p in parts)
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            if _HTTP_VERSION.fullmatch(parts[2]):
                raise _BadRequest(505, f"{version} is not supported; use HTTP/1.1")
            raise _BadRequest(400, "malformed request line")
        try:
            url = urlsplit(target)
        except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 literal)
            raise _BadRequest(400, "malformed request target") from None
        headers = await self._read_headers(reader)
        if "transfer-encoding" in headers:
            raise _BadRequest(501, "request bodies with Transfer-Encoding are not supported")
        length = _content_length(headers.get("content-length", "0"))
        if length:
            try:  # read and ignored: no route takes a body
                await reader.readexactly(length)
            except asyncio.IncompleteReadError:
                raise _BadRequest(400, "request body shorter than its Content-Length") from None
        return Request(method, url.path or "/", url.query, version, headers)

    @staticmethod
    async def _read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS + 1):
            raw = await _read_line(reader, 431, "header line")
            if raw == b"\r\n":
                return headers
            if not raw.endswith(b"\r\n"):
                raise _BadRequest(400, "header line not ended by CRLF")
            name, sep, value = raw[:-2].partition(b":")
            if not sep or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
                raise _BadRequest(400, "malformed header line")
            key = name.decode("ascii").lower()
            text = value.decode("latin-1").strip(" \t")
            if key == "content-length" and key in headers:
                raise _BadRequest(400, "more than one Content-Length")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        raise _BadRequest(431, f"more than {_MAX_HEADERS} header lines")

    @staticmethod
    async def _send(
        writer: asyncio.StreamWriter, request: Request | None, response: Response, close: bool
    ) -> None:
        reason = _REASONS.get(response.status, "")
        head = [
            f"HTTP/1.1 {response.status} {reason}",
            f"Date: {email.utils.formatdate(usegmt=True)}",
            "Server: tba-sidecar",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            f"Connection: {'close' if close else 'keep-alive'}",
        ]
        head += [f"{k}: {v}" for k, v in response.headers.items()]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        if request is None or request.method != "HEAD":
            data += response.body
        writer.write(data)
        await writer.drain()


def _wants_close(request: Request) -> bool:
    tokens = {t.strip().lower() for t in request.headers.get("connection", "").split(",")}
    if request.version == "HTTP/1.0":
        return "keep-alive" not in tokens
    return "close" in tokens


def _error(status: int, text: str) -> Response:
    return Response(status, f"{text}\n".encode())


async def _read_line(reader: asyncio.StreamReader, too_long: int, what: str) -> bytes:
    """One line, up to and with its LF (NOTE [Malformed requests] 2, 3)."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise _BadRequest(too_long, f"{what} over {_LINE_LIMIT} bytes") from None
    except asyncio.IncompleteReadError:
        raise _BadRequest(400, f"incomplete {what}: the connection ended inside it") from None


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an error answer, end our side and drain what the client still sends (at most
    ``_LINGER_BYTES`` for ``_LINGER_SECONDS``): closing with unread input would make the kernel
    reset the connection, which can destroy the answer in flight (RFC 9112 9.6)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _LINGER_SECONDS
    drained = 0
    try:
        if writer.can_write_eof():
            writer.write_eof()
        while drained < _LINGER_BYTES and (left := deadline - loop.time()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                break
            drained += len(chunk)
    except (asyncio.TimeoutError, OSError):
        pass  # the client is slow or gone: close anyway


def _content_length(value: str) -> int:
    """NOTE [Malformed requests] 2: ASCII digits, one value, at most ``_MAX_BODY``."""
    if not _DIGITS.fullmatch(value):
        raise _BadRequest(400, "bad Content-Length: not a single decimal number")
    digits = value.lstrip("0")
    if len(digits) > len(str(_MAX_BODY)) or int(digits or "0") > _MAX_BODY:
        raise _BadRequest(413, f"request body over {_MAX_BODY} bytes")
    return int(digits or "0")


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


def _shown(line: bytes) -> str:
    """A request line for the log: at most ``_SHOWN`` bytes, every byte kept (JSON escapes)."""
    text = line[:_SHOWN].decode("latin-1").rstrip("\r\n")
    return text + ("..." if len(line) > _SHOWN else "")
