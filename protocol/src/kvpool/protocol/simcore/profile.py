"""Performance profiles of the simulated engine: what one engine step costs, what moving KV costs.

Why this module exists: the simulated engine's timing is a model, not a guess. A profile is a
data file (``assets/profiles/<name>.json``) that names the model and chip it describes and cites
where each number comes from (a published vLLM / vLLM-Ascend benchmark, or ``kvpool-worker
calibrate`` on a named machine). The same profile drives the worker's ``--engine sim`` and the
gateway's fleet simulator.

The model of one continuous-batching step (vLLM's scheduler: every running decode gets one
token, prefills fill the rest of the token budget, chunked)::

    step = overhead [+ prefill_overhead when the step prefills] + prefill_token * N
           + attn * pairs + decode_seq * B + decode_ctx * C
           + KV loads of requests starting this step + KV stores of chunks computed this step

- ``N``: prefill tokens computed in the step; ``pairs``: their attention work, the sum over
  prefill chunks of ``n * (m + n / 2)`` for ``n`` new tokens after ``m`` already in the sequence
  (causal attention);
- ``B``: decoding sequences; ``C``: their context lengths summed (decode reads their KV);
- a load moves ``tokens * kv_bytes_per_token`` over the tier's link (``latency + bytes / GB/s``;
  device hits are free), a store of newly computed chunks to DDR over the ``store`` link;
- every request also pays ``request_s`` before it can be scheduled (the API server's own time:
  parsing, tokenizing, queueing).

Pure: parsing and arithmetic only; reading the bundled files is :func:`bundled_profile`'s one
``importlib.resources`` read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import msgspec

__all__ = [
    "Link",
    "ModelShape",
    "PerfProfile",
    "ProfileError",
    "Source",
    "StepModel",
    "bundled_profile",
    "bundled_profiles",
    "parse_profile",
]

GIB = 1024**3
_DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}


class ProfileError(ValueError):
    """A profile file is not valid; the message names the field."""


class Source(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a number comes from: what was measured, by whom, where it is published."""

    what: str
    where: str
    value: str = ""


class ModelShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The model (and parallelism) a profile's numbers were measured on."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bfloat16"
    tensor_parallel_size: int = 1

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer and KV head, all TP ranks together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(self.kv_dtype)


class StepModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Coefficients of one engine step (seconds); see the module docstring."""

    overhead_s: float
    prefill_token_s: float
    attn_s: float
    decode_seq_s: float
    decode_ctx_s: float
    prefill_overhead_s: float = 0.0

    def step_s(self, prefill_tokens: int, pairs: float, decodes: int, decode_ctx: int) -> float:
        """Compute time of a step (without KV loads and stores)."""
        if prefill_tokens <= 0 and decodes <= 0:
            return 0.0
        t = self.overhead_s + self.decode_seq_s * decodes + self.decode_ctx_s * decode_ctx
        if prefill_tokens > 0:
            t += self.prefill_overhead_s + self.prefill_token_s * prefill_tokens
            t += self.attn_s * pairs
        return t


class Link(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A path KV moves over: fixed latency per transfer plus bytes at a bandwidth."""

    gbps: float
    latency_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9) if nbytes > 0 else 0.0


class _ProfileFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    chip: str
    engine: str
    sources: list[Source]
    model: ModelShape
    step: StepModel
    request_s: float
    load: dict[str, Link]
    store: Link
    device_kv_gib: float
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16
    fit: dict[str, Any] = msgspec.field(default_factory=dict)


