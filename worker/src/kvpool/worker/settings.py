"""Everything ``kvpool-worker serve`` can be told, in one pydantic-settings class.

Why this module exists: a worker is configured by the operator through environment variables
(``KVPOOL_WORKER_*``) and by a person on a laptop through flags; both land here, validated
once, so the rest of the runtime reads typed values. The cache-domain contract (LMCache,
vLLM and hash-seed variables) is deliberately not here: those are checked exactly as the
process received them, by ``kvpool.worker.contract``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvpool.worker.engine_api import ReferenceEngineOptions

_REF = ReferenceEngineOptions()


class WorkerSettings(BaseSettings):
    """Flags override ``KVPOOL_WORKER_<FIELD>`` variables, which override these defaults."""

    model_config = SettingsConfigDict(env_prefix="KVPOOL_WORKER_", extra="ignore")

    engine: Literal["reference", "vllm"] = "reference"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    # Domain facts (part of the fingerprint) and serving limits.
    model: str = _REF.model_name
    model_dir: str | None = None
    block_size: int = Field(default=_REF.block_size, ge=1)
    kv_dtype: str = _REF.dtype
    max_model_len: int = Field(default=_REF.max_model_len, ge=2)
    tokenizer: str | None = None  # tokenizer.json or its directory; None: model_dir or assets

    # Reference engine.
    weights_seed: int = _REF.weights_seed
    num_kv_blocks: int = Field(default=_REF.num_kv_blocks, ge=1)
    max_num_seqs: int = Field(default=_REF.max_num_seqs, ge=1)

    # vLLM(-Ascend). "cpu" is what the operator renders for the reference engine's pods.
    platform: Literal["ascend", "cuda", "cpu"] = "ascend"
    ascend_connector: Literal["dynamic", "builtin"] = "dynamic"
    tensor_parallel_size: int = Field(default=1, ge=1)
    lmcache_rpc_port: str | None = None

    # Sessions for the agent memory API.
    session_capacity: int = Field(default=4096, ge=1)

    # SIGTERM: stop being ready, wait unready_delay_s (endpoints catch up), drain in-flight
    # requests for at most drain_timeout_s, then shut the engine down; the process exits
    # no later than shutdown_deadline_s after the signal, whatever hangs.
    unready_delay_s: float = Field(default=0.0, ge=0)
    drain_timeout_s: float = Field(default=20.0, ge=0)
    shutdown_deadline_s: float = Field(default=30.0, gt=0)

    log_level: Literal["debug", "info", "warning", "error"] = "info"
