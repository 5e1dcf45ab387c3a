"""Orchestration requests (LMCache ``OrchMsg``): query, lookup, and fan-out control to workers.

Why its own module: these are the operations an operator or script asks for (clear an
instance's tier, pin tokens, compress, move KV between instances, health) and they reach out to
the workers' reply sockets. They answer with LMCache's reply structs, or an ``ErrorMsg`` that
names the worker and the failure — never an ``assert`` (LMCache's executor asserts that every
TP rank reports the same count; here a disagreement is an error message).

Every operation is one row of :data:`OPERATIONS`: the message it answers, the coroutine that
answers it, and its HTTP face (LMCache's path, request body, how the body becomes the message
and how the reply becomes the JSON answer). The ZMQ dispatch (:func:`handle_orchestration`) and
the HTTP routes (:mod:`kvpool.controller.routes_lmcache`) both read that table, so an operation
is declared once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kvpool.controller.control import ControlError
from kvpool.controller.service import ControllerService
from kvpool.protocol import lmcache_wire as p

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- LMCache's HTTP request bodies


class QueryInstRequest(BaseModel):
    event_id: str = ""
    ip: str


class LookupRequest(BaseModel):
    tokens: list[int]


class ClearRequest(BaseModel):
    instance_id: str
    location: str


class PinRequest(BaseModel):
    instance_id: str
    location: str
    tokens: list[int]


class CompressRequest(BaseModel):
    instance_id: str
    method: str
    location: str
    tokens: list[int] | None = []


class MoveRequest(BaseModel):
    old_position: tuple[str, str]
    new_position: tuple[str, str]
    tokens: list[int] | None = []
    should_copy: bool | None = False


class HealthRequest(BaseModel):
    instance_id: str


class CheckFinishRequest(BaseModel):
    event_id: str


class QueryWorkerInfoRequest(BaseModel):
    instance_id: str
    worker_ids: list[int] | None = None


# ---------------------------------------------------------------- how each operation runs

Run = Callable[[ControllerService, Any], Awaitable[Any]]


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


def _fan_out_op(
    what: str, make: Callable[[Any, int], Any], reply: Callable[[str, int], Any]
) -> Run:
    """An operation sent to every TP rank of ``msg.instance_id``; the ranks must agree."""

    async def run(svc: ControllerService, msg: Any) -> Any:
        results = await _fan_out(svc, msg.instance_id, lambda w: make(msg, w))
        return reply(msg.event_id, _agree(results, what, msg.instance_id))

    return run


def _local(answer: Callable[[ControllerService, Any], Any]) -> Run:
    """An operation the controller answers from its own state."""

    async def run(svc: ControllerService, msg: Any) -> Any:
        return answer(svc, msg)

    return run


def _lookup(svc: ControllerService, msg: p.LookupMsg) -> Any:
    if svc.settings.tokens_lookup_error is not None:
        return p.ErrorMsg(svc.settings.tokens_lookup_error)
    return p.LookupRetMsg(msg.event_id, svc.lookup_tokens(msg.tokens))


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


def _new_id(prefix: str) -> str:
    return prefix + str(uuid.uuid4())


def _tokens_done(r: Any) -> dict[str, Any]:
    return {"event_id": r.event_id, "num_tokens": r.num_tokens}


def _worker_infos(r: p.QueryWorkerInfoRetMsg) -> dict[str, Any]:
    infos = [{f: getattr(w, f) for f in w.__struct_fields__} for w in r.worker_infos]
    return {"event_id": r.event_id, "worker_infos": infos}


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Operation:
    """One orchestration request, end to end: ``msg`` is answered by ``run``; over HTTP,
    ``POST path`` with a ``body`` becomes ``build(body)``, and a ``reply`` struct becomes
    ``answer(reply)``; ``tokens`` operations are refused while the domain cannot hash tokens;
    ``mutates``: it changes what workers hold (clear, pin, compress, decompress, move), so its
    route needs the API token and, with a token configured, ZMQ may not ask for it."""

    msg: type
    run: Run
    path: str
    body: type[BaseModel]
    build: Callable[[Any], Any]
    reply: type
    answer: Callable[[Any], dict[str, Any]]
    tokens: bool = False
    mutates: bool = False


def _codec_operation(name: str, msg: type, worker_msg: type, reply: type) -> Operation:
    """``/compress`` and ``/decompress``: the same shape, LMCache's class names differ."""
    title = name.capitalize()
    return Operation(
        msg,
        _fan_out_op(
            name,
            lambda m, w: worker_msg(
                f"{title}Worker{w}{uuid.uuid4()}", m.method, m.location, m.tokens
            ),
            reply,
        ),
        f"/{name}",
        CompressRequest,
        lambda b: msg(_new_id(title), b.instance_id, b.method, b.location, b.tokens),
        reply,
        _tokens_done,
        mutates=True,
    )


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        p.QueryInstMsg,
        _local(lambda svc, m: p.QueryInstRetMsg(m.event_id, svc.registry.instance_by_ip(m.ip))),
        "/query_instance",
        QueryInstRequest,
        lambda b: p.QueryInstMsg(_new_id("QueryInst"), b.ip),
        p.QueryInstRetMsg,
        lambda r: {"event_id": r.event_id, "res": r.instance_id},
    ),
    Operation(
        p.LookupMsg,
        _local(_lookup),
        "/lookup",
        LookupRequest,
        lambda b: p.LookupMsg(_new_id("Lookup"), b.tokens),
        p.LookupRetMsg,
        lambda r: {"event_id": r.event_id, "layout_info": r.layout_info},
        tokens=True,
    ),
    Operation(
        p.ClearMsg,
        _fan_out_op(
            "clear",
            lambda m, w: p.ClearWorkerMsg(f"Worker{w}{m.event_id}", m.location),
            p.ClearRetMsg,
        ),
        "/clear",
        ClearRequest,
        lambda b: p.ClearMsg(_new_id("Clear"), b.instance_id, b.location),
        p.ClearRetMsg,
        _tokens_done,
        mutates=True,
    ),
    Operation(
        p.PinMsg,
        _fan_out_op(
            "pin",
            lambda m, w: p.PinWorkerMsg(f"Worker{w}{m.event_id}", m.location, m.tokens),
            p.PinRetMsg,
        ),
        "/pin",
        PinRequest,
        lambda b: p.PinMsg(_new_id("Pin"), b.instance_id, b.location, b.tokens),
        p.PinRetMsg,
        _tokens_done,
        mutates=True,
    ),
    _codec_operation("compress", p.CompressMsg, p.CompressWorkerMsg, p.CompressRetMsg),
    _codec_operation("decompress", p.DecompressMsg, p.DecompressWorkerMsg, p.DecompressRetMsg),
    Operation(
        p.MoveMsg,
        _move,
        "/move",
        MoveRequest,
        lambda b: p.MoveMsg(
            _new_id("Move"), b.old_position, b.new_position, b.tokens, b.should_copy
        ),
        p.MoveRetMsg,
        _tokens_done,
        mutates=True,
    ),
    Operation(
        p.HealthMsg,
        _health,
        "/health",
        HealthRequest,
        lambda b: p.HealthMsg(_new_id("health"), b.instance_id),
        p.HealthRetMsg,
        lambda r: {"event_id": r.event_id, "error_codes": r.error_codes},
    ),
    Operation(
        p.CheckFinishMsg,
        _local(lambda svc, m: p.CheckFinishRetMsg(svc.event_status(m.event_id))),
        "/check_finish",
        CheckFinishRequest,
        lambda b: p.CheckFinishMsg(b.event_id),
        p.CheckFinishRetMsg,
        lambda r: {"status": r.status},
    ),
    Operation(
        p.QueryWorkerInfoMsg,
        _local(
            lambda svc, m: p.QueryWorkerInfoRetMsg(
                m.event_id, svc.query_worker_info(m.instance_id, m.worker_ids)
            )
        ),
        "/query_worker_info",
        QueryWorkerInfoRequest,
        lambda b: p.QueryWorkerInfoMsg(_new_id("QueryWorkerInfo"), b.instance_id, b.worker_ids),
        p.QueryWorkerInfoRetMsg,
        _worker_infos,
    ),
)

