"""KVCachePool: the cache domain — model KV shape, hashing, tiers, controller and gateway.

Why: everything that must be identical across every process of a domain (seed, chunk size,
hash algorithm, model, KV dtype, block size) lives here once, so members cannot disagree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvpool.operator.api.common import (
    ApiModel,
    Condition,
    MemoryBudget,
    ObjectMeta,
    Placement,
    Quantity,
    Resources,
    cel_rules,
)
from kvpool.protocol.domain import DEFAULT_CONTROLLER_PORTS as _PORTS
from kvpool.protocol.hashing import HashAlgorithm
from kvpool.protocol.policies import RoutingPolicyName

KvDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8"]

DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}


class ModelSpec(ApiModel):
    """The served model and the KV shape used for buffer sizing and memory budgets."""

    name: str = Field(min_length=1, description="Model name or path served by every engine.")
    num_layers: int = Field(ge=1, description="Transformer layers holding KV.")
    num_kv_heads: int = Field(ge=1, description="KV heads (before tensor parallel split).")
    head_dim: int = Field(ge=1, description="Head dimension (MLA: latent + rope dimension).")
    kv_dtype: KvDtype = Field(default="bfloat16", description="KV cache dtype. Default bfloat16.")
    mla: bool = Field(
        default=False,
        description="Multi-head latent attention (MLA/DSA): one latent per token, not split "
        "across TP ranks. Default false.",
    )


class CpuTier(ApiModel):
    """Pinned host memory tier (LMCache local_cpu), per LMCache worker (TP rank)."""

    size: Quantity = Field(description="CPU cache per TP rank, e.g. 16Gi.")


class DiskTier(ApiModel):
    """Local disk tier (LMCache local_disk). Mutually exclusive with P2P in one domain."""

    path: str = Field(pattern=r"^/", description="Absolute directory inside the worker pod.")
    size: Quantity = Field(description="Disk cache per TP rank, e.g. 100Gi.")


class MooncakeTier(ApiModel):
    """Mooncake store: the operator runs the master, an HTTP metadata server and a store
    process that contributes the memory segment (engines contribute none)."""

    segment_size: Quantity = Field(description="Memory the store process contributes, e.g. 32Gi.")
    local_buffer_size: Quantity = Field(
        default=1073741824, description="Per-engine transfer buffer. Default 1Gi."
    )
    master_port: int = Field(default=50051, ge=1, le=65535, description="Default 50051.")
    metadata_port: int = Field(default=8080, ge=1, le=65535, description="Default 8080.")
    store_port: int = Field(
        default=8081,
        ge=1,
        le=65535,
        description="HTTP API port of the store process (mooncake_store_service --port). "
        "Default 8081.",
    )
    eviction_high_watermark_ratio: float = Field(
        default=0.95, gt=0, le=1, description="Evict when usage reaches this ratio. Default 0.95."
    )
    eviction_ratio: float = Field(
        default=0.05, gt=0, le=1, description="Fraction of objects evicted. Default 0.05."
    )
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Default tcp.")
    device_name: str = Field(default="", description="RDMA device; empty for tcp.")


class RedisTier(ApiModel):
    """Redis remote tier."""

    url: str = Field(pattern=r"^(redis|rediss|redis-sentinel|valkey)://", description="Redis URL.")


class RemoteTier(ApiModel):
    """Exactly one remote tier: mooncake or redis."""

    mooncake: MooncakeTier | None = None
    redis: RedisTier | None = None
    serde: Literal["naive", "cachegen", "kivi"] = Field(
        default="naive", description="remote_serde. Default naive."
    )

    model_config = cel_rules(
        ("has(self.mooncake) != has(self.redis)", "set exactly one remote tier (mooncake or redis)")
    )


class Tiers(ApiModel):
    """Storage tiers below the accelerator: DDR, SSD, remote pool."""

    cpu: CpuTier = Field(default_factory=lambda: CpuTier(size=5 * 2**30))
    disk: DiskTier | None = None
    remote: RemoteTier | None = None


class ControllerPorts(ApiModel):
    """Controller ports, mirroring lmcache_controller's --port and --monitor-ports."""

    http: int = Field(
        default=_PORTS.http, ge=1, le=65535, description=f"HTTP API. Default {_PORTS.http}."
    )
    pull: int = Field(
        default=_PORTS.pull, ge=1, le=65535, description=f"ZMQ PULL. Default {_PORTS.pull}."
    )
    reply: int = Field(
        default=_PORTS.reply, ge=1, le=65535, description=f"ZMQ ROUTER. Default {_PORTS.reply}."
    )
    heartbeat: int = Field(
        default=_PORTS.heartbeat,
        ge=1,
        le=65535,
        description=f"Heartbeat. Default {_PORTS.heartbeat}.",
    )
    pub: int = Field(
        default=_PORTS.pub,
        ge=1,
        le=65535,
        description=f"ZMQ PUB of index deltas (the gateway's replica). Default {_PORTS.pub}.",
    )
    snapshot: int = Field(
        default=_PORTS.snapshot,
        ge=1,
        le=65535,
        description=f"ZMQ ROUTER answering index snapshots. Default {_PORTS.snapshot}.",
    )


