"""A lean HTTP/1.1 client for the request path: pooled keep-alive connections, one write per
request, httptools parsing, bounded buffering.

Why this module exists: every proxied request costs the gateway one upstream exchange, and a
general client's per-request machinery (aiohttp builds a request object, a multidict of
headers, timers, tracing hooks and a payload writer for each call) was a sixth of the gateway's
CPU per request, more than the routing decision. The gateway only ever POSTs a JSON body it
already holds as bytes to instances it knows, so an exchange here is: take an idle connection
of that instance (or connect), write the head and body in one ``write``, let httptools parse
the answer as it arrives. Nothing is parsed beyond the status line and headers.

Streaming and memory: body bytes are buffered per exchange only up to :data:`HIGH_WATER`;
beyond that the connection stops reading (TCP pushes back on the instance) until the consumer
has taken them, so a slow client holds at most that much per stream in the gateway.

Failures, as the proxy needs them: :class:`ConnectFailedError` (nothing was sent: refused,
unreachable), :class:`DisconnectedError` (the connection closed before the answer's head: safe to
retry elsewhere, like a stale keep-alive connection), :class:`CutError` (closed or garbled mid
answer), and ``TimeoutError`` (no connection within the connect timeout, no byte within the
read timeout).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools

#: Buffered body bytes of one exchange before its connection stops reading.
HIGH_WATER = 256 * 1024
#: Idle keep-alive connections kept per instance.
MAX_IDLE_PER_HOST = 512


class H1Error(Exception):
    """A failed exchange with an upstream instance."""


class ConnectFailedError(H1Error):
    """No connection could be made (refused, unreachable): nothing was sent."""


class DisconnectedError(H1Error):
    """The connection closed before the answer's status line and headers arrived."""


class CutError(H1Error):
    """The connection closed, or the answer was not valid HTTP, in the middle of the answer."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection and the state of its current exchange."""

    def __init__(self, pool: H1Pool, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        #: the set of exchanges in flight to its instance while this one is (``post``'s track)
        self.track: set[Any] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.head: asyncio.Future[None] = self.loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(CutError(f"invalid HTTP answer: {exc}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if not self.head.done():
            why = f": {exc}" if exc else ""
            self._fail(DisconnectedError(f"the connection closed before an answer{why}"))
        elif self._until_close():
            self.complete = True  # no length, no chunks: the answer ends with the connection
            self._wake()
        else:
            why = f": {exc}" if exc else ""
            self._fail(CutError(f"the connection closed mid-answer{why}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = bool(self.parser.should_keep_alive())
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # exchange state
    def _until_close(self) -> bool:
        names = {name for name, _ in self.headers}
        return "content-length" not in names and "transfer-encoding" not in names

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved here: a caller that stopped waiting is fine
        self._wake()

    def abort(self) -> None:
        self.closed = True
        self.untrack()
        if self.transport is not None:
            self.transport.abort()

    def untrack(self) -> None:
        """The exchange ended: no longer in flight."""
        if self.track is not None:
            self.track.discard(self)
            self.track = None

    def take(self) -> bytes:
        """Every buffered body byte (resuming reads if they were paused)."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def wait_data(self, timeout_s: float | None) -> None:
        """Until body bytes, the end of the answer or a failure (``TimeoutError`` after
        ``timeout_s`` without any)."""
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, _expire, waiter) if timeout_s else None
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class H1Response:
    """The answer of one exchange: status and headers, then the body as it arrives."""

    __slots__ = ("_conn", "_read_timeout_s", "_released", "headers", "status")

    def __init__(self, conn: _Conn, read_timeout_s: float | None) -> None:
        self._conn = conn
        self._read_timeout_s = read_timeout_s
        self._released = False
        self.status = conn.status
        self.headers = conn.headers  # (lowercase name, value) in the order received

    def header(self, name: str, default: str | None = None) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return default

    async def read_chunk(self) -> bytes:
        """The body bytes received so far, waiting for some; ``b""`` at the end of the body."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            await conn.wait_data(self._read_timeout_s)

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self.read_chunk():
            yield chunk

    def release(self) -> None:
        """Done with the answer: a fully read keep-alive connection goes back to the pool,
        any other is closed."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.complete and conn.keep_alive and conn.error is None and not conn.closed:
            conn.pool.put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Drop the connection (the instance sees the client leave and stops the request)."""
        if not self._released:
            self._released = True
            self._conn.abort()


class H1Pool:
    """Keep-alive connections per ``(host, port)``, reused most recent first."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float | None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._tls: ssl.SSLContext | None = None

    def put(self, conn: _Conn) -> None:
        conn.untrack()
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= MAX_IDLE_PER_HOST:
            conn.abort()
            return
        conn._reset()
        idle.append(conn)

    async def _connect(self, key: tuple[str, int, bool]) -> _Conn:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        context = None
        if tls:
            context = self._tls = self._tls or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Conn(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                ),
                self.connect_timeout_s,
            )
        except OSError as exc:
            raise ConnectFailedError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return conn

    async def _conn(self, key: tuple[str, int, bool]) -> _Conn:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if not conn.closed and transport is not None and not transport.is_closing():
                return conn
        return await self._connect(key)

    async def post(
        self,
        host: str,
        port: int,
        path: str,
        body: bytes,
        headers: dict[str, str],
        tls: bool,
        track: set[Any] | None = None,
    ) -> H1Response:
        """Send ``body`` (JSON bytes) to ``path`` (over TLS with ``tls``); returns once the
        answer's head arrived. ``track``: the connection is in this set until the exchange
        ends (released or closed), so that its owner can abort it meanwhile."""
        conn = await self._conn((host, port, tls))
        if track is not None:
            conn.track = track
            track.add(conn)
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{lines}\r\n"
        ).encode("latin-1")
        transport = conn.transport
        assert transport is not None
        transport.write(head + body)
        timer = (
            conn.loop.call_later(self.read_timeout_s, _expire, conn.head)
            if self.read_timeout_s
            else None
        )
        try:
            await conn.head
        except BaseException:
            conn.abort()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return H1Response(conn, self.read_timeout_s)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
