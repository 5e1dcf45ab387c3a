"""The PD proxy's wire contract with LMCache 0.5.6: ``ProxyNotif`` as LMCache's own PD sender
encodes it, and the bounded transfer-wait bookkeeping."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvpool.gateway.pd import TransferWaits, decode_notification


def test_proxy_notif_decodes_lmcache_s_own_encoding() -> None:
    pd_backend = pytest.importorskip("lmcache.v1.storage_backend.pd_backend")
    frame = msgspec.msgpack.encode(pd_backend.ProxyNotif(req_id="req-42"))
    assert decode_notification(frame) == "req-42"
    # another PD message on the socket is not a notification
    other = msgspec.msgpack.encode(pd_backend.CacheQueryRequest(keys=["k"]))
    assert decode_notification(other) is None
    assert decode_notification(b"\xff garbage") is None


async def test_waits_complete_after_every_rank_and_stay_bounded() -> None:
    waits = TransferWaits(max_tracked=4)
    event = waits.expect("r1", ranks=2)
    waits.notified("r1")
    assert not event.is_set()
    waits.notified("r1")
    await asyncio.wait_for(event.wait(), 1)
    # a notification that arrives before the wait is registered still counts
    waits.notified("r2")
    assert waits.expect("r2", ranks=1).is_set()
    for i in range(20):  # stale ids of timed-out requests never accumulate
        waits.notified(f"stale-{i}")
    assert len(waits._counts) <= 4
