"""LMCache 0.5.6 controller wire protocol, re-declared so no kvpool component imports LMCache.

Why: stock LMCache workers (``lmcache/v1/cache_controller/message.py``) send msgspec tagged
structs over msgpack. To stay wire-compatible without pulling LMCache (and torch) into the
controller image, every message is declared here with the same tag (the class name, in the
``type`` field), the same field names, order and defaults. Two components speak it: the
controller (the server side) and the simulated engine (``kvpool.worker.sim``, the worker side,
which must be indistinguishable from a real LMCache worker), so it lives in kvpool.protocol.
Unknown fields are ignored (msgspec's default) so a newer worker still decodes. The frames
are decoded and encoded by :mod:`kvpool.protocol.lmcache_codec`.

The compatibility test ``protocol/tests/unit/test_lmcache_wire_compat.py`` round-trips every
struct through LMCache's own ``Msg`` union in both directions.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class _Msg(msgspec.Struct, frozen=True, tag_field="type"):
    """Base of every tagged message; the tag is given explicitly on each subclass."""


# ---------------------------------------------------------------- heartbeat commands


class HeartbeatCommand(msgspec.Struct, frozen=True, tag_field="command_type", tag=True):
    """A command the controller piggy-backs on a heartbeat reply (LMCache ``commands.base``)."""

    reason: str | None = None
    args: dict[str, Any] | None = None


class FullSyncCommand(HeartbeatCommand, frozen=True, tag="full_sync"):
    """Ask the worker to resend every key it holds (after a controller restart)."""


AnyCommand = FullSyncCommand | HeartbeatCommand


# ---------------------------------------------------------------- worker -> controller (push)


class OpType(enum.Enum):
    ADMIT = "admit"
    EVICT = "evict"


class KVOpEvent(msgspec.Struct, frozen=True):
    """One admit or evict inside a batch (untagged, as in LMCache)."""

    op_type: OpType
    key: int
    seq_num: int


class RegisterMsg(_Msg, frozen=True, tag="RegisterMsg"):
    instance_id: str
    worker_id: int
    ip: str
    port: int
    peer_init_url: str | None


class DeRegisterMsg(_Msg, frozen=True, tag="DeRegisterMsg"):
    instance_id: str
    worker_id: int
    ip: str
    port: int


class KVAdmitMsg(_Msg, frozen=True, tag="KVAdmitMsg"):
    instance_id: str
    worker_id: int
    key: int
    location: str
    seq_num: int = 0


class KVEvictMsg(_Msg, frozen=True, tag="KVEvictMsg"):
    instance_id: str
    worker_id: int
    key: int
    location: str
    seq_num: int = 0


class BatchedKVOperationMsg(_Msg, frozen=True, tag="BatchedKVOperationMsg"):
    instance_id: str
    worker_id: int
    location: str
    operations: list[KVOpEvent]


class FullSyncBatchMsg(_Msg, frozen=True, tag="FullSyncBatchMsg"):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    batch_id: int
    keys: list[int]


class FullSyncEndMsg(_Msg, frozen=True, tag="FullSyncEndMsg"):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    actual_total_keys: int


# ---------------------------------------------------------------- worker -> controller (req)


class HeartbeatMsg(_Msg, frozen=True, tag="HeartbeatMsg"):
    instance_id: str
    worker_id: int
    ip: str
    port: int
    peer_init_url: str | None


class BatchedP2PLookupMsg(_Msg, frozen=True, tag="BatchedP2PLookupMsg"):
    hashes: list[int]
    instance_id: str
    worker_id: int


class FullSyncStartMsg(_Msg, frozen=True, tag="FullSyncStartMsg"):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    total_keys: int
    batch_count: int


class FullSyncStatusMsg(_Msg, frozen=True, tag="FullSyncStatusMsg"):
    instance_id: str
    worker_id: int
    sync_id: str


# ---------------------------------------------------------------- controller -> worker (replies)


class RegisterRetMsg(_Msg, frozen=True, tag="RegisterRetMsg"):
    extra_config: dict[str, str] = msgspec.field(default_factory=dict)


class HeartbeatRetMsg(_Msg, frozen=True, tag="HeartbeatRetMsg"):
    commands: list[AnyCommand] = msgspec.field(default_factory=list)


class BatchedP2PLookupRetMsg(_Msg, frozen=True, tag="BatchedP2PLookupRetMsg"):
    # (instance_id, location, num_hit_chunks, peer_init_url)
    layout_info: list[tuple[str, str, int, str]]


class FullSyncStartRetMsg(_Msg, frozen=True, tag="FullSyncStartRetMsg"):
    sync_id: str
    accepted: bool
    error_msg: str | None = None


class FullSyncStatusRetMsg(_Msg, frozen=True, tag="FullSyncStatusRetMsg"):
    sync_id: str
    is_complete: bool
    global_progress: float
    can_exit_freeze: bool
    missing_batches: list[int] = msgspec.field(default_factory=list)


class ErrorMsg(_Msg, frozen=True, tag="ErrorMsg"):
    error: str


# ---------------------------------------------------------------- controller -> worker (control)


class ClearWorkerMsg(_Msg, frozen=True, tag="ClearWorkerMsg"):
    worker_event_id: str
    location: str


class PinWorkerMsg(_Msg, frozen=True, tag="PinWorkerMsg"):
    worker_event_id: str
    location: str
    tokens: list[int]


class CompressWorkerMsg(_Msg, frozen=True, tag="CompressWorkerMsg"):
    worker_event_id: str
    method: str
    location: str
    tokens: list[int] | None = None


class DecompressWorkerMsg(_Msg, frozen=True, tag="DecompressWorkerMsg"):
    worker_event_id: str
    method: str
    location: str
    tokens: list[int] | None = None


class MoveWorkerMsg(_Msg, frozen=True, tag="MoveWorkerMsg"):
    worker_event_id: str
    old_position: str
    new_position: tuple[str, str]
    tokens: list[int] | None = None
    copy: bool | None = True


class HealthWorkerMsg(_Msg, frozen=True, tag="HealthWorkerMsg"):
    worker_event_id: str


class CheckFinishWorkerMsg(_Msg, frozen=True, tag="CheckFinishWorkerMsg"):
    worker_event_id: str


class ClearWorkerRetMsg(_Msg, frozen=True, tag="ClearWorkerRetMsg"):
    num_tokens: int


class PinWorkerRetMsg(_Msg, frozen=True, tag="PinWorkerRetMsg"):
    num_tokens: int


class CompressWorkerRetMsg(_Msg, frozen=True, tag="CompressWorkerRetMsg"):
    num_tokens: int


class DecompressWorkerRetMsg(_Msg, frozen=True, tag="DecompressWorkerRetMsg"):
    num_tokens: int


class MoveWorkerRetMsg(_Msg, frozen=True, tag="MoveWorkerRetMsg"):
    num_tokens: int


class HealthWorkerRetMsg(_Msg, frozen=True, tag="HealthWorkerRetMsg"):
    error_code: int


class CheckFinishWorkerRetMsg(_Msg, frozen=True, tag="CheckFinishWorkerRetMsg"):
    status: str


# ---------------------------------------------------------------- orchestrator <-> controller


class WorkerInfo(msgspec.Struct, frozen=True):
    """Registration facts about one worker (a dataclass in LMCache, a map on the wire)."""

    instance_id: str
    worker_id: int
    ip: str
    port: int
    peer_init_url: str | None
    registration_time: float
    last_heartbeat_time: float


class QueryInstMsg(_Msg, frozen=True, tag="QueryInstMsg"):
    event_id: str
    ip: str


class LookupMsg(_Msg, frozen=True, tag="LookupMsg"):
    event_id: str
    tokens: list[int]


class ClearMsg(_Msg, frozen=True, tag="ClearMsg"):
    event_id: str
    instance_id: str
    location: str


class PinMsg(_Msg, frozen=True, tag="PinMsg"):
    event_id: str
    instance_id: str
    location: str
    tokens: list[int]


class CompressMsg(_Msg, frozen=True, tag="CompressMsg"):
    event_id: str
    instance_id: str
    method: str
    location: str
    tokens: list[int] | None = None


class DecompressMsg(_Msg, frozen=True, tag="DecompressMsg"):
    event_id: str
    instance_id: str
    method: str
    location: str
    tokens: list[int] | None = None


class MoveMsg(_Msg, frozen=True, tag="MoveMsg"):
    event_id: str
    old_position: tuple[str, str]
    new_position: tuple[str, str]
    tokens: list[int] | None = None
    copy: bool | None = False


class HealthMsg(_Msg, frozen=True, tag="HealthMsg"):
    event_id: str
    instance_id: str


class CheckFinishMsg(_Msg, frozen=True, tag="CheckFinishMsg"):
    event_id: str


class QueryWorkerInfoMsg(_Msg, frozen=True, tag="QueryWorkerInfoMsg"):
    event_id: str
    instance_id: str
    worker_ids: list[int] | None


class QueryInstRetMsg(_Msg, frozen=True, tag="QueryInstRetMsg"):
    event_id: str
    instance_id: str | None


class LookupRetMsg(_Msg, frozen=True, tag="LookupRetMsg"):
    event_id: str
    layout_info: dict[str, tuple[str, int]]


class ClearRetMsg(_Msg, frozen=True, tag="ClearRetMsg"):
    event_id: str
    num_tokens: int


class PinRetMsg(_Msg, frozen=True, tag="PinRetMsg"):
    event_id: str
    num_tokens: int


class CompressRetMsg(_Msg, frozen=True, tag="CompressRetMsg"):
    event_id: str
    num_tokens: int


class DecompressRetMsg(_Msg, frozen=True, tag="DecompressRetMsg"):
    event_id: str
    num_tokens: int


class MoveRetMsg(_Msg, frozen=True, tag="MoveRetMsg"):
    event_id: str
    num_tokens: int


class HealthRetMsg(_Msg, frozen=True, tag="HealthRetMsg"):
    event_id: str
    error_codes: dict[int, int]


class CheckFinishRetMsg(_Msg, frozen=True, tag="CheckFinishRetMsg"):
    status: str


class QueryWorkerInfoRetMsg(_Msg, frozen=True, tag="QueryWorkerInfoRetMsg"):
    event_id: str
    worker_infos: list[WorkerInfo]


# ---------------------------------------------------------------- unions

WORKER_PUSH = (
    RegisterMsg,
    DeRegisterMsg,
    KVAdmitMsg,
    KVEvictMsg,
    BatchedKVOperationMsg,
    FullSyncBatchMsg,
    FullSyncEndMsg,
)
WORKER_REQUESTS = (
    RegisterMsg,
    HeartbeatMsg,
    BatchedP2PLookupMsg,
    FullSyncStartMsg,
    FullSyncStatusMsg,
)
ORCH_REQUESTS = (
    QueryInstMsg,
    LookupMsg,
    ClearMsg,
    PinMsg,
    CompressMsg,
    DecompressMsg,
    MoveMsg,
    HealthMsg,
    CheckFinishMsg,
    QueryWorkerInfoMsg,
)

Msg = (
    RegisterMsg
    | RegisterRetMsg
    | DeRegisterMsg
    | KVAdmitMsg
    | KVEvictMsg
    | BatchedKVOperationMsg
    | ClearWorkerMsg
    | ClearWorkerRetMsg
    | PinWorkerMsg
    | PinWorkerRetMsg
    | CompressWorkerMsg
    | CompressWorkerRetMsg
    | DecompressWorkerMsg
    | DecompressWorkerRetMsg
    | MoveWorkerMsg
    | MoveWorkerRetMsg
    | HealthWorkerMsg
    | HealthWorkerRetMsg
    | CheckFinishWorkerMsg
    | CheckFinishWorkerRetMsg
    | LookupMsg
    | LookupRetMsg
    | ClearMsg
    | ClearRetMsg
    | PinMsg
    | PinRetMsg
    | CompressMsg
    | CompressRetMsg
    | DecompressMsg
    | DecompressRetMsg
    | MoveMsg
    | MoveRetMsg
    | HealthMsg
    | HealthRetMsg
    | CheckFinishMsg
    | CheckFinishRetMsg
    | ErrorMsg
    | QueryInstMsg
    | QueryInstRetMsg
    | HeartbeatMsg
    | HeartbeatRetMsg
    | BatchedP2PLookupMsg
    | BatchedP2PLookupRetMsg
    | QueryWorkerInfoMsg
    | QueryWorkerInfoRetMsg
    | FullSyncStartMsg
    | FullSyncStartRetMsg
    | FullSyncBatchMsg
    | FullSyncEndMsg
    | FullSyncStatusMsg
    | FullSyncStatusRetMsg
)