_BY_MSG: dict[type, Operation] = {op.msg: op for op in OPERATIONS}


async def handle_zmq_orchestration(svc: ControllerService, msg: Any) -> Any:
    """An orchestration message that came over ZMQ (no token there): with an API token
    configured, a mutating one is refused (it would bypass the HTTP routes' token)."""
    op = _BY_MSG.get(type(msg))
    if op is not None and op.mutates and svc.settings.api_token is not None:
        name = type(msg).__name__
        svc.metrics.messages[name] += 1
        svc.bad("unauthorized_orchestration", f"{name} over ZMQ (no token there)")
        return p.ErrorMsg(
            f"{name} over ZMQ is refused: this controller requires its API token; use POST "
            f"{op.path} with 'Authorization: Bearer <token>'"
        )
    return await handle_orchestration(svc, msg)


async def handle_orchestration(svc: ControllerService, msg: Any) -> Any:
    """Answer one orchestration message; failures become ``ErrorMsg`` with a clear text."""
    svc.metrics.messages[type(msg).__name__] += 1
    event_id = getattr(msg, "event_id", None)
    try:
        op = _BY_MSG.get(type(msg))
        if op is None:
            raise ControlError(f"{type(msg).__name__} is not an orchestration request")
        reply = await op.run(svc, msg)
    except ControlError as exc:
        logger.warning("%s failed: %s", type(msg).__name__, exc)
        if event_id:
            svc.record_event(event_id, "failed")
        return p.ErrorMsg(str(exc))
    if event_id and not isinstance(msg, p.CheckFinishMsg):
        svc.record_event(event_id, "finished")
    return reply
