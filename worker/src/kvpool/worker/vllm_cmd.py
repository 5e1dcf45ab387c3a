"""The vLLM(-Ascend) command line a production worker execs, as a pure function.

Why this module exists: the LMCache connector is selected by a JSON ``--kv-transfer-config``
whose connector name depends on the platform (LMCache-Ascend's dynamic connector on NPUs,
``LMCacheConnectorV1`` on GPUs) and whose ``kv_role`` and extra config depend on the PD role
the operator rendered into the LMCache config. Hand-written, these are exactly the mistakes
the seed manual lists (a decoder without ``skip_last_n_tokens``, a sender that discards its
partial chunk). Built here from the rendered config, they are consistent by construction; the
function is unit-tested because vLLM cannot run on this machine. vLLM's KV-event publisher
(``--kv-events-config``, its ports allocated per instance by the operator) reaches vLLM from the
worker's own flag, for the same reason: one place sets it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvpool.protocol.domain import WORKER_VLLM_FLAGS

Platform = Literal["ascend", "cuda"]
AscendConnector = Literal["dynamic", "builtin"]
KvRole = Literal["kv_both", "kv_producer", "kv_consumer"]

ASCEND_DYNAMIC_CONNECTOR = "LMCacheAscendConnectorV1Dynamic"
ASCEND_DYNAMIC_MODULE = "lmcache_ascend.integration.vllm.lmcache_ascend_connector_v1"
ASCEND_BUILTIN_CONNECTOR = "LMCacheAscendConnector"  # vllm-ascend >= 0.17 ships it
CUDA_CONNECTOR = "LMCacheConnectorV1"

# vLLM's --dtype values; any other KV dtype (fp8, fp8_e4m3, ...) goes to --kv-cache-dtype.
MODEL_DTYPES = frozenset({"float16", "bfloat16", "float32", "half", "float", "auto"})
# The domain names KV dtypes as torch does (what LMCache and the fingerprint use); vLLM's
# --kv-cache-dtype spells the 8-bit ones its own way. vLLM's own spellings pass unchanged.
KV_CACHE_DTYPE_OF = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "int8": "int8"}
VLLM_KV_CACHE_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "int8"})


class VllmCommandError(ValueError):
    """The rendered config or the flags cannot make a consistent vLLM command."""


@dataclass(frozen=True)
class VllmLaunch:
    model: str
    platform: Platform
    block_size: int
    kv_dtype: str
    host: str = "0.0.0.0"  # vLLM serves the pod network
    port: int = 8000
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    ascend_connector: AscendConnector = "dynamic"
    lmcache_rpc_port: str | None = None
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON, passed through
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable


def kv_role(config: Mapping[str, Any]) -> KvRole:
    """PD sender → producer, PD receiver → consumer, otherwise both (store and load)."""
    if not config.get("enable_pd"):
        return "kv_both"
    role = config.get("pd_role")
    if role == "sender":
        return "kv_producer"
    if role == "receiver":
        return "kv_consumer"
    raise VllmCommandError(
        f"enable_pd is set but pd_role is {role!r}; the operator renders 'sender' or 'receiver'"
    )


def kv_transfer_config(config: Mapping[str, Any], launch: VllmLaunch) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object for this platform and PD role."""
    role = kv_role(config)
    out: dict[str, Any]
    if launch.platform == "cuda":
        out = {"kv_connector": CUDA_CONNECTOR, "kv_role": role}
    elif launch.ascend_connector == "builtin":
        out = {"kv_connector": ASCEND_BUILTIN_CONNECTOR, "kv_role": role}
    else:
        out = {
            "kv_connector": ASCEND_DYNAMIC_CONNECTOR,
            "kv_role": role,
            "kv_connector_module_path": ASCEND_DYNAMIC_MODULE,
        }
    extra: dict[str, Any] = {}
    if role != "kv_both":
        # PD: the sender keeps its partial last chunk; the decoder recomputes the last token.
        extra["discard_partial_chunks"] = False
    if role == "kv_consumer":
        extra["skip_last_n_tokens"] = 1
    if launch.lmcache_rpc_port:
        extra["lmcache_rpc_port"] = launch.lmcache_rpc_port
    if extra:
        out["kv_connector_extra_config"] = extra
    return out


def _check_extra_args(extra: Sequence[str]) -> None:
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in WORKER_VLLM_FLAGS:
            raise VllmCommandError(
                f"{flag} is set by kvpool-worker from the cache domain; remove it from the "
                "extra vLLM arguments and use the worker's own flag instead"
            )


def kv_events_flags(text: str | None) -> list[str]:
    """``--kv-events-config`` for vLLM: the worker's own flag value, a JSON object (vLLM's
    ``KVEventsConfig``; vLLM checks its fields), compacted."""
    if not text:
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise VllmCommandError(f"--kv-events-config is not JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise VllmCommandError(
            f"--kv-events-config must be a JSON object (vLLM's KVEventsConfig), got {text!r}"
        )
    return ["--kv-events-config", json.dumps(value, separators=(",", ":"))]


def vllm_command(config: Mapping[str, Any], launch: VllmLaunch) -> list[str]:
    """argv for ``os.execvpe``: vLLM's OpenAI server with the LMCache connector."""
    if launch.tensor_parallel_size < 1:
        raise VllmCommandError(
            f"tensor parallel size must be >= 1, got {launch.tensor_parallel_size}"
        )
    _check_extra_args(launch.extra_args)
    argv = [
        launch.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        launch.model,
        "--served-model-name",
        launch.served_model_name or launch.model,
        "--host",
        launch.host,
        "--port",
        str(launch.port),
        "--tensor-parallel-size",
        str(launch.tensor_parallel_size),
        "--block-size",
        str(launch.block_size),
    ]
    argv += dtype_flags(launch.kv_dtype)
    if launch.max_model_len is not None:
        argv += ["--max-model-len", str(launch.max_model_len)]
    transfer = kv_transfer_config(config, launch)
    argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    argv += kv_events_flags(launch.kv_events_config)
    argv += list(launch.extra_args)
    return argv


def dtype_flags(kv_dtype: str) -> list[str]:
    """A 16/32-bit KV dtype is the model's dtype (``--dtype``; the KV cache follows it); an
    8-bit one is vLLM's ``--kv-cache-dtype`` in vLLM's spelling."""
    if kv_dtype in MODEL_DTYPES:
        return ["--dtype", kv_dtype]
    cache = KV_CACHE_DTYPE_OF.get(kv_dtype, kv_dtype)
    if cache not in VLLM_KV_CACHE_DTYPES:
        known = sorted(MODEL_DTYPES | VLLM_KV_CACHE_DTYPES | set(KV_CACHE_DTYPE_OF))
        raise VllmCommandError(
            f"--kv-dtype {kv_dtype!r} is neither a vLLM --dtype nor a --kv-cache-dtype; "
            f"use one of {', '.join(known)}"
        )
    return ["--kv-cache-dtype", cache]
