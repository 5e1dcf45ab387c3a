"""Prefill/decode disaggregation through LMCache 0.5.6's PD backend, seen from one worker.

Why this module exists: LMCache's PD sender moves a request's KV only when ``store`` is given a
``transfer_spec`` naming the receiver (host, per-rank init and alloc ports, request id): the
vLLM adapter builds it from the request's ``kv_transfer_params["disagg_spec"]`` that the
disaggregation proxy sent. This module turns the worker's :class:`KVTransferParams` into the
object LMCache reads (the attributes of vLLM adapter's ``DisaggSpec``; that module imports
vLLM, which cannot be imported here), and describes the instance's PD role for the proxy
(``GET /pd/info``). It also reads the decoder's unclaimed-transfer TTL (the operator renders
it under ``extra_config``; :mod:`.pd_buffer` applies it). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache.v1.config import LMCacheEngineConfig

from kvpool.protocol.pd import (
    DEFAULT_UNCLAIMED_TTL_SECONDS,
    MAX_UNCLAIMED_TTL_SECONDS,
    MIN_UNCLAIMED_TTL_SECONDS,
    UNCLAIMED_TTL_KEY,
)
from kvpool.worker.engine.offload.config import OffloadConfigError
from kvpool.worker.engine_api import KVTransferParams


@dataclass
class TransferSpec:
    """What LMCache's PD backends read from ``transfer_spec`` (vLLM adapter's DisaggSpec)."""

    req_id: str
    receiver_id: str
    receiver_host: str
    receiver_init_port: list[int]
    receiver_alloc_port: list[int]
    is_last_prefill: bool = True
    num_transferred_tokens: int = 0
    total_chunks: int = 0
    receiver_query_port: list[int] | None = None


# A PD sender stores a prompt in groups of whole chunks of about this many bytes, each its own
# LMCache store with the request's transfer_spec: LMCache writes a group to the receiver (NIXL,
# on its sender loop) while the next group is gathered and sealed here, instead of gathering
# the whole prompt before the first byte moves. The receiver reserves the request's
# total_chunks on the first group and LMCache sends ProxyNotif once, after the last group.
PD_GROUP_BYTES = 8 * 2**20


def store_groups(
    storable: int, chunk_size: int, chunk_bytes: int, group_bytes: int = PD_GROUP_BYTES
) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of the groups of a PD store of ``storable`` tokens:
    whole chunks, about ``group_bytes`` each (at least one chunk), the last ending at
    ``storable``."""
    step = max(1, group_bytes // max(chunk_bytes, 1)) * chunk_size
    return [(start, min(start + step, storable)) for start in range(0, storable, step)]


def transfer_spec(params: KVTransferParams, num_chunks: int, *, last: bool = True) -> TransferSpec:
    """The spec of one store of a prefill of ``num_chunks`` chunks in all; ``last`` on the
    store that completes it (LMCache notifies the proxy after that one)."""
    return TransferSpec(
        req_id=params.req_id,
        receiver_id=params.receiver_host + str(list(params.receiver_init_port)),
        receiver_host=params.receiver_host,
        receiver_init_port=list(params.receiver_init_port),
        receiver_alloc_port=list(params.receiver_alloc_port),
        is_last_prefill=last,
        total_chunks=num_chunks,
    )


def pd_role(config: LMCacheEngineConfig) -> str | None:
    """``sender`` / ``receiver`` / ``both`` when PD is on, else None."""
    return str(config.pd_role) if config.enable_pd and config.pd_role else None


def unclaimed_ttl_s(config: LMCacheEngineConfig) -> float | None:
    """Seconds a PD receiver keeps a transfer nobody retrieved (``extra_config``, else the
    default); None on any other instance. OffloadConfigError names the key and the fix."""
    if pd_role(config) != "receiver":
        return None
    value = (config.extra_config or {}).get(UNCLAIMED_TTL_KEY, DEFAULT_UNCLAIMED_TTL_SECONDS)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not MIN_UNCLAIMED_TTL_SECONDS <= value <= MAX_UNCLAIMED_TTL_SECONDS
    ):
        raise OffloadConfigError(
            f"extra_config.{UNCLAIMED_TTL_KEY} must be a number of seconds from "
            f"{MIN_UNCLAIMED_TTL_SECONDS:g} to {MAX_UNCLAIMED_TTL_SECONDS:g}, got {value!r}: set "
            "it to how long a transferred prompt may wait for its decode (the PDPair's "
            f"spec.transfer.unclaimedTTLSeconds; default {DEFAULT_UNCLAIMED_TTL_SECONDS:g})"
        )
    return float(value)


def pd_info(config: LMCacheEngineConfig | None, tp_size: int = 1) -> dict[str, Any]:
    """This instance's PD facts for the proxy (``GET /pd/info``)."""
    role = None if config is None else pd_role(config)
    if config is None or role is None:
        return {"enabled": False}
    out: dict[str, Any] = {"enabled": True, "role": role, "tp_size": tp_size}
    if role in ("receiver", "both"):
        out.update(
            {
                "receiver_host": config.pd_peer_host,
                "receiver_init_port": list(config.pd_peer_init_port or []),
                "receiver_alloc_port": list(config.pd_peer_alloc_port or []),
            }
        )
    if role in ("sender", "both"):
        out.update({"proxy_host": config.pd_proxy_host, "proxy_port": config.pd_proxy_port})
    return out
