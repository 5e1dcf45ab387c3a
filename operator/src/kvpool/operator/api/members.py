"""P2PGroup and PDPair: the engine instances that join a pool's cache domain.

Why: a member describes intent (how many instances, TP size, which transfer mode); the operator
derives every port, instance id and LMCache key from it, so the hand-written mistakes of the
seed manual (wrong list lengths, colliding ports, contradicting flags) cannot be expressed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from kvpool.operator.api.common import (
    ApiModel,
    Condition,
    InstanceStatus,
    MemoryBudget,
    ObjectMeta,
    Placement,
    PoolRef,
    Quantity,
    Resources,
    cel_rules,
)
from kvpool.protocol.pd import (
    DEFAULT_UNCLAIMED_TTL_SECONDS,
    MAX_UNCLAIMED_TTL_SECONDS,
    MIN_UNCLAIMED_TTL_SECONDS,
)
from kvpool.protocol.simcore.profile import bundled_profiles

Platform = Literal["ascend", "cuda", "cpu"]

_DEFAULT_ACCELERATOR = {"ascend": "huawei.com/ascend-1980", "cuda": "nvidia.com/gpu", "cpu": ""}

#: The performance profiles kvpool.protocol ships (each names a model, a chip and its sources).
SIM_PROFILES: tuple[str, ...] = tuple(bundled_profiles())


class SimEngineSpec(ApiModel):
    """kvpool's simulated engine (``kvpool-worker serve --engine sim``): a worker in every
    respect but the model math (real controller protocol, chunk hashes, tiers bounded by the
    rendered sizes); its timing comes from a performance profile of a named model and chip."""

    profile: str = Field(
        description="A bundled performance profile: " + ", ".join(SIM_PROFILES) + ".",
        json_schema_extra={"enum": list(SIM_PROFILES)},
    )
    speedup: float = Field(
        default=1.0,
        gt=0,
        description="Model seconds per wall-clock second (2: twice as fast as the profiled "
        "chip; below 1: slow motion). Default 1.",
    )
    device_kv_gib: float | None = Field(
        default=None,
        gt=0,
        alias="deviceKVGiB",
        description="Device (HBM) KV memory in GiB. Default: the profile's.",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Requests batched together. Default: the profile's."
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="Token budget of one engine step. Default: the profile's."
    )

    @field_validator("profile")
    @classmethod
    def _bundled(cls, value: str) -> str:
        if value not in SIM_PROFILES:
            raise ValueError(f"unknown profile {value!r}: choose one of {', '.join(SIM_PROFILES)}")
        return value


class EngineSpec(ApiModel):
    """The inference engine of each instance."""

    platform: Platform = Field(
        description="ascend (vLLM-Ascend + LMCache-Ascend), cuda (vLLM + LMCache) or cpu "
        "(kvpool's reference engine + LMCache)."
    )
    image: str | None = Field(default=None, description="Default: the pool's worker image.")
    args: list[str] = Field(default_factory=list, description="Extra engine arguments.")
    block_size: int | None = Field(
        default=None, ge=1, description="Must equal the pool's blockSize when set."
    )
    max_model_len: int = Field(default=32768, ge=1, description="Default 32768.")
    accelerator_resource: str | None = Field(
        default=None,
        description="Extended resource name. Default huawei.com/ascend-1980 (ascend), "
        "nvidia.com/gpu (cuda), none (cpu).",
    )
    accelerator_count: int | None = Field(
        default=None, ge=0, description="Accelerators per instance. Default: the TP size."
    )
    resources: Resources = Field(default_factory=Resources)
    lmcache_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra top-level LMCache keys (not managed by kvpool), e.g. "
        "{remote_serde: cachegen}; checked against the LMCache version's key list.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    sim: SimEngineSpec | None = Field(
        default=None,
        description="Run kvpool's simulated engine instead of a model (platform cpu: the "
        "profile names the simulated chip). No accelerator and no host memory for LMCache's "
        "tiers are requested: the simulated tiers allocate nothing. Not in a PDPair and not "
        "with a remote tier.",
    )
    kv_events: bool = Field(
        default=False,
        description="Publish vLLM's KV-cache events over ZMQ for external KV-aware routers "
        "(vllm-router's kv_aware policy, llm-d): the worker gets vLLM's --kv-events-config "
        "with an events PUB and a replay ROUTER port, allocated per instance with its other "
        "ports (container ports kv-events and kv-replay). vLLM (ascend, cuda) and engine.sim; "
        "the reference engine (platform cpu without sim) publishes none. Default false.",
    )

    model_config = cel_rules(
        (
            "!has(self.sim) || self.platform == 'cpu'",
            "a sim engine runs on CPUs: set platform: cpu (the profile names the simulated chip)",
        ),
        (
            "!has(self.kvEvents) || !self.kvEvents || self.platform != 'cpu' || has(self.sim)",
            "kvEvents: the reference engine (platform cpu without sim) publishes no KV events: "
            "set engine.sim or a vLLM platform (ascend, cuda), or remove kvEvents",
        ),
    )

    def accelerator(self) -> str:
        """The extended resource requested for this engine ("" when none)."""
        if self.accelerator_resource is not None:
            return self.accelerator_resource
        return _DEFAULT_ACCELERATOR[self.platform]


class HostStaging(ApiModel):
    """LMCache-Ascend HostStaging: a bounded pinned arena registered with HCCL (seed §5.4)."""

    enabled: bool = Field(default=False, description="Default false.")
    bytes: Quantity = Field(
        default=8 * 2**30, description="os_staging_bytes per rank. Default 8Gi."
    )
    expected_concurrent_requests: int | None = Field(
        default=None, ge=1, description="Concurrent staged hits per rank, for the sizing warning."
    )
    expected_hit_tokens: int | None = Field(
        default=None, ge=1, description="p95 hit length in tokens, for the sizing warning."
    )


class P2PTransfer(ApiModel):
    """How instances move KV between each other."""

    channel: Literal["hccl", "hixl", "nixl"] | None = Field(
        default=None, description="Default hccl on ascend, nixl on cuda and cpu."
    )
    pull_mode: bool = Field(default=False, description="p2p_pull_mode (ascend). Default false.")
    delay_pull: bool = Field(default=False, description="p2p_delay_pull (ascend). Default false.")
    use_npu: bool = Field(
        default=False, alias="useNPU", description="p2p_use_npu (ascend). Default false."
    )
    host_staging: HostStaging = Field(default_factory=HostStaging)
    npu_buffer_size: Quantity = Field(
        default=134217728, description="p2p_npu_buffer_size (ascend). Default 128Mi."
    )
    pull_pending_ttl_seconds: float = Field(
        default=60.0,
        gt=0,
        alias="pullPendingTTLSeconds",
        description="extra_config.p2p_pull_pending_ttl. Default 60.",
    )
    lookup_backoff_seconds: float = Field(
        default=0.001, gt=0, description="extra_config.lookup_backoff_time. Default 0.001."
    )

    model_config = cel_rules(
        ("!self.delayPull || (self.pullMode && self.useNPU)", "delayPull needs pullMode and useNPU")
    )


class P2PInstancePorts(ApiModel):
    """Explicit ports of one instance (instead of allocation from ports.base)."""

    http: int = Field(ge=1, le=65535)
    worker_ports: list[int] = Field(description="lmcache_worker_ports, one per TP rank.")
    init_ports: list[int] = Field(
        default_factory=list, description="p2p_init_ports, one per TP rank (P2P only)."
    )
    lookup_ports: list[int] = Field(
        default_factory=list, description="p2p_lookup_ports, one per TP rank (P2P only)."
    )
    kv_events: int | None = Field(
        default=None, ge=1, le=65535, description="The KV-event PUB port (engine.kvEvents only)."
    )
    kv_events_replay: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="The KV-event replay ROUTER port (engine.kvEvents only).",
    )


class PortSpec(ApiModel):
    """Port allocation: instances take consecutive blocks from base, or explicit lists."""

    base: int = Field(
        default=20000,
        ge=1024,
        le=65000,
        description="First port of this member's range. Default 20000. Members with "
        "hostNetwork in one pool need disjoint ranges.",
    )
    instances: list[P2PInstancePorts] | None = Field(
        default=None, description="Explicit ports per instance (P2PGroup only)."
    )


class P2PGroupSpec(ApiModel):
    """A group of peer instances that share KV through the controller (kv_both)."""

    pool_ref: PoolRef
    p2p: bool = Field(
        default=True,
        alias="p2p",
        description="false: instances that share the domain's controller and index (KV-aware "
        "routing, the memory API) but never pull KV from each other (no enable_p2p, no P2P "
        "ports); what most pools without P2P run. Default true.",
    )
    replicas: int = Field(
        default=2, ge=0, le=64, description="Instances; 0 scales the group to zero. Default 2."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="Default 1.")
    engine: EngineSpec
    transfer: P2PTransfer = Field(default_factory=P2PTransfer)
    enable_async_loading: bool = Field(default=False, description="Default false.")
    cache_policy: Literal["LRU", "LFU", "FIFO", "MRU"] | None = Field(
        default=None, description="LMCache cache_policy; LMCache's default (LRU) when unset."
    )
    save_only_first_rank: bool = Field(
        default=False, description="extra_config.save_only_first_rank (MLA/DSA). Default false."
    )
    use_layerwise: bool = Field(default=False, description="Not supported with P2P.")
    ports: PortSpec = Field(default_factory=PortSpec)
    host_network: bool = Field(default=False, description="Default false.")
    placement: Placement = Field(default_factory=Placement)


class PDRole(ApiModel):
    """Prefill or decode side of a PD pair."""

    replicas: int = Field(
        default=1,
        ge=0,
        le=64,
        description="Instances of this side; 0 scales it to zero. Default 1.",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="Default 1.")
    engine: EngineSpec


PDMode = Literal["push", "pull-eager", "pull-delay", "cpu-offload-pull-delay"]


class PDTransfer(ApiModel):
    """How prefill hands KV to decode (seed §4)."""

    mode: PDMode = Field(
        default="push",
        description="push (sender writes), pull-eager, pull-delay, cpu-offload-pull-delay "
        "(the pull modes are LMCache-Ascend only). Default push.",
    )
    channel: Literal["hccl", "hixl", "nixl"] | None = Field(
        default=None, description="Default hccl on ascend, nixl on cuda and cpu."
    )
    buffer_size: Quantity = Field(
        default=134217728, description="pd_buffer_size on each side. Default 128Mi."
    )
    buffer_device: Literal["npu", "cuda", "cpu"] | None = Field(
        default=None, description="pd_buffer_device. Default npu/cuda/cpu by platform."
    )
    cpu_buffer_size: Quantity = Field(
        default=21474836480,
        description="pd_cpu_buffer_size for cpu-offload-pull-delay. Default 20Gi.",
    )
    pull_pending_ttl_seconds: float = Field(
        default=360.0,
        gt=0,
        alias="pullPendingTTLSeconds",
        description="pd_pull_pending_ttl (ascend pull modes). Default 360.",
    )
    unclaimed_ttl_seconds: float = Field(
        default=DEFAULT_UNCLAIMED_TTL_SECONDS,
        ge=MIN_UNCLAIMED_TTL_SECONDS,
        le=MAX_UNCLAIMED_TTL_SECONDS,
        alias="unclaimedTTLSeconds",
        description="Seconds a decode instance keeps a transfer no decode has claimed (a "
        "prefill-only answer, a client or gateway gone between prefill and decode) before it "
        "frees it: LMCache frees its PD buffer only on retrieve, so unclaimed transfers would "
        "fill it and stall every later push. Rendered as extra_config."
        "kvpool_pd_unclaimed_ttl_seconds for kvpool's reference engine (platform cpu); vLLM's "
        "LMCache connector has no such TTL. Keep it above the gateway's PD transfer wait "
        "(30 s). Default 60.",
    )


class PDProxy(ApiModel):
    """The PD proxy role, served by the pool's gateway."""

    port: int = Field(
        default=7500, ge=1, le=65535, description="pd_proxy_port on the gateway. Default 7500."
    )


