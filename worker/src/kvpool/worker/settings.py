"""Everything ``kvpool-worker serve`` can be told, in one pydantic-settings class.

Why this module exists: a worker is configured by the operator through environment variables
(``KVPOOL_WORKER_*``) and by a person on a laptop through flags; both land here, validated
once, so the rest of the runtime reads typed values. The cache-domain contract (LMCache,
vLLM and hash-seed variables) is deliberately not here: those are checked exactly as the
process received them, by ``kvpool.worker.contract``.

The environment is an explicit mapping (:meth:`WorkerSettings.from_env`), never read from
``os.environ`` behind the caller's back: ``kvpool-worker host`` builds many instances in one
process, each from its own rendered environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvpool.worker.engine_api import ReferenceEngineOptions

_REF = ReferenceEngineOptions()
ENV_PREFIX = "KVPOOL_WORKER_"


class WorkerSettings(BaseSettings):
    """Flags override ``KVPOOL_WORKER_<FIELD>`` variables, which override these defaults."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # the environment comes through from_env, as a mapping

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> WorkerSettings:
        """Settings from ``KVPOOL_WORKER_<FIELD>`` variables of ``env`` (any case, as
        pydantic-settings reads them), then ``overrides`` (the flags) on top."""
        fields = {name.upper(): name for name in cls.model_fields}
        values: dict[str, Any] = {}
        for key, value in env.items():
            upper = key.upper()
            if upper.startswith(ENV_PREFIX) and upper[len(ENV_PREFIX) :] in fields:
                values[fields[upper[len(ENV_PREFIX) :]]] = value
        return cls(**{**values, **overrides})

    engine: Literal["reference", "vllm", "sim"] = "reference"
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
    # Requests batched together (reference: 8; sim: the profile's).
    max_num_seqs: int | None = Field(default=None, ge=1)

    # Simulated engine (``--engine sim``): timing from a profile, KV bytes from the pool's
    # model shape. Unset limits come from the profile.
    sim_profile: str | None = None  # a bundled profile's name or a profile file's path
    sim_speedup: float = Field(default=1.0, gt=0)  # model seconds per wall second
    sim_device_kv_gib: float | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    num_layers: int | None = Field(default=None, ge=1)
    num_kv_heads: int | None = Field(default=None, ge=1)
    head_dim: int | None = Field(default=None, ge=1)
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON (device KV events)

    # vLLM(-Ascend). "cpu" is what the operator renders for the reference engine's pods.
    platform: Literal["ascend", "cuda", "cpu"] = "ascend"
    ascend_connector: Literal["dynamic", "builtin"] = "dynamic"
    tensor_parallel_size: int = Field(default=1, ge=1)
    lmcache_rpc_port: str | None = None

    # Sessions for the agent memory API.
    session_capacity: int = Field(default=4096, ge=1)
    #: The pod's memory request (the operator renders KVPOOL_WORKER_MEMORY_BUDGET_BYTES),
    #: exported as kvpool_worker_memory_budget_bytes next to the process's resident memory.
    memory_budget_bytes: int | None = Field(default=None, ge=0)

    # SIGTERM: stop being ready, wait unready_delay_s (endpoints catch up), drain in-flight
    # requests for at most drain_timeout_s, then shut the engine down; the process exits
    # no later than shutdown_deadline_s after the signal, whatever hangs.
    unready_delay_s: float = Field(default=0.0, ge=0)
    drain_timeout_s: float = Field(default=20.0, ge=0)
    shutdown_deadline_s: float = Field(default=30.0, gt=0)
    #: Readiness fails while one engine job (a step, a store) has run longer than this: a
    #: stuck engine is routed around. Above the longest legitimate step, a prefill of
    #: max_model_len tokens (8K tokens of the reference model: 8 s on a 2-core box at load 6).
    stall_timeout_s: float = Field(default=120.0, gt=0)

    #: Before LMCache registers (it sends RegisterMsg once and goes mute without an answer),
    #: wait this long for the KV controller to answer (kvpool.worker.controller_wait), not
    #: ready meanwhile; past it the worker exits 1 and is restarted. 0: do not wait.
    controller_wait_s: float = Field(default=300.0, ge=0)

    log_level: Literal["debug", "info", "warning", "error"] = "info"
