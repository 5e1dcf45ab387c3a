"""The HTTP clients of the request path (proxying, PD prefill, remote tokenization).

Why this module exists: every proxied request costs the gateway one upstream request, and on
a busy host each separate socket write is a wake-up of the peer. Proxied requests go through
``h1client`` (pooled keep-alive connections, head and body in one write, nothing parsed
beyond the head: the least CPU per exchange); the small JSON calls of PD prefill releases and
remote tokenization through aiohttp; httpx (the control calls: probes, the controller, the
memory fan-out) writes head and body separately. Failures are classified once, here:
*connect* (nothing was sent or the connection was refused or dropped before an answer: safe
to retry elsewhere), *timeout* (504) and, while reading an answer, *cut*.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvpool.gateway.h1client import (
    ConnectFailedError,
    CutError,
    DisconnectedError,
    H1Error,
    H1Pool,
    H1Response,
)

_ENCODE = msgspec.json.Encoder()

#: Raised before any answer arrived: the request may go to another instance.
CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    ConnectFailedError,
    DisconnectedError,
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)
#: Raised while an answer is being read: the connection died mid-answer.
CUT_ERRORS: tuple[type[BaseException], ...] = (
    CutError,
    DisconnectedError,
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionError,
)
TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)
#: Anything the request path's clients raise for a failed call.
CALL_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, H1Error, *TIMEOUT_ERRORS)


class Upstream:
    """One keep-alive connection pool for the request path; :meth:`start` in the loop."""

    def __init__(self, max_connections: int, connect_timeout_s: float, read_timeout_s: float):
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.h1 = H1Pool(connect_timeout_s, read_timeout_s)
        self._targets: dict[str, tuple[str, int, str, bool]] = {}

    def _target(self, url: str) -> tuple[str, int, str, bool]:
        """(host, port, path, TLS) of an instance URL, parsed once per URL."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            path = parts.path or "/"
            if parts.query:
                path = f"{path}?{parts.query}"
            target = self._targets[url] = (parts.hostname or "", port, path, tls)
        return target

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, limit_per_host=0, ttl_dns_cache=300
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def post(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        track: set[Any] | None = None,
    ) -> H1Response:
        """Send ``body`` as JSON (``raw``: its bytes already, sent as they are) on a pooled
        keep-alive connection; returns once the answer's status and headers arrived.
        ``track``: holds the exchange while it is in flight (``H1Pool.post``)."""
        host, port, path, tls = self._target(url)
        data = _ENCODE.encode(body) if raw is None else raw
        return await self.h1.post(host, port, path, data, headers or {}, tls, track)

    async def post_json(
        self, url: str, body: dict[str, Any], timeout_s: float | None = None
    ) -> tuple[int, Any, str]:
        """Status, parsed JSON (or None) and raw text of a small JSON answer."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        async with self.session.post(
            url,
            data=_ENCODE.encode(body),
            headers={"content-type": "application/json"},
            timeout=timeout,
        ) as resp:
            raw = await resp.read()
        text = raw.decode(errors="replace")
        try:
            return resp.status, msgspec.json.decode(raw), text
        except msgspec.DecodeError:
            return resp.status, None, text

    async def close(self) -> None:
        self.h1.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
