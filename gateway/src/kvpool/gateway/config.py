"""The gateway's configuration: exactly the ``gateway.yaml`` the operator renders, plus the
environment and flags of its container.

Why this module exists: the operator's render (``_gateway_config`` in
operator/src/kvpool/operator/render/pool_objects.py) and this model are one contract. Unknown
keys are refused (``extra="forbid"``), so a key the render adds without the gateway honouring
it fails the render-runs-verbatim test instead of being ignored in production. Keys the render
does not write (limits, guards, tokenizer) have defaults and may be set by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvpool.gateway.apikeys import KeyFileError, parse_keys, read_keys
from kvpool.protocol.hashing import HashAlgorithm, HashConfig, HashConfigError
from kvpool.protocol.policies import RoutingPolicyName


class ConfigError(Exception):
    """The configuration is wrong; the message names the file, the key and the fix."""


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True
    )


class RoutingWeights(_Model):
    prefix_hit: float = Field(1.0, ge=0)
    load: float = Field(1.0, ge=0)


class Routing(_Model):
    policy: RoutingPolicyName = "kv-aware"
    weights: RoutingWeights = RoutingWeights()


class InstanceRef(_Model):
    name: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://")


class P2PGroupConfig(_Model):
    name: str
    instances: list[InstanceRef]
    p2p: bool = Field(
        True,
        alias="p2p",  # to_camel would make it "p2P"
        description="members pull each other's KV (P2PGroup spec.p2p): credit peers' hits",
    )


class DecodeRef(InstanceRef):
    host: str
    init_ports: list[int]
    alloc_ports: list[int]


class PDPairConfig(_Model):
    name: str
    mode: Literal["push", "pull-eager", "pull-delay", "cpu-offload-pull-delay"]
    proxy_port: int = Field(ge=1, le=65535)
    prefill: list[InstanceRef] = Field(min_length=1)
    decode: list[DecodeRef] = Field(min_length=1)
    bypass_min_cached_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="PD bypass (pool spec.gateway.pd.bypassMinCachedRatio): a request whose "
        "prompt a decode instance holds at least this share of goes straight to it, without "
        "prefill and transfer (the decoders must keep their requests: a CPU tier). 0: off",
    )


class Guards(_Model):
    """Routing guards (see routing.Guards and load.PendingPrefixes)."""

    imbalance_abs: int = Field(8, ge=0)
    imbalance_ratio: float = Field(1.5, ge=1.0)
    pending_ttl_seconds: float = Field(120.0, ge=0)


class RateLimit(_Model):
    requests_per_second: float = Field(gt=0)
    burst: float = Field(gt=0)


class Limits(_Model):
    """Admission, size and time limits: every call the gateway makes is bounded."""

    max_inflight: int = Field(256, ge=1, description="requests sent upstream at once")
    max_queue: int = Field(256, ge=0, description="requests waiting for a slot; more → 429")
    queue_timeout_seconds: float = Field(10.0, gt=0)
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    connect_timeout_seconds: float = Field(2.0, gt=0)
    upstream_timeout_seconds: float = Field(300.0, gt=0, description="first byte, then each")
    retries: int = Field(2, ge=0, le=10)
    health_interval_seconds: float = Field(2.0, gt=0)
    lookup_timeout_seconds: float = Field(
        0.5, gt=0, description="controller /v1/prefix_lookup when the replica is not in sync"
    )
    pd_transfer_timeout_seconds: float = Field(30.0, gt=0)
    rate_limit: RateLimit | None = None
    sessions: int = Field(65_536, ge=1, description="session ids remembered (LRU)")
    explain_requests: int = Field(
        1024, ge=1, description="recent requests whose routing /v1/requests/{id}/explain tells"
    )
    explain_prompt_bytes: int = Field(
        32 * 2**20,
        ge=2**16,
        description="recent prompts' tokens kept by chunk to explain misses (8 bytes a token)",
    )
    explain_evictions: int = Field(
        262_144, ge=1, description="recent chunk evictions kept to explain misses (20 B each)"
    )
    drain_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="after SIGTERM: the most the gateway waits for requests and streams in "
        "flight before it exits (the operator renders it from spec.gateway.drainTimeoutSeconds "
        "and gives the pod that much more grace)",
    )
    drain_min_seconds: float = Field(
        2.0,
        ge=0,
        description="after SIGTERM: the least the gateway keeps answering 503 before it closes "
        "its port, while load balancers stop sending to it",
    )


class GatewayConfig(_Model):
    """``gateway.yaml`` as rendered by the operator."""

    model: str
    chunk_size: int = Field(gt=0)
    hash_algorithm: HashAlgorithm = "builtin"
    vllm: bool = Field(False, description="the engines import vLLM (seeds LMCache's NONE_HASH)")
    controller_url: str = Field(pattern=r"^https?://")
    controller_pub_url: str | None = Field(None, pattern=r"^tcp://")
    controller_snapshot_url: str | None = Field(None, pattern=r"^tcp://")
    routing: Routing = Routing()
    p2p_groups: list[P2PGroupConfig] = Field(default_factory=list, alias="p2pGroups")
    pd_pairs: list[PDPairConfig] = Field(default_factory=list)
    tokenizer: str | None = Field(
        None, description="tokenizer.json or its directory, 'reference', or absent (workers')"
    )
    guards: Guards = Guards()
    limits: Limits = Limits()

    @model_validator(mode="after")
    def _one_name_per_instance(self) -> GatewayConfig:
        seen: dict[str, str] = {}
        places = [
            (f"p2pGroups[{g}].instances[{i}]", inst.name)
            for g, group in enumerate(self.p2p_groups)
            for i, inst in enumerate(group.instances)
        ]
        for p, pair in enumerate(self.pd_pairs):
            places += [(f"pdPairs[{p}].prefill[{i}]", x.name) for i, x in enumerate(pair.prefill)]
            places += [(f"pdPairs[{p}].decode[{i}]", x.name) for i, x in enumerate(pair.decode)]
        for where, name in places:
            if name in seen:
                raise ValueError(
                    f"{where}.name: instance {name!r} is listed twice (also {seen[name]}); "
                    "give each instance its own name"
                )
            seen[name] = where
        return self

    def peer_instances(self) -> list[InstanceRef]:
        return [inst for group in self.p2p_groups for inst in group.instances]

    def hash_config(self, hash_seed: str | None, *, save_unfull_chunk: bool = False) -> HashConfig:
        """The domain's LMCache hashing regime (routing and ``kvpool-gateway hashes`` both use
        this). The trailing partial chunk is not hashed by default: it never routes.
        ``hash_seed`` is the domain's PYTHONHASHSEED; a regime nobody can reproduce (vLLM
        without a seed) is a :class:`ConfigError` naming the variable."""
        try:
            return HashConfig(
                chunk_size=self.chunk_size,
                hash_algorithm=self.hash_algorithm,
                hash_seed=hash_seed,
                save_unfull_chunk=save_unfull_chunk,
                vllm=self.vllm,
            )
        except HashConfigError as exc:
            where = {"hash_seed": "PYTHONHASHSEED"}.get(exc.field, to_camel(exc.field))
            raise ConfigError(f"{where}: {exc.reason}") from None


class GatewayEnv(BaseSettings):
    """The container's environment (the operator renders KVPOOL_GATEWAY_AUTH_TOKEN from the
    pool's spec.gateway.authSecretRef: one API key, or several separated by commas or
    newlines)."""

    model_config = SettingsConfigDict(env_prefix="KVPOOL_GATEWAY_", extra="ignore")

    auth_token: SecretStr | None = None
    auth_token_file: Path | None = Field(
        None,
        description="a file of API keys (the operator mounts the authSecretRef Secret there); "
        "read again whenever it changes (kvpool.gateway.apikeys)",
    )
    admin_token: SecretStr | None = Field(
        None, description="turns the admin routes on (kvpool.gateway.api_admin); not rendered"
    )
    hash_seed: str | None = Field(None, validation_alias="PYTHONHASHSEED")
    pod_ip: str | None = Field(
        None,
        validation_alias="POD_IP",
        description="this replica's address (the downward API): PD transfer notifications "
        "that reach another replica are relayed here (kvpool.gateway.pd)",
    )

    def api_keys(self) -> frozenset[str]:
        """The keys requests must carry (empty: no auth). From the key file when one is set
        (a bad one is a :class:`ConfigError` naming it), else the variable."""
        if self.auth_token_file is not None:
            if self.auth_token is not None:
                raise ConfigError(
                    "KVPOOL_GATEWAY_AUTH_TOKEN and KVPOOL_GATEWAY_AUTH_TOKEN_FILE are both set: "
                    "set one (the file is read again when it changes)"
                )
            try:
                return read_keys(self.auth_token_file)
            except KeyFileError as exc:
                raise ConfigError(f"KVPOOL_GATEWAY_AUTH_TOKEN_FILE: {exc}") from None
        if self.auth_token is None:
            return frozenset()
        return parse_keys(self.auth_token.get_secret_value())


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_config(data: Any, source: str = "gateway.yaml") -> GatewayConfig:
    """Validate loaded YAML; every problem is reported with its key path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {data!r:.60}")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        problems = [
            # a check of the whole document names its own key
            e["msg"].removeprefix("Value error, ")
            if not e["loc"]
            else f"{_where(e['loc'])}: {e['msg']}"
            for e in exc.errors()
        ]
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate ``gateway.yaml``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the gateway config {p}: {exc.strerror}") from None
    return parse_document(text, str(p))


def parse_document(text: str | bytes, source: str = "gateway.yaml") -> GatewayConfig:
    """A ``gateway.yaml`` document (YAML, or JSON: YAML reads it) parsed and validated."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{source}: nested too deeply to be a gateway.yaml") from None
    return parse_config(data, source)
