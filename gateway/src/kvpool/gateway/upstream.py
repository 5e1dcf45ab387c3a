"""The HTTP client of the request path (proxying, PD prefill, remote tokenization).

Why this module exists: every proxied request costs the gateway one upstream request, and on
a busy host each separate socket write is a wake-up of the peer. aiohttp sends a request's
headers and body in one write and keeps connections alive per instance; httpx (used for the
control calls: probes, the controller, the memory fan-out) writes them separately. Failures
are classified once, here: *connect* (nothing was sent or the connection was refused or
dropped before an answer: safe to retry elsewhere), *timeout* (504) and, while reading an
answer, *cut*.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

_ENCODE = msgspec.json.Encoder()

#: Raised before any answer arrived: the request may go to another instance.
CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)
#: Raised while an answer is being read: the connection died mid-answer.
CUT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientPayloadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionError,
)
TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)
#: Anything the request path's client raises for a failed call.
CALL_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, *TIMEOUT_ERRORS)


class Upstream:
    """One keep-alive connection pool for the request path; :meth:`start` in the loop."""

    def __init__(self, max_connections: int, connect_timeout_s: float, read_timeout_s: float):
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None

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
    ) -> aiohttp.ClientResponse:
        """Send ``body`` as JSON (``raw``: its bytes already, sent as they are); returns once
        the answer's status and headers arrived."""
        return await self.session.post(
            url,
            data=_ENCODE.encode(body) if raw is None else raw,
            headers={"content-type": "application/json", **(headers or {})},
        )

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
        if self._session is not None:
            await self._session.close()
            self._session = None
