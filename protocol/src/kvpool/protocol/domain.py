"""The cache-domain contract's values (DESIGN.md rules 1 and 9), defined once.

Why this module exists: the operator renders these values, the worker checks them before it
starts, and the controller checks them on every registration. Two processes share KV only if
they hash tokens identically, which depends on the seed, chunk size, hash algorithm, model, KV
dtype and block size; the *fingerprint* condenses those into 12 hex characters that travel in
the ``KVPOOL_DOMAIN_FINGERPRINT`` environment variable and as the suffix of every LMCache
instance id (``<name>~<fingerprint>``). If the operator and a worker computed it differently,
every worker would be refused (or, worse, a foreign one accepted), so there is one function.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

#: Hex characters of sha256 kept in a fingerprint.
FINGERPRINT_LEN: Final = 12
#: Separates an instance's name from its domain fingerprint in ``lmcache_instance_id``.
INSTANCE_ID_SEPARATOR: Final = "~"
#: The environment variable carrying the fingerprint into every process of a domain.
FINGERPRINT_ENV: Final = "KVPOOL_DOMAIN_FINGERPRINT"
#: ``PYTHONHASHSEED`` accepts 0..4294967295 (Python refuses anything larger at start-up).
MAX_HASH_SEED: Final = 4294967295

#: The controller replica holding the domain's Lease labels its own pod with this label, value
#: ``leader`` (the others ``standby``); the operator renders the controller Service selecting
#: it, so workers and gateways reach the leader only.
CONTROLLER_ROLE_LABEL: Final = "kvpool.io/controller-role"
CONTROLLER_LEADER: Final = "leader"
CONTROLLER_STANDBY: Final = "standby"

#: Rule 9: exactly these values in every worker process (``false`` lowercase: LMCache compares
#: the string, and anything else lets it phone home).
REQUIRED_WORKER_ENV: Final = MappingProxyType(
    {
        "LMCACHE_TRACK_USAGE": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
)

#: vLLM flags ``kvpool-worker`` derives from the cache domain and the rendered config (and
#: ``--kv-events-config``, whose ports the operator allocates per instance): passing one again in
#: an engine's extra args would fork the domain's facts, so the worker refuses them at start and
#: the operator refuses them in ``engine.args`` at admission.
WORKER_VLLM_FLAGS: Final = (
    "--model",
    "--kv-transfer-config",
    "--kv-events-config",
    "--block-size",
    "--dtype",
    "--kv-cache-dtype",
    "--served-model-name",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "--max-model-len",
)

#: KV dtypes kvpool's CPU reference engine can hold (the operator refuses others on platform cpu).
REFERENCE_ENGINE_KV_DTYPES: Final = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ControllerPorts:
    """The controller's default ports (LMCache's controller flags, plus kvpool's index stream).

    ``http``: the HTTP API (``--port``); ``pull``, ``reply``, ``heartbeat``: LMCache's
    ``--monitor-ports``; ``pub``: the index delta PUB stream; ``snapshot``: the ROUTER that
    answers index snapshots (see :mod:`kvpool.protocol.deltas`).
    """

    http: int = 9000
    pull: int = 8300
    reply: int = 8400
    heartbeat: int = 8500
    pub: int = 8600
    snapshot: int = 8700


DEFAULT_CONTROLLER_PORTS: Final = ControllerPorts()


@dataclass(frozen=True)
class DomainFacts:
    """The inputs of the domain fingerprint."""

    block_size: int
    chunk_size: int
    hash_algorithm: str
    hash_seed: str
    kv_dtype: str
    model: str

    def canonical_json(self) -> str:
        """Sorted keys, no spaces, ints as ints and strings as strings: the hashed bytes."""
        return json.dumps(
            {
                "block_size": int(self.block_size),
                "chunk_size": int(self.chunk_size),
                "hash_algorithm": str(self.hash_algorithm),
                "hash_seed": str(self.hash_seed),
                "kv_dtype": str(self.kv_dtype),
                "model": str(self.model),
            },
            sort_keys=True,
            separators=(",", ":"),
        )


def domain_fingerprint(facts: DomainFacts) -> str:
    """First :data:`FINGERPRINT_LEN` hex characters of sha256 over the canonical JSON."""
    digest = hashlib.sha256(facts.canonical_json().encode("utf-8")).hexdigest()
    return digest[:FINGERPRINT_LEN]


def instance_id(name: str, fingerprint: str) -> str:
    """The ``lmcache_instance_id`` of instance ``name`` in the domain ``fingerprint``."""
    return f"{name}{INSTANCE_ID_SEPARATOR}{fingerprint}"


def split_instance_id(value: str) -> tuple[str, str | None]:
    """``"name~0123456789ab"`` → ``("name", "0123456789ab")``; no separator → ``(value, None)``.

    The name may itself contain the separator: the fingerprint is what follows the last one.
    """
    name, sep, fingerprint = value.rpartition(INSTANCE_ID_SEPARATOR)
    if not sep:
        return value, None
    return name, fingerprint


def is_valid_hash_seed(seed: str) -> bool:
    """Whether ``seed`` is a ``PYTHONHASHSEED`` Python accepts (decimal, 0..MAX_HASH_SEED)."""
    return seed.isascii() and seed.isdigit() and int(seed) <= MAX_HASH_SEED
