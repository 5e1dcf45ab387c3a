"""A NIXL peer handshake that ends, and a way to forget a peer that died.

Why this module exists: LMCache 0.5.6's ``NixlChannel.async_lazy_init_peer_connection`` (the
handshake its PD sender runs with a decoder and its P2P backend with a peer) waits for each
answer on a REQ socket with no timeout. Towards a peer that died or froze after it received
the request, the wait never ends: the PD sender's engine step (it blocks on the handshake's
future) and every P2P lookup behind the backend's peer lock stalled for good in the chaos
suite. LMCache also never forgets a peer: after a decoder restart the sender kept writing with
the dead process's NIXL agent (``NIXL_ERR_REMOTE_DISCONNECT`` for every later request).

:func:`install` replaces the channel's handshake (the instance attribute, LMCache's files are
untouched) with the same exchange (``NixlInitRequest``, then ``NixlMemRegRequest``, then the
optional side message, LMCache's wire types) bounded per answer, the temporary socket always
closed without linger; :meth:`Handshakes.forget` drops a peer's transfer descriptors and its
NIXL agent so the next handshake registers the new process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import msgspec
import zmq
from lmcache.v1.transfer_channel.nixl_channel import (
    NixlInitRequest,
    NixlMemRegRequest,
    NixlMsg,
)
from lmcache.v1.transfer_channel.transfer_utils import SideMsg

logger = logging.getLogger(__name__)

#: Seconds one handshake answer may take (metadata and descriptors of a live peer on any
#: network answer in milliseconds; a dead or frozen one never does).
HANDSHAKE_TIMEOUT_S = 5.0


class HandshakeError(RuntimeError):
    """The peer did not complete the NIXL handshake in time (dead, frozen or cut off)."""


class Handshakes:
    """The bounded handshake of one NIXL channel and the NIXL agent of each peer it made."""

    def __init__(self, channel: Any, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.channel = channel
        self.timeout_s = timeout_s
        self._agents: dict[str, str] = {}  # peer id -> its NIXL agent name
        self._lock = threading.Lock()
        self.failures = 0

    async def _recv(self, sock: Any, peer_init_url: str, what: str) -> bytes:
        try:
            return bytes(await asyncio.wait_for(sock.recv(), self.timeout_s))
        except TimeoutError:
            self.failures += 1
            raise HandshakeError(
                f"NIXL peer {peer_init_url} sent no {what} within {self.timeout_s:g}s"
            ) from None

    async def handshake(
        self,
        local_id: str,
        peer_id: str,
        peer_init_url: str,
        init_side_msg: Any = None,
    ) -> Any:
        """``NixlChannel.async_lazy_init_peer_connection``, each answer bounded."""
        ch = self.channel
        agent = ch.nixl_agent
        sock = ch.zmq_context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{peer_init_url}")
            await sock.send(
                msgspec.msgpack.encode(NixlInitRequest(local_meta_bytes=agent.get_agent_metadata()))
            )
            init = msgspec.msgpack.decode(
                await self._recv(sock, peer_init_url, "metadata"), type=NixlMsg
            )
            name = agent.add_remote_agent(init.remote_meta_bytes)
            local_descs = agent.get_serialized_descs(ch.nixl_wrapper.xfer_descs)
            reg = NixlMemRegRequest(
                remote_agent_name=init.remote_agent_name,
                local_id=local_id,
                local_xfer_dlist_bytes=local_descs,
            )
            await sock.send(msgspec.msgpack.encode(reg))
            resp = msgspec.msgpack.decode(
                await self._recv(sock, peer_init_url, "descriptors"), type=NixlMsg
            )
            handle = agent.prep_xfer_dlist(
                name, agent.deserialize_descs(resp.remote_xfer_dlist_bytes)
            )
            self._replace(peer_id, name, handle)
            if init_side_msg is None:
                return None
            await sock.send(msgspec.msgpack.encode(init_side_msg))
            return msgspec.msgpack.decode(
                await self._recv(sock, peer_init_url, "side message"), type=SideMsg
            )
        finally:
            sock.close(linger=0)

    def _replace(self, peer_id: str, name: str, handle: Any) -> None:
        """Register the new process of ``peer_id``, releasing what its previous one left."""
        ch = self.channel
        with self._lock:
            old_handle = ch.remote_xfer_handlers_dict.get(peer_id)
            old_name = self._agents.get(peer_id)
            ch.remote_xfer_handlers_dict[peer_id] = handle
            self._agents[peer_id] = name
        if old_handle is not None and old_handle is not handle:
            _quietly(ch.nixl_agent.release_dlist_handle, old_handle)
        if old_name is not None and old_name != name:
            _quietly(ch.nixl_agent.remove_remote_agent, old_name)

    def forget(self, peer_id: str) -> bool:
        """Drop ``peer_id``'s descriptors and NIXL agent (its process died or was replaced);
        True when there was something to drop. The next transfer has to handshake again."""
        ch = self.channel
        with self._lock:
            handle = ch.remote_xfer_handlers_dict.pop(peer_id, None)
            name = self._agents.pop(peer_id, None)
        if handle is not None:
            _quietly(ch.nixl_agent.release_dlist_handle, handle)
        if name is not None:
            _quietly(ch.nixl_agent.remove_remote_agent, name)
        return handle is not None or name is not None


def _quietly(fn: Any, arg: Any) -> None:
    try:
        fn(arg)
    except Exception as e:  # a peer that is gone may already be unknown to NIXL
        logger.debug("NIXL cleanup %s failed: %s", getattr(fn, "__name__", fn), e)


def install(channel: Any, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Handshakes:
    """Make ``channel`` (a ``NixlChannel`` in async mode) handshake through a bounded
    :class:`Handshakes`; returns it (already installed: the same object)."""
    existing = getattr(channel, "_kvpool_handshakes", None)
    if isinstance(existing, Handshakes):
        return existing
    shakes = Handshakes(channel, timeout_s)
    channel.async_lazy_init_peer_connection = shakes.handshake
    channel._kvpool_handshakes = shakes
    return shakes