class Persistence(ApiModel):
    """How the controller survives a restart."""

    mode: Literal["none", "redis", "full-sync"] = Field(
        default="full-sync", description="Default full-sync (workers re-send their keys)."
    )
    redis_url: str | None = Field(default=None, description="Required when mode is redis.")

    model_config = cel_rules(
        ("self.mode != 'redis' || has(self.redisUrl)", "persistence mode redis needs redisUrl")
    )


class FullSync(ApiModel):
    """The timing of LMCache's full sync: after a controller restart that lost its index (one
    replica, persistence full-sync or none) each registered worker resends every key it holds,
    and drops every store from the start of its sync until a status poll finds it complete
    (its freeze: those prompts are computed and not kept)."""

    startup_delay_seconds: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="Default 0.5. Each worker waits a random 0 to this before its sync (and "
        "its freeze) starts, so a domain's workers do not all sync at once. LMCache's default "
        "is 5; a thousand workers spread over 0.5 s send the controller well within what it "
        "ingests (controller README, benchmark), so kvpool does not make a small domain wait.",
    )
    status_poll_interval_seconds: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="Default 0.5. A worker asks the controller whether its sync is complete "
        "this often, first this long after it sent its keys: its freeze lasts at least this. "
        "LMCache's default is 5 (a worker frozen 5 s or more, whatever the domain's size).",
    )


class ControllerSpec(ApiModel):
    """The KV controller Deployment."""

    replicas: int = Field(
        default=2,
        ge=1,
        description="Default 2. With 2 or more, the replica holding the Lease <pool>-controller "
        "leads, the others keep a warm copy of its index and take over when it dies (seconds, "
        "no worker re-registering or full-syncing), and a PodDisruptionBudget lets a drain "
        "evict one at a time. 1: one controller, whose loss degrades routing to least-load "
        "until it is back and every worker has re-synced.",
    )
    ports: ControllerPorts = Field(default_factory=ControllerPorts)
    persistence: Persistence = Field(default_factory=Persistence)
    health_check_interval_seconds: int = Field(default=10, ge=1, description="Default 10.")
    worker_timeout_seconds: int = Field(default=60, ge=1, description="Default 60.")
    full_sync: FullSync = Field(default_factory=FullSync)
    resources: Resources = Field(default_factory=Resources)


class RoutingWeights(ApiModel):
    """kv-aware scoring weights: score = prefixHit x tier-weighted cached prefix tokens -
    load x (queued prefill tokens + chunkSize x in-flight requests), see gateway/README.md."""

    prefix_hit: float = Field(default=1.0, ge=0, description="Default 1.0.")
    load: float = Field(
        default=1.0,
        ge=0,
        description="Default 1.0: a queued token delays a request as much as an uncached one.",
    )


class Routing(ApiModel):
    """Gateway routing policy."""

    policy: RoutingPolicyName = Field(
        default="kv-aware",
        description="kv-aware (cached prefix vs load), session (x-session-id or user, "
        "consistent hashing), least-load or round-robin. Default kv-aware.",
    )
    weights: RoutingWeights = Field(default_factory=RoutingWeights)


class SecretKeyRef(ApiModel):
    """A key of a Secret in the pool's namespace."""

    name: str
    key: str = "token"


