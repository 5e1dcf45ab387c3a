"""A small, fast HTTP/1.1 load generator for the overhead benchmark (raw asyncio, keep-alive).

Why this module exists: a router's added latency is a fraction of a millisecond and its
throughput thousands of requests per second; an HTTP client library's own per-request cost
(httpx: ~0.3 ms) would hide both. This client pre-encodes one request, keeps connections
open and parses only what it needs (status, Content-Length or chunked framing). The same
generator drives the direct upstream, our gateway and sglang-router, so their figures are
comparable. Every run is bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass


def encode(path: str, body: dict[str, object], port: int) -> bytes:
    payload = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload


class Conn:
    """One keep-alive connection; ``request`` returns (status, first body byte s, total s)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> tuple[int, float, float]:
        t0 = time.perf_counter()
        self.writer.write(raw)
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = -1
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        first = 0.0
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
                first = first or time.perf_counter() - t0
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length >= 0:
            await self.reader.readexactly(length)
            first = time.perf_counter() - t0
        else:
            raise RuntimeError("response without Content-Length or chunked framing")
        return status, first, time.perf_counter() - t0

    def close(self) -> None:
        self.writer.close()


async def latencies(port: int, raw: bytes, n: int, budget_s: float) -> list[float]:
    """``n`` sequential requests on one connection (stops early after ``budget_s``); seconds."""
    conn = await Conn.open(port)
    out: list[float] = []
    deadline = time.perf_counter() + budget_s
    try:
        while len(out) < n and time.perf_counter() < deadline:
            status, _, total = await conn.request(raw)
            if status != 200:
                raise RuntimeError(f"127.0.0.1:{port} answered {status}")
            out.append(total)
    finally:
        conn.close()
    return out


@dataclass
class Throughput:
    requests: int
    errors: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def throughput(
    port: int, raw: bytes, concurrency: int, duration_s: float, max_requests: int
) -> Throughput:
    """Closed loop: ``concurrency`` connections send back to back for ``duration_s`` (or until
    ``max_requests`` are done); completed 200s per second."""
    conns = [await Conn.open(port) for _ in range(concurrency)]
    done = errors = 0
    t0 = time.perf_counter()
    stop = t0 + duration_s

    async def loop(conn: Conn) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop and done + errors < max_requests:
            try:
                status, _, _ = await conn.request(raw)
            except (ConnectionError, asyncio.IncompleteReadError):
                errors += 1
                return
            if status == 200:
                done += 1
            else:
                errors += 1

    try:
        await asyncio.wait_for(asyncio.gather(*(loop(c) for c in conns)), duration_s + 30)
    finally:
        for c in conns:
            c.close()
    return Throughput(done, errors, time.perf_counter() - t0)
