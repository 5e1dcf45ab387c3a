"""Building blocks shared by the three kinds: the strict camelCase base model and small types.

Why: the API models are the single source of truth for the CRDs and the chart schema, so every
model must agree on wire naming (camelCase), strictness (unknown fields are errors, so a typo
never silently falls back to a default) and how sizes are written (Kubernetes quantities).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from kvpool.operator.quantity import parse_quantity

GROUP = "kvpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

_QUANTITY_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$",
}

#: A size written as a Kubernetes quantity ("8Gi", "512Mi") or a number of bytes; held as bytes.
Quantity = Annotated[int, BeforeValidator(parse_quantity), WithJsonSchema(_QUANTITY_SCHEMA)]

_RESOURCE_VALUE_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
}


def _to_str(value: object) -> object:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


ResourceValue = Annotated[str, BeforeValidator(_to_str), WithJsonSchema(_RESOURCE_VALUE_SCHEMA)]


def cel_rules(*rules: tuple[str, str]) -> ConfigDict:
    """Model config adding CEL ``x-kubernetes-validations`` (rule, message) to the CRD schema."""
    return ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]
        }
    )


class ApiModel(BaseModel):
    """Strict camelCase model: unknown fields are rejected, Python names stay snake_case."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
    )


class PoolRef(ApiModel):
    """The KVCachePool (same namespace) whose cache domain this resource joins."""

    name: str = Field(min_length=1, max_length=40, description="Name of the KVCachePool.")


class Toleration(ApiModel):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(ApiModel):
    """Container resource requests and limits (core/v1 ResourceRequirements)."""

    requests: dict[str, ResourceValue] = Field(default_factory=dict)
    limits: dict[str, ResourceValue] = Field(default_factory=dict)


class Placement(ApiModel):
    """Where pods may run: node selector and tolerations, passed through to the pod spec."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class ObjectMeta(ApiModel):
    """The part of metav1.ObjectMeta the operator reads."""

    name: str = Field(
        min_length=1,
        max_length=40,
        pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="A DNS-1035 label (it names Services), at most 40 characters so that "
        "instance names stay within Kubernetes limits.",
    )
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    model_config = ConfigDict(extra="ignore")


ConditionType = Literal[
    "Ready",
    "Progressing",
    "Degraded",
    "ConfigValid",
    "HashSeedConsistent",
    "PortsConsistent",
    "FiguresCurrent",
]


class Condition(ApiModel):
    """metav1.Condition: one observed aspect of the resource."""

    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339 time of the last status change.")
    observed_generation: int | None = None


class InstanceStatus(ApiModel):
    """One engine instance (a pod with all its TP ranks) and the ports allocated to it."""

    name: str
    role: Literal["p2p", "prefill", "decode"]
    lmcache_instance_id: str
    ready: bool = False
    http_port: int
    ports: dict[str, list[int]] = Field(
        default_factory=dict, description="Per-TP-rank port lists, keyed by LMCache key."
    )


class MemoryBudget(ApiModel):
    """Host memory the pods need (seed manual §5.5): workers x (staging + CPU cache + buffers)."""

    kv_bytes_per_token_per_rank: int
    chunk_bytes_per_rank: int
    workers: int = Field(description="Number of LMCache workers (instances x TP ranks).")
    per_worker_bytes: int
    per_instance_bytes: int
    pod_memory_request_bytes: int = Field(
        default=0,
        description="Memory the largest worker pod requests: its LMCache host memory plus the "
        "engine's own resources.requests.memory.",
    )
    total_bytes: int
    formula: str = Field(description="The computation, written out for a person to check.")