class PDPairSpec(ApiModel):
    """Disaggregated prefill: prefill instances send KV to decode instances."""

    pool_ref: PoolRef
    prefill: PDRole
    decode: PDRole
    transfer: PDTransfer = Field(default_factory=PDTransfer)
    proxy: PDProxy = Field(default_factory=PDProxy)
    use_layerwise: bool = Field(default=False, description="Not supported with PD.")
    ports: PortSpec = Field(default_factory=PortSpec)
    host_network: bool = Field(default=False, description="Default false.")
    placement: Placement = Field(default_factory=Placement)

    model_config = cel_rules(
        (
            "!has(self.prefill.engine.sim) && !has(self.decode.engine.sim)",
            "PD transfers are not simulated: run the PDPair with the reference engine (platform "
            "cpu, no engine.sim) or vLLM",
        )
    )


class LiveMemberFigures(ApiModel):
    """The member's instances as the controller and the gateway see them now (refreshed with
    the pool's live figures)."""

    instances_registered: int | None = Field(
        default=None,
        description="Instances with every TP rank registered with the controller (P2PGroup).",
    )
    instances_frozen: int | None = Field(
        default=None, description="Instances whose LMCache is in a full-sync freeze."
    )
    instances_refused: int | None = Field(
        default=None,
        description="Instances not registered whose name the controller refused (another "
        "domain fingerprint).",
    )
    frozen: list[str] | None = Field(default=None, description="Names of the frozen instances.")
    refused: list[str] | None = Field(default=None, description="Names of the refused instances.")