class GatewayTokenizer(ApiModel):
    """The served model's tokenizer files for the gateway, which then tokenizes every prompt
    itself. Without it a vLLM pool's gateway asks a ready worker's /tokenize for each request
    (the same tokens, one round trip more); a platform cpu pool needs none (the reference
    engine's tokenizer ships with the gateway)."""

    path: str = Field(
        pattern=r"^/",
        description="Absolute path in the gateway container: a tokenizer.json, its directory "
        "(with tokenizer_config.json for the chat template), or a Hugging Face hub cache "
        "(HF_HUB_CACHE, or HF_HOME holding hub/) with spec.model.name in it, resolved to the "
        "snapshot its refs/main names.",
    )
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        description="A PersistentVolumeClaim of the pool's namespace mounted read-only at path "
        "(the one the vLLM workers load the model from, for example); without it path must "
        "exist in the gateway's image.",
    )


class GatewayPD(ApiModel):
    """The gateway's request path through the pool's PDPairs."""

    bypass_min_cached_ratio: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="PD bypass, off by default (unset or 0). From 0 to 1: a request whose prompt "
        "a decode instance already holds at least this share of (by the controller's index) "
        "goes straight to that decoder, without prefill and transfer. Turning it on gives every "
        "decode instance of a platform cpu PDPair the pool's CPU tier (spec.tiers.cpu.size more "
        "memory per decoder) and registers it with the controller, so it keeps each request it "
        "finished (prompt and answer, whole chunks). vLLM decoders keep nothing (a PD consumer "
        "does not save): their pairs are never bypassed. Off by default because it costs that "
        "memory and takes decode capacity for prefill work: 0.5 suits multi-turn chat.",
    )


