"""One snapshot of the index fetched from the controller's snapshot ROUTER, over a fresh DEALER.

Why this module exists: two components follow the controller's index (the gateway's
``IndexClient`` and the controller's own standby replica), and both fetch snapshots the same
way: a new DEALER for each request, so a reply lost or late never answers the next one; the
request ``[b"", SNAPSHOT_REQUEST]``; the reply's last frame decoded with
:func:`kvpool.protocol.deltas.decode_snapshot`; a bounded wait; the socket closed whatever
happens. One definition, here, beside the wire types. kvpool.protocol imports no socket
library (the import-linter contract), so the caller creates the socket (``ctx.socket(zmq.DEALER)``
with ``LINGER`` 0) and hands it over; :class:`Dealer` is what this needs of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from kvpool.protocol.deltas import SNAPSHOT_REQUEST, Snapshot, decode_snapshot

__all__ = ["Dealer", "fetch_snapshot"]


class Dealer(Protocol):
    """What :func:`fetch_snapshot` uses of an asyncio DEALER socket (``zmq.asyncio``)."""

    def connect(self, addr: str, /) -> object: ...

    def send_multipart(self, msg_parts: Sequence[bytes], /) -> Awaitable[object]: ...

    def recv_multipart(self) -> Awaitable[Sequence[Any]]: ...

    def close(self, linger: int | None = ...) -> None: ...


async def fetch_snapshot(dealer: Dealer, url: str, timeout_s: float) -> Snapshot:
    """Connect ``dealer`` (new, unconnected) to the snapshot ROUTER at ``url``, ask for one
    snapshot and wait at most ``timeout_s`` for it; the dealer is closed in every case.

    Raises ``TimeoutError`` when no reply comes in time, ``msgspec`` errors for a reply that is
    not a snapshot (as :func:`~kvpool.protocol.deltas.decode_snapshot`), and the socket's own.
    """
    try:
        dealer.connect(url)
        await dealer.send_multipart([b"", SNAPSHOT_REQUEST])
        frames = await asyncio.wait_for(dealer.recv_multipart(), timeout_s)
        return decode_snapshot(frames[-1])
    finally:
        dealer.close(linger=0)
