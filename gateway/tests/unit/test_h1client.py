"""The request path's HTTP/1.1 client against raw asyncio servers on 127.0.0.1: keep-alive
reuse, chunked and length-delimited answers, the failure classes the proxy retries on, the
read timeout, and a bounded buffer for an answer nobody reads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvpool.gateway.h1client import (
    HIGH_WATER,
    ConnectFailedError,
    CutError,
    DisconnectedError,
    H1Pool,
)

pytestmark = pytest.mark.timeout(30)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[int, list[int]]]:
    """``handler`` per connection; yields the port and a list counting connections."""
    conns: list[int] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await handler(r, w)
        w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield port, conns
    finally:
        srv.close()


async def read_request(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await r.readexactly(length)


async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        body = await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await w.drain()


async def test_keep_alive_connections_are_reused_and_headers_read() -> None:
    pool = H1Pool(2.0, 5.0)
    async with server(echo) as (port, conns):
        for n in range(3):
            resp = await pool.post("127.0.0.1", port, "/p", b'{"n": %d}' % n, {"x-b": "2"}, False)
            assert resp.status == 200 and resp.header("x-a") == "1"
            assert await resp.read() == b'{"n": %d}' % n
            resp.release()
        assert len(conns) == 1
    pool.close()


async def test_chunked_answers_arrive_chunk_by_chunk() -> None:
    async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"6\r\n world\r\n0\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)

    pool = H1Pool(2.0, 5.0)
    async with server(chunked) as (port, _):
        resp = await pool.post("127.0.0.1", port, "/", b"{}", {}, False)
        assert await resp.read_chunk() == b"hello"
        assert [c async for c in resp.iter_chunks()] == [b" world"]
        resp.release()
    pool.close()


async def test_failures_are_classified_for_the_proxy() -> None:
    pool = H1Pool(2.0, 0.3)
    async with server(echo) as (port, _):
        pass  # closed: nothing listens on the port any more
    with pytest.raises(ConnectFailedError):
        await pool.post("127.0.0.1", port, "/", b"{}", {}, False)

    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)

    async with server(hang_up) as (port, _):
        with pytest.raises(DisconnectedError):
            await pool.post("127.0.0.1", port, "/", b"{}", {}, False)

    async def short(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await w.drain()

    async with server(short) as (port, _):
        resp = await pool.post("127.0.0.1", port, "/", b"{}", {}, False)
        with pytest.raises(CutError):
            await resp.read()

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(5)

    async with server(silent) as (port, _):
        with pytest.raises(TimeoutError):
            await pool.post("127.0.0.1", port, "/", b"{}", {}, False)
    pool.close()


async def test_an_unread_stream_is_buffered_up_to_the_high_water_mark() -> None:
    total = 128 * HIGH_WATER  # 32 MiB: more than the loopback socket buffers hold
    sent = asyncio.Event()

    async def firehose(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            w.write(b"x" * 65536)
            await w.drain()
        sent.set()

    pool = H1Pool(2.0, 5.0)
    async with server(firehose) as (port, _):
        resp = await pool.post("127.0.0.1", port, "/", b"{}", {}, False)
        await asyncio.sleep(0.5)
        conn = resp._conn
        assert conn.paused and conn.buffered <= 2 * HIGH_WATER
        assert not sent.is_set()  # the sender is held back by TCP, not buffered here
        got = 0
        while chunk := await resp.read_chunk():
            got += len(chunk)
            assert conn.buffered <= 2 * HIGH_WATER
        assert got == total
        resp.release()
    pool.close()