@dataclass(frozen=True)
class PerfProfile:
    """A validated profile. ``load`` maps a tier class (``ddr``, ``disk``, ``p2p``, ``remote``)
    to its link into device memory; ``fit`` records how the numbers were derived."""

    name: str
    description: str
    chip: str
    engine: str
    sources: tuple[Source, ...]
    model: ModelShape
    step: StepModel
    request_s: float
    load: dict[str, Link]
    store: Link
    device_kv_gib: float
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    fit: dict[str, Any]

    def load_s(self, tier: str, nbytes: float) -> float:
        """Seconds to bring ``nbytes`` of KV from ``tier`` into device memory (device: 0)."""
        if tier == "device":
            return 0.0
        return self.load[tier].seconds(nbytes)

    def store_s(self, nbytes: float) -> float:
        return self.store.seconds(nbytes)

    def device_blocks(self, kv_bytes_per_token: int, block_size: int) -> int:
        """Blocks of KV the device holds for a model with ``kv_bytes_per_token``."""
        return int(self.device_kv_gib * GIB // (kv_bytes_per_token * block_size))

    def to_json(self) -> str:
        raw = msgspec.to_builtins(
            _ProfileFile(
                name=self.name,
                description=self.description,
                chip=self.chip,
                engine=self.engine,
                sources=list(self.sources),
                model=self.model,
                step=self.step,
                request_s=self.request_s,
                load=dict(self.load),
                store=self.store,
                device_kv_gib=self.device_kv_gib,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                block_size=self.block_size,
                fit=dict(self.fit),
            )
        )
        return json.dumps(raw, indent=2) + "\n"


REQUIRED_TIERS = ("ddr", "disk", "p2p", "remote")


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ProfileError(
            f"kv_dtype: {dtype!r} is not one of {', '.join(sorted(_DTYPE_BYTES))}"
        ) from None


def parse_profile(text: str | bytes, source: str = "profile") -> PerfProfile:
    """Validate a profile file's JSON; every problem names its field."""
    try:
        raw = msgspec.json.decode(text, type=_ProfileFile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{source}: not valid JSON: {exc}") from None
    problems: list[str] = []
    missing = [t for t in REQUIRED_TIERS if t not in raw.load]
    if missing:
        problems.append(f"load: needs a link for {', '.join(missing)}")
    links = {f"load.{k}": v for k, v in raw.load.items()} | {"store": raw.store}
    for where, link in links.items():
        if link.gbps <= 0 or link.latency_s < 0:
            problems.append(f"{where}: gbps must be > 0 and latency_s >= 0")
    for name in ("overhead_s", "prefill_token_s", "attn_s", "decode_seq_s", "decode_ctx_s"):
        if getattr(raw.step, name) < 0:
            problems.append(f"step.{name}: must be >= 0")
    if raw.step.overhead_s <= 0:
        problems.append("step.overhead_s: must be > 0 (every step costs something)")
    if raw.request_s < 0:
        problems.append("request_s: must be >= 0")
    if raw.device_kv_gib <= 0:
        problems.append("device_kv_gib: must be > 0")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(raw, name) < 1:
            problems.append(f"{name}: must be >= 1")
    if not raw.sources:
        problems.append("sources: cite where the numbers come from (at least one source)")
    try:
        raw.model.kv_bytes_per_token()
    except ProfileError as exc:
        problems.append(f"model.{exc}")
    if problems:
        raise ProfileError(f"{source}: " + "; ".join(problems))
    return PerfProfile(
        name=raw.name,
        description=raw.description,
        chip=raw.chip,
        engine=raw.engine,
        sources=tuple(raw.sources),
        model=raw.model,
        step=raw.step,
        request_s=raw.request_s,
        load=dict(raw.load),
        store=raw.store,
        device_kv_gib=raw.device_kv_gib,
        max_num_seqs=raw.max_num_seqs,
        max_num_batched_tokens=raw.max_num_batched_tokens,
        block_size=raw.block_size,
        fit=dict(raw.fit),
    )


_PROFILES = resources.files("kvpool.protocol") / "assets" / "profiles"


def bundled_profiles() -> list[str]:
    """Names of the profiles shipped with kvpool, sorted."""
    return sorted(p.name[: -len(".json")] for p in _PROFILES.iterdir() if p.name.endswith(".json"))


def bundled_profile(name: str) -> PerfProfile:
    """A profile shipped with kvpool, by name; ProfileError naming the choices otherwise."""
    path = _PROFILES / f"{name}.json"
    if not path.is_file():
        raise ProfileError(
            f"profile: no bundled profile named {name!r}; choose one of "
            f"{', '.join(bundled_profiles())} or give a profile file's path"
        )
    return parse_profile(path.read_bytes(), f"profile {name}")
