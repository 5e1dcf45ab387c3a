"""Orchestration requests (LMCache ``OrchMsg``): query, lookup, and fan-out control to workers.

Why its own module: these are the operations an operator or script asks for (clear an
instance's tier, pin tokens, compress, move KV between instances, health) and they reach out to
the workers' reply sockets. They answer with LMCache's reply structs, or an ``ErrorMsg`` that
names the worker and the failure — never an ``assert`` (LMCache's executor asserts that every
TP rank reports the same count; here a disagreement is an error message).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.controller.control import ControlError
from kvpool.controller.service import ControllerService
from kvpool.protocol import lmcache_wire as p

logger = logging.getLogger(__name__)


def _agree(results: list[Any], what: str, instance_id: str) -> int:
    counts = []
    for result in results:
        if isinstance(result, p.ErrorMsg):
            raise ControlError(f"{what} on {instance_id}: worker error: {result.error}")
        count = getattr(result, "num_tokens", None)
        if not isinstance(count, int):
            raise ControlError(f"{what} on {instance_id}: unexpected reply {type(result).__name__}")
        counts.append(count)
    if len(set(counts)) != 1:
        raise ControlError(f"{what} on {instance_id}: TP ranks disagree on token counts {counts}")
    return counts[0]


async def _fan_out(
    svc: ControllerService, instance_id: str, make: Callable[[int], Any]
) -> list[Any]:
    if svc.control is None:
        raise ControlError("this controller has no control plane")
    return await svc.control.fan_out(instance_id, svc.registry.worker_ids(instance_id), make)


async def handle_orchestration(svc: ControllerService, msg: Any) -> Any:
    """Answer one orchestration message; failures become ``ErrorMsg`` with a clear text."""
    svc.metrics.messages[type(msg).__name__] += 1
    try:
        reply = await _dispatch(svc, msg)
    except ControlError as exc:
        logger.warning("%s failed: %s", type(msg).__name__, exc)
        event_id = getattr(msg, "event_id", None)
        if event_id:
            svc.record_event(event_id, "failed")
        return p.ErrorMsg(str(exc))
    event_id = getattr(msg, "event_id", None)
    if event_id and not isinstance(msg, p.CheckFinishMsg):
        svc.record_event(event_id, "finished")
    return reply


async def _dispatch(svc: ControllerService, msg: Any) -> Any:
    match msg:
        case p.LookupMsg():
            if svc.settings.tokens_lookup_error is not None:
                return p.ErrorMsg(svc.settings.tokens_lookup_error)
            return p.LookupRetMsg(msg.event_id, svc.lookup_tokens(msg.tokens))
        case p.QueryInstMsg():
            return p.QueryInstRetMsg(msg.event_id, svc.registry.instance_by_ip(msg.ip))
        case p.QueryWorkerInfoMsg():
            return p.QueryWorkerInfoRetMsg(
                msg.event_id, svc.query_worker_info(msg.instance_id, msg.worker_ids)
            )
        case p.CheckFinishMsg():
            return p.CheckFinishRetMsg(svc.event_status(msg.event_id))
        case p.ClearMsg():
            results = await _fan_out(
                svc,
                msg.instance_id,
                lambda w: p.ClearWorkerMsg(f"Worker{w}{msg.event_id}", msg.location),
            )
            return p.ClearRetMsg(msg.event_id, _agree(results, "clear", msg.instance_id))
        case p.PinMsg():
            results = await _fan_out(
                svc,
                msg.instance_id,
                lambda w: p.PinWorkerMsg(f"Worker{w}{msg.event_id}", msg.location, msg.tokens),
            )
            return p.PinRetMsg(msg.event_id, _agree(results, "pin", msg.instance_id))
        case p.CompressMsg():
            results = await _fan_out(
                svc,
                msg.instance_id,
                lambda w: p.CompressWorkerMsg(
                    f"CompressWorker{w}{uuid.uuid4()}", msg.method, msg.location, msg.tokens
                ),
            )
            return p.CompressRetMsg(msg.event_id, _agree(results, "compress", msg.instance_id))
        case p.DecompressMsg():
            results = await _fan_out(
                svc,
                msg.instance_id,
                lambda w: p.DecompressWorkerMsg(
                    f"DecompressWorker{w}{uuid.uuid4()}", msg.method, msg.location, msg.tokens
                ),
            )
            return p.DecompressRetMsg(msg.event_id, _agree(results, "decompress", msg.instance_id))
        case p.MoveMsg():
            return await _move(svc, msg)
        case p.HealthMsg():
            return await _health(svc, msg)
        case _:
            raise ControlError(f"{type(msg).__name__} is not an orchestration request")


async def _move(svc: ControllerService, msg: p.MoveMsg) -> p.MoveRetMsg:
    src_instance, src_location = msg.old_position
    dst_instance, dst_location = msg.new_position
    src_workers = svc.registry.worker_ids(src_instance)
    dst_workers = svc.registry.worker_ids(dst_instance)
    if len(src_workers) != len(dst_workers):
        raise ControlError(
            f"move {src_instance} -> {dst_instance}: TP sizes differ "
            f"({len(src_workers)} vs {len(dst_workers)} workers)"
        )
    targets: dict[int, str] = {}
    for src, dst in zip(src_workers, dst_workers, strict=True):
        record = svc.registry.get(dst_instance, dst)
        if record is None or not record.peer_init_url:
            raise ControlError(
                f"move: destination worker {dst_instance}/{dst} has no P2P peer_init_url"
            )
        targets[src] = record.peer_init_url

    def make(worker_id: int) -> p.MoveWorkerMsg:
        return p.MoveWorkerMsg(
            f"MoveWorker{worker_id}{uuid.uuid4()}",
            src_location,
            (targets[worker_id], dst_location),
            msg.tokens,
            msg.copy,
        )

    results = await _fan_out(svc, src_instance, make)
    return p.MoveRetMsg(msg.event_id, _agree(results, "move", src_instance))


async def _health(svc: ControllerService, msg: p.HealthMsg) -> p.HealthRetMsg:
    if svc.control is None:
        raise ControlError("this controller has no control plane")
    worker_ids = svc.registry.worker_ids(msg.instance_id)
    if not worker_ids:
        raise ControlError(f"instance {msg.instance_id!r} has no registered worker")
    control = svc.control

    async def one(worker_id: int) -> int:
        try:
            [result] = await control.fan_out(
                msg.instance_id,
                [worker_id],
                lambda w: p.HealthWorkerMsg(f"HealthWorker{w}{uuid.uuid4()}"),
            )
        except ControlError as exc:
            logger.warning("health of %s/%s: %s", msg.instance_id, worker_id, exc)
            return -1004  # unreachable (LMCache uses -1001..-1003 for the others)
        if isinstance(result, p.HealthWorkerRetMsg):
            return int(result.error_code)
        return -1001 if isinstance(result, p.ErrorMsg) else -1002

    # All TP ranks at once: one hung rank costs the control timeout once, not once per rank.
    results = await asyncio.gather(*(one(w) for w in worker_ids))
    return p.HealthRetMsg(msg.event_id, dict(zip(worker_ids, results, strict=True)))
