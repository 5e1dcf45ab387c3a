"""The HTTP strings and shapes the gateway, the workers, the controller and the operator's local
runner agree on: kvpool's request and response headers, session ids and their bound, OpenAI's
error body and how a validation failure reads in it, the controller's ``/v1/prefix_lookup``
request and reply, its ``/v1/stats`` reply (the operator's live status figures), and who may
change it: the API token's env var, Secret key and header, and the allowlist of instance ids.

Why this module exists: each of these was typed in two to four components. A header spelled
one way by the gateway and another by the worker, or a session id cut at a different length
by each, fails nowhere loudly: sessions stop matching and a pinned request is routed as any
other. Defined here once; pure (no HTTP library: each component installs its own handlers
around :func:`error_body` and :func:`validation_error`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

# ---------------------------------------------------------------- headers

#: Request: the client's session (wins over the OpenAI body's ``user``).
SESSION: Final = "x-session-id"
#: Request: pin to this instance. Response: the instance (PD: ``prefill,decode``) that served.
INSTANCE: Final = "x-kvpool-instance"
#: Request: send through this PD pair (a pair name, or :data:`PD_ANY`).
PD: Final = "x-kvpool-pd"
PD_ANY: Final = "any"
#: Response: why the router chose the instance (``kv-hit``, ``pinned``, ``pd``, ...).
ROUTE_REASON: Final = "x-kvpool-route-reason"
#: Response: prompt tokens the router expected cached on the instance.
PREDICTED_HIT_TOKENS: Final = "x-kvpool-predicted-hit-tokens"
#: Request and response: the request's id (the client's, when it sends a plain token; else the
#: gateway's), the key of ``GET /v1/requests/{id}/explain``; forwarded to the instance.
REQUEST_ID: Final = "x-request-id"

# ---------------------------------------------------------------- sessions

#: Longest session id kept (``x-session-id``, the body's ``user``, the memory API's
#: ``session_id``); a longer header is cut to it, a longer body field refused.
MAX_SESSION_ID: Final = 256


def session_of(header: str | None, user: str | None) -> str | None:
    """The request's session: ``x-session-id`` wins over the body's ``user``; an empty value
    means none; cut to :data:`MAX_SESSION_ID` characters."""
    for value in (header, user):
        if value:
            return value[:MAX_SESSION_ID]
    return None


# ---------------------------------------------------------------- OpenAI errors


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _type_tag(part: object) -> bool:
    """A union member's name in a validation error's location (``prompt.str``), not a field."""
    text = str(part)
    return text in _TYPE_TAGS or "[" in text or "-" in text


def validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None, str]:
    """``(message, param, code)`` of a 400 for pydantic's ``errors()`` of a request body: the
    first problem, named by its field (``body`` and union member names left out), and how
    many more there are."""
    first: Mapping[str, Any] = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = str((first.get("ctx") or {}).get("error", "")).strip()
        return (
            f"the request body is not valid JSON{': ' + detail if detail else ''}",
            None,
            ("invalid_json"),
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _type_tag(p)]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        msg = "the request body must be a JSON object"
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}{msg}{more}", param, "invalid_value"


# ---------------------------------------------------------------- controller prefix lookup

#: The controller's route for the gateway's lookups (the gateway's fallback while its index
#: replica is out of sync).
PREFIX_LOOKUP_PATH: Final = "/v1/prefix_lookup"
#: Why a request is refused unless it names exactly one of them.
PREFIX_LOOKUP_ONE_OF: Final = "give exactly one of 'hashes' (chunk hashes) or 'tokens' (token ids)"


def prefix_lookup_request(hashes: Sequence[int]) -> dict[str, Any]:
    """The request body for chained chunk hashes (the gateway's form)."""
    return {"hashes": list(hashes)}


def prefix_lookup_entry(
    hit_chunks: int, per_location: Mapping[str, int], workers: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One instance's part of the reply: leading chunks held, per LMCache location how many
    of them, and its workers (``worker_id``, ``url``, ``peer_init_url``,
    ``holds_first_chunk``)."""
    return {
        "hit_chunks": hit_chunks,
        "per_location": dict(per_location),
        "workers": [dict(w) for w in workers],
    }


def prefix_lookup_reply(chunks: int, instances: Mapping[str, Any]) -> dict[str, Any]:
    """The reply: how many chunks were asked about, and per instance id its entry."""
    return {"chunks": chunks, "instances": dict(instances)}


def prefix_lookup_hits(reply: Mapping[str, Any]) -> Iterator[tuple[str, int, dict[str, int]]]:
    """``(instance id, hit chunks, per-location counts)`` of every instance in a reply."""
    instances = reply.get("instances") or {}
    for instance_id, entry in instances.items():
        per_location = entry.get("per_location") or {}
        yield (
            str(instance_id),
            int(entry.get("hit_chunks", 0)),
            {str(k): int(v) for k, v in per_location.items()},
        )


# ---------------------------------------------------------------- the controller's figures

#: The controller's route for what it knows of its domain now (read by the operator for the
#: live figures in KVCachePool status).
STATS_PATH: Final = "/v1/stats"
#: At most this many refused instance ids in a stats reply (the latest first refused).
STATS_REFUSED_MAX: Final = 20


def stats_reply(
    workers: Mapping[str, int],
    chunks: int,
    chunk_locations: Mapping[str, int],
    refusals: Mapping[str, int],
    refused: Mapping[str, str],
) -> dict[str, Any]:
    """The reply: registered workers (TP ranks) per instance id, distinct chunks indexed,
    (chunk, worker) entries per LMCache location, registrations refused by reason (counts
    since the controller started) and the refused instance ids with their reason (the last
    :data:`STATS_REFUSED_MAX` first refused)."""
    last = list(refused.items())[-STATS_REFUSED_MAX:]
    return {
        "instances": dict(sorted(workers.items())),
        "chunks": chunks,
        "chunk_locations": dict(sorted(chunk_locations.items())),
        "refusals": dict(sorted(refusals.items())),
        "refused": dict(last),
    }


# ---------------------------------------------------------------- the controller's access rules

#: Env var carrying a domain's controller API token (from the Secret the operator renders)
#: into the controller; its mutating HTTP routes want it as ``Authorization: Bearer <token>``.
CONTROLLER_TOKEN_ENV: Final = "KVPOOL_CONTROLLER_API_TOKEN"
#: The key of that token in the Secret.
CONTROLLER_TOKEN_KEY: Final = "token"
#: The request header the token travels in.
AUTHORIZATION: Final = "authorization"
#: The controller's route for the instance ids that may register: ``PUT`` (token) replaces the
#: list, ``GET`` reads it. The operator sends every id it renders for the domain before it
#: creates the pods that carry them; the same body is the controller's ``--instances-file``.
INSTANCES_PATH: Final = "/v1/instances"
INSTANCE_IDS: Final = "instance_ids"


def bearer(token: str) -> dict[str, str]:
    """The header that authorizes a call of a mutating controller route."""
    return {AUTHORIZATION: f"Bearer {token}"}


def instances_body(ids: Sequence[str]) -> dict[str, Any]:
    """The allowlist as the operator sends (and renders) it: the ids, sorted, once each."""
    return {INSTANCE_IDS: sorted(set(ids))}


def instances_of(body: Any) -> list[str]:
    """The ids of an allowlist body; ValueError naming the field and the expected shape."""
    ids = body.get(INSTANCE_IDS) if isinstance(body, Mapping) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise ValueError(
            f"{INSTANCE_IDS!r} must be a list of instance ids (non-empty strings), as in "
            f'{{"{INSTANCE_IDS}": ["demo-p2p-0~4683d6be7c28"]}}'
        )
    return list(ids)