class GatewaySpec(ApiModel):
    """The KV-affinity gateway Deployment (OpenAI-compatible)."""

    replicas: int = Field(
        default=2,
        ge=1,
        description="Default 2: a gateway that dies or drains (SIGTERM: unready first, "
        "in-flight requests finished) leaves the other serving behind the Service, and the "
        "PodDisruptionBudget lets a node drain take one at a time.",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Default 8000.")
    routing: Routing = Field(default_factory=Routing)
    pd: GatewayPD = Field(default_factory=GatewayPD)
    auth_secret_ref: SecretKeyRef | None = Field(default=None, description="Bearer token secret.")
    tokenizer: GatewayTokenizer | None = Field(
        default=None, description="The model's tokenizer for the gateway (vLLM pools)."
    )
    resources: Resources = Field(default_factory=Resources)


class Images(ApiModel):
    """Container images."""

    controller: str = Field(default="ghcr.io/kvpool/controller:0.1.0")
    gateway: str = Field(default="ghcr.io/kvpool/gateway:0.1.0")
    worker: str = Field(default="ghcr.io/kvpool/worker:0.1.0")
    mooncake: str = Field(default="ghcr.io/kvpool/mooncake:0.1.0")


class KVCachePoolSpec(ApiModel):
    """A cache domain."""

    model: ModelSpec
    chunk_size: int = Field(default=256, ge=1, description="Tokens per chunk. Default 256.")
    block_size: int = Field(
        default=128, ge=1, description="vLLM --block-size for every engine. Default 128."
    )
    hash_seed: str = Field(
        default="auto",
        pattern=r"^(auto|[0-9]{1,10})$",
        description="PYTHONHASHSEED for every process of the domain, or auto (derived once "
        "from the pool's uid and kept in status). Default auto.",
    )
    hash_algorithm: HashAlgorithm = Field(
        default="builtin", description="pre_caching_hash_algorithm. Default builtin."
    )
    tiers: Tiers = Field(default_factory=Tiers)
    controller: ControllerSpec = Field(default_factory=ControllerSpec)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    images: Images = Field(default_factory=Images)
    placement: Placement = Field(default_factory=Placement)
    node_allocatable_memory: Quantity | None = Field(
        default=None,
        description="Allocatable memory of a worker node; when set, a warning is raised if "
        "one instance needs more host memory than this.",
    )


class TierFigures(ApiModel):
    """One LMCache storage backend (tier) in the controller's index."""

    chunk_locations: int = Field(
        description="(chunk, worker) entries the tier holds: a chunk of a TP-2 instance counts "
        "once per rank."
    )
    bytes: int | None = Field(
        default=None,
        description="chunkLocations x bytes of a full chunk per rank (chunkSize x KV bytes per "
        "token per rank): an upper bound, a partial last chunk counts whole. Absent when the "
        "pool's P2P instances run different TP sizes.",
    )


class RefusedRegistration(ApiModel):
    """An instance id the controller refused, and why."""

    instance_id: str
    reason: str


class LivePoolFigures(ApiModel):
    """What the domain is doing, read by the operator from its controller and gateway every
    --figures-interval seconds (condition FiguresCurrent says whether the last read worked)."""

    instances: str = Field(
        description='P2P instances registered with the controller / expected, e.g. "3/4" '
        '(column INSTANCES); "?/4" while the controller cannot be read.'
    )
    hit: str = Field(
        description="Prompt tokens the gateway routed to an instance holding their KV, as a "
        'share of all it routed in the window, e.g. "67.3%" (column HIT); "-" before two '
        'readings, "idle" when nothing was routed in the window, "?" while the gateway cannot '
        "be read."
    )
    instances_registered: int | None = Field(
        default=None, description="Expected instances with every TP rank registered."
    )
    instances_expected: int = Field(
        default=0,
        description="Instances registering with the controller: the pool's P2PGroups' and, "
        "with spec.gateway.pd.bypassMinCachedRatio, its platform cpu PDPairs' decoders (other "
        "PD instances do not register).",
    )
    workers_registered: int | None = None
    workers_expected: int = 0
    unexpected_instances: list[str] | None = Field(
        default=None,
        description="Instance ids registered with the controller that no member renders.",
    )
    chunks: int | None = Field(default=None, description="Distinct chunks in the index.")
    tiers: dict[str, TierFigures] | None = Field(
        default=None, description="Per LMCache location (LocalCPUBackend, ...)."
    )
    hit_ratio: float | None = Field(default=None, description="hitTokens / promptTokens.")
    hit_tokens: int | None = Field(
        default=None,
        description="Prompt tokens the router expected the chosen instance to hold, in the "
        "window (kvpool_gateway_predicted_hit_tokens_total).",
    )
    prompt_tokens: int | None = Field(
        default=None,
        description="Prompt tokens routed in the window (kvpool_gateway_prompt_tokens_total).",
    )
    window_seconds: float | None = Field(
        default=None, description="Time between the two gateway readings the ratio is over."
    )
    instances_frozen: int | None = Field(
        default=None,
        description="Ready instances whose LMCache is in a full-sync freeze (their /readyz, as "
        "the gateway last probed it).",
    )
    refused_registrations: int | None = Field(
        default=None, description="Registrations the controller refused since it started."
    )
    refused: list[RefusedRegistration] | None = Field(
        default=None, description="The latest refused instance ids (up to 20)."
    )


class KVCachePoolStatus(ApiModel):
    """Observed state of a cache domain."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    resolved_hash_seed: str | None = Field(default=None, description="The seed in use.")
    domain_fingerprint: str | None = None
    controller_endpoint: str | None = None
    gateway_endpoint: str | None = None
    members: list[str] = Field(default_factory=list, description="Kind/name of each member.")
    member_count: int = Field(default=0, description="Number of members (column MEMBERS).")
    instances_ready: int = 0
    instances_desired: int = 0
    memory_budget: dict[str, MemoryBudget] = Field(
        default_factory=dict, description="Host memory per member, keyed by Kind/name."
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="Warnings of the domain's validation for this resource (path: message).",
    )
    defaults: list[str] = Field(
        default_factory=list,
        description="Sizes and counts kvpool filled in by default (field = value).",
    )
    live: LivePoolFigures | None = Field(
        default=None, description="Live figures from the controller and the gateway."
    )


class KVCachePool(ApiModel):
    """KVCachePool custom resource."""

    api_version: Literal["kvpool.io/v1alpha1"] = "kvpool.io/v1alpha1"
    kind: Literal["KVCachePool"] = "KVCachePool"
    metadata: ObjectMeta
    spec: KVCachePoolSpec
    status: KVCachePoolStatus | None = None