class MemberStatus(ApiModel):
    """Observed state of a P2PGroup or PDPair."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    pool: str | None = Field(default=None, description="The KVCachePool (column POOL).")
    tensor_parallel: str | None = Field(
        default=None,
        description='TP size of each instance (column TP); a PDPair shows "prefill/decode".',
    )
    domain_fingerprint: str | None = None
    instances_ready: int = 0
    instances_desired: int = 0
    instances: list[InstanceStatus] = Field(default_factory=list)
    endpoints: list[str] = Field(default_factory=list, description="Instance HTTP endpoints.")
    memory_budget: MemoryBudget | None = None
    warnings: list[str] = Field(
        default_factory=list,
        description="Warnings of the domain's validation for this resource (path: message).",
    )
    defaults: list[str] = Field(
        default_factory=list,
        description="Sizes and counts kvpool filled in by default (field = value).",
    )
    live: LiveMemberFigures | None = Field(
        default=None, description="Live figures from the controller and the gateway."
    )


class P2PGroup(ApiModel):
    """P2PGroup custom resource."""

    api_version: Literal["kvpool.io/v1alpha1"] = "kvpool.io/v1alpha1"
    kind: Literal["P2PGroup"] = "P2PGroup"
    metadata: ObjectMeta
    spec: P2PGroupSpec
    status: MemberStatus | None = None


class PDPair(ApiModel):
    """PDPair custom resource."""

    api_version: Literal["kvpool.io/v1alpha1"] = "kvpool.io/v1alpha1"
    kind: Literal["PDPair"] = "PDPair"
    metadata: ObjectMeta
    spec: PDPairSpec
    status: MemberStatus | None = None


Member = P2PGroup | PDPair
