"""A small HTTP/1.1 server on asyncio streams, for GET and HEAD of a few paths.

Why not ``http.server`` or aiohttp: the former is thread-per-request and blocks on slow clients;
the latter is a dependency for three routes. This one supports what scrapers and probes send:
persistent connections (HTTP/1.1 default, ``Connection: close``, HTTP/1.0 without keep-alive),
small request bodies (read and ignored), and nothing else. Limits: a request line or header line
of at most 8 KiB, 100 header lines, bodies of at most 64 KiB (413), no ``Transfer-Encoding``
(501); an idle connection is closed after ``idle_timeout`` seconds.

:meth:`HttpServer.shutdown` stops accepting, closes idle connections, lets requests in flight
finish (their responses carry ``Connection: close``) for up to ``grace`` seconds, then cancels
what is left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from ._log import event

__all__ = ["HttpServer", "Request", "Response"]

_LINE_LIMIT = 8192
_MAX_HEADERS = 100
_MAX_BODY = 65536

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
        try:
            while not self._closing:
                try:
                    line = await asyncio.wait_for(reader.readuntil(b"\r\n"), self.idle_timeout)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    break
                except asyncio.LimitOverrunError:
                    await self._send(writer, None, _error(414, "request line too long"), True)
                    break
                conn.busy = True
                try:
                    request = await asyncio.wait_for(
                        self._read_rest(line, reader), self.read_timeout
                    )
                except _BadRequest as bad:
                    await self._send(writer, None, _error(bad.status, bad.text), True)
                    break
                except asyncio.TimeoutError:
                    await self._send(
                        writer, None, _error(408, "request not received in time"), True
                    )
                    break
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                try:
                    response = await self.handler(request)
                except Exception as e:  # a bug in a route must not take the server down
                    event(logging.ERROR, "http_handler_failed", path=request.path, error=repr(e))
                    response = _error(500, "internal error; see the sidecar's log")
                close = self._closing or _wants_close(request)
                await self._send(writer, request, response, close)
                conn.busy = False
                if close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.pop(task, None)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def _read_rest(self, line: bytes, reader: asyncio.StreamReader) -> Request:
        try:
            method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ")
        except ValueError:
            raise _BadRequest(400, "malformed request line") from None
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            raise _BadRequest(505, f"{version} is not supported; use HTTP/1.1")
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS + 1):
            try:
                raw = await reader.readuntil(b"\r\n")
            except asyncio.LimitOverrunError:
                raise _BadRequest(431, "header line too long") from None
            if raw == b"\r\n":
                break
            text = raw.decode("latin-1").rstrip("\r\n")
            name, sep, value = text.partition(":")
            if not sep or not name or name != name.strip() or text[0] in " \t":
                raise _BadRequest(400, "malformed header line")
            key = name.lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        else:
            raise _BadRequest(431, f"more than {_MAX_HEADERS} header lines")
        if "transfer-encoding" in headers:
            raise _BadRequest(501, "request bodies with Transfer-Encoding are not supported")
        length = headers.get("content-length", "0")
        if not length.isdigit():
            raise _BadRequest(400, "bad Content-Length")
        if int(length) > _MAX_BODY:
            raise _BadRequest(413, f"request body over {_MAX_BODY} bytes")
        if int(length):
            await reader.readexactly(int(length))  # read and ignored: no route takes a body
        parts = urlsplit(target)
        return Request(method, parts.path or "/", parts.query, version, headers)

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
