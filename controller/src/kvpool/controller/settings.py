"""The controller's configuration: one pydantic-settings class, built once in ``main()``.

Why: the same knobs arrive from the command line (LMCache's controller flags, so an existing
deployment's arguments still work), from the environment (``KVPOOL_CONTROLLER_*``, and the
operator-injected ``KVPOOL_DOMAIN_FINGERPRINT``), and from tests constructing it directly.
Validation names the field and the fix instead of failing later on a socket.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvpool.controller.election import ElectionConfig
from kvpool.protocol.hashing import HashConfig, HashConfigError

_PORT_ROLES = ("pull", "reply", "heartbeat")


class ControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPOOL_CONTROLLER_", extra="forbid")

    host: str = Field("0.0.0.0", description="Address the ZMQ and HTTP sockets bind")
    port: int = Field(9000, ge=0, le=65535, description="HTTP API port")
    monitor_ports: dict[str, int] = Field(
        default_factory=lambda: {"pull": 8300, "reply": 8400},
        description='ZMQ ports, LMCache style: {"pull": P, "reply": R, "heartbeat": H}',
    )
    advertise_host: str | None = Field(
        None, description="Host workers should connect to (heartbeat URL); default: detected"
    )
    lmcache_worker_timeout: float = Field(
        300.0, gt=0, description="Seconds without a heartbeat before a worker is purged"
    )
    health_check_interval: float = Field(
        -1.0, description="Seconds between TTL sweeps; -1 disables purging (LMCache's default)"
    )
    control_timeout_s: float = Field(
        10.0, gt=0, description="Timeout of one control request to a worker"
    )
    fingerprint: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "fingerprint", "KVPOOL_DOMAIN_FINGERPRINT", "KVPOOL_CONTROLLER_FINGERPRINT"
        ),
        description="Expected cache-domain fingerprint (12 hex) in '<name>~<fp>' instance ids",
    )
    require_fingerprint: bool = Field(
        False, description="Refuse instance ids that carry no '~<fingerprint>' suffix"
    )
    pub_port: int | None = Field(None, ge=0, le=65535, description="ZMQ PUB port of deltas")
    snapshot_port: int | None = Field(
        None, ge=0, le=65535, description="ZMQ ROUTER port answering index snapshots"
    )
    redis_url: str | None = Field(None, description="redis://host:port/db for write-behind")
    redis_namespace: str = Field("kvpool", description="Prefix of every Redis key")
    redis_queue_max_keys: int = Field(
        1_000_000, gt=0, description="Write-behind queue bound (keys); beyond it, full rewrite"
    )
    redis_batch_keys: int = Field(50_000, gt=0, description="Keys per Redis pipeline")
    full_sync_completion_threshold: float = Field(0.8, ge=0, le=1)
    full_sync_timeout_s: float = Field(300.0, gt=0)
    persistence: Literal["auto", "redis", "full-sync", "none"] = Field(
        "auto",
        description="How a restarted controller recovers its index: redis (write-behind and "
        "reload; needs redis_url), full-sync (ask every worker for its keys), none (no "
        "recovery: re-registered workers are not asked for their keys, the index refills "
        "from new admits), auto (redis when redis_url is set, else full-sync)",
    )
    lease_name: str | None = Field(
        None,
        description="Leader election among the controller's replicas on this "
        "coordination.k8s.io/v1 Lease (the operator renders <pool>-controller); unset: one "
        "controller that leads alone",
    )
    leader_pub_url: str | None = Field(
        None,
        description="With lease_name: the delta stream of whoever leads, followed while standby "
        "(tcp://<controller Service>:<pub port>)",
    )
    leader_snapshot_url: str | None = Field(
        None, description="With lease_name: the leader's snapshot socket, through the Service"
    )
    lease_duration_s: int = Field(
        3, ge=1, description="Seconds a Lease not renewed stays valid (leaseDurationSeconds)"
    )
    renew_deadline_s: float = Field(
        2.0, gt=0, description="A leader that could not renew for this long stops leading"
    )
    retry_period_s: float = Field(
        0.5, gt=0, description="Seconds between two tries to acquire or renew the Lease"
    )
    pod_name: str | None = Field(
        None,
        validation_alias=AliasChoices("pod_name", "POD_NAME", "KVPOOL_CONTROLLER_POD_NAME"),
        description="This replica's pod (downward API): labelled with its role, which the "
        "controller Service selects",
    )
    pod_namespace: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "pod_namespace", "POD_NAMESPACE", "KVPOOL_CONTROLLER_POD_NAMESPACE"
        ),
        description="Namespace of the Lease and the pod (default: the service account's)",
    )
    heartbeat_url: str | None = Field(
        None,
        description="host:port workers are told to heartbeat to (the controller Service's "
        "heartbeat port, so heartbeats follow the leader); default: the advertise host and the "
        "bound heartbeat port",
    )
    chunk_size: int = Field(256, gt=0, description="Tokens per chunk for token lookups")
    hash_algorithm: str = Field(
        "builtin",
        description="The domain's pre_caching_hash_algorithm (builtin or sha256_cbor); token "
        "lookups hash exactly as the domain's workers do (kvpool.protocol.hashing)",
    )
    vllm: bool = Field(
        False,
        description="The domain's engines import vLLM (cuda/ascend workers): LMCache then seeds "
        "its hash chain from PYTHONHASHSEED, and token lookups must too",
    )
    hash_seed: str | None = Field(
        None,
        validation_alias=AliasChoices("hash_seed", "PYTHONHASHSEED"),
        description="The domain's PYTHONHASHSEED (the operator injects it); used with vllm",
    )
    api_token: SecretStr | None = Field(
        None,
        description="Bearer token the mutating HTTP routes require (env "
        "KVPOOL_CONTROLLER_API_TOKEN, from the domain's Secret; no flag, so it never shows in a "
        "process list); unset: every route is open (a standalone controller for development)",
    )
    instances_file: str | None = Field(
        None,
        description="JSON or YAML file {instance_ids: [...]}: only these ids may register "
        "(the operator renders it, and PUT /v1/instances replaces it); unset and never sent: "
        "every id may",
    )
    drain_batch: int = Field(512, gt=0, description="Most frames handled per loop turn per socket")
    drain_budget_ms: float = Field(
        1.0, gt=0, description="Most time one socket keeps the loop before others get a turn"
    )
    log_level: str = Field("INFO")

    @field_validator("monitor_ports")
    @classmethod
    def _check_ports(cls, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(value) - set(_PORT_ROLES))
        if unknown:
            raise ValueError(
                f"monitor_ports has unknown role(s) {unknown}; use only {list(_PORT_ROLES)}"
            )
        if "pull" not in value:
            raise ValueError('monitor_ports needs a "pull" port, e.g. {"pull": 8300}')
        for role, port in value.items():
            if not 0 <= int(port) <= 65535:
                raise ValueError(f"monitor_ports[{role!r}]={port} is not a TCP port")
        return value

    @field_validator("api_token")
    @classmethod
    def _empty_token(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None or not value.get_secret_value() else value

    @field_validator("fingerprint")
    @classmethod
    def _check_fingerprint(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if len(value) != 12 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError(
                f"fingerprint {value!r} must be 12 lowercase hex characters (the first 12 of "
                "the domain's sha256), as the operator renders it"
            )
        return value

    @model_validator(mode="after")
    def _check_require(self) -> ControllerSettings:
        if self.require_fingerprint and self.fingerprint is None:
            raise ValueError(
                "require_fingerprint is set but no fingerprint is configured; pass --fingerprint "
                "or set KVPOOL_DOMAIN_FINGERPRINT"
            )
        return self

    @model_validator(mode="after")
    def _check_persistence(self) -> ControllerSettings:
        if self.persistence == "redis" and not self.redis_url:
            raise ValueError(
                "persistence is 'redis' but no redis_url is set; pass --redis-url "
                "redis://host:port/db or use --persistence full-sync"
            )
        if self.persistence in ("full-sync", "none") and self.redis_url:
            raise ValueError(
                f"persistence is {self.persistence!r} but redis_url is set; drop --redis-url "
                "or use --persistence redis"
            )
        return self

    @model_validator(mode="after")
    def _check_election(self) -> ControllerSettings:
        if self.lease_name is None:
            return self
        if not self.leader_pub_url or not self.leader_snapshot_url:
            raise ValueError(
                "lease_name is set but leader_pub_url/leader_snapshot_url are not: a standby "
                "follows the leader's index through the controller Service; pass "
                "--leader-pub-url tcp://SERVICE:PUB_PORT --leader-snapshot-url "
                "tcp://SERVICE:SNAPSHOT_PORT"
            )
        problems = ElectionConfig(
            "check", self.lease_duration_s, self.renew_deadline_s, self.retry_period_s
        ).problems()
        if problems:
            raise ValueError(f"leader election timing: {'; '.join(problems)}")
        return self

    def hash_config(self, chunk_size: int | None = None) -> HashConfig:
        """The domain's hashing regime for token lookups, as LMCache's own controller hashes
        ``/lookup`` tokens (the trailing partial chunk included); raises HashConfigError."""
        return HashConfig(
            chunk_size=chunk_size or self.chunk_size,
            hash_algorithm=self.hash_algorithm,
            hash_seed=self.hash_seed if self.vllm else None,  # without vLLM no seed matters
            save_unfull_chunk=True,
            vllm=self.vllm,
        )

    @property
    def tokens_lookup_error(self) -> str | None:
        """Why token lookups cannot be answered (None when they can)."""
        try:
            self.hash_config()
        except HashConfigError as exc:
            flag = {"hash_seed": "PYTHONHASHSEED"}.get(
                exc.field, f"--{exc.field}".replace("_", "-")
            )
            return (
                f"the controller cannot hash tokens like this domain's workers ({flag}: "
                f"{exc.reason}): send chunk hashes to /v1/prefix_lookup instead of tokens"
            )
        return None

    @property
    def purge_enabled(self) -> bool:
        return self.health_check_interval > 0
