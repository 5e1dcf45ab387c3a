"""Domain-wide rules: one seed and fingerprint (rule 1), the pool's own settings, and the
relations between model, chunk, block and TP size that LMCache and vLLM require.

Why: each is a way a deployment breaks only at run time (a connector refusing its chunk size,
vLLM refusing a TP size its KV heads cannot split over, an instance that never shares KV
because its block size forks the fingerprint); here they fail at `kubectl apply`.
"""

from __future__ import annotations

import math

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.instances import engines
from kvpool.operator.derive.ownership import owned_engine_flags
from kvpool.operator.derive.platform import member_platforms
from kvpool.operator.quantity import parse_quantity
from kvpool.operator.validation.problems import Problem, key, remove_field, set_field, where
from kvpool.protocol.domain import MAX_HASH_SEED, REFERENCE_ENGINE_KV_DTYPES

Members = list[P2PGroup | PDPair]

#: Where a person sets what an owned engine flag would set (fix text only, not the ownership).
_FLAG_FIELDS = {
    "--block-size": "the pool's blockSize",
    "--max-model-len": "engine.maxModelLen",
    "--tensor-parallel-size": "tensorParallelSize",
    "--model": "the pool's model.name",
    "--served-model-name": "the pool's model.name",
    "--dtype": "the pool's model.kvDtype",
    "--kv-cache-dtype": "the pool's model.kvDtype",
    "--port": "ports.base (kvpool allocates every port)",
    "--host": "nothing (workers listen on the pod network)",
    "--sim-profile": "engine.sim.profile",
    "--sim-speedup": "engine.sim.speedup",
    "--sim-device-kv-gib": "engine.sim.deviceKVGiB",
    "--max-num-seqs": "engine.sim.maxNumSeqs",
    "--max-num-batched-tokens": "engine.sim.maxNumBatchedTokens",
    "--num-layers": "the pool's model.numLayers",
    "--num-kv-heads": "the pool's model.numKvHeads",
    "--head-dim": "the pool's model.headDim",
    "--kv-events-config": "engine.kvEvents (kvpool allocates its ports per instance)",
}


def _without_flag(args: list[str], flag: str) -> list[str]:
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == flag:
            following = args[i + 1] if i + 1 < len(args) else "--"
            skip = not following.startswith("--")
            continue
        if arg.startswith(f"{flag}="):
            continue
        out.append(arg)
    return out


def rule1_domain(pool: KVCachePool, members: Members) -> list[Problem]:
    """One PYTHONHASHSEED and one fingerprint (seed, chunk, hash, model, dtype, block size);
    no engine flag that kvpool sets itself."""
    out: list[Problem] = []
    seed = pool.spec.hash_seed
    if seed != "auto" and int(seed) > MAX_HASH_SEED:
        out.append(
            Problem(
                where(pool, "spec.hashSeed"),
                f"PYTHONHASHSEED {seed} is out of range: Python accepts 0..{MAX_HASH_SEED}",
                f"set hashSeed: auto, or an integer in 0..{MAX_HASH_SEED} (the value itself "
                "does not matter, only that every process shares it)",
                rule=1,
                code="seed.range",
                patch=(set_field(pool, "spec.hashSeed", "auto"),),
            )
        )
    out += _hashing(members)
    for member in members:
        if member.spec.pool_ref.name != pool.metadata.name:
            out.append(
                Problem(
                    where(member, "spec.poolRef.name"),
                    f"names pool {member.spec.pool_ref.name!r}, not {pool.metadata.name!r}",
                    f"set poolRef.name: {pool.metadata.name}, or validate the member together "
                    "with the KVCachePool it names",
                    rule=1,
                    code="pool.ref",
                    patch=(set_field(member, "spec.poolRef.name", pool.metadata.name),),
                )
            )
        for path, engine, _ in engines(member):
            if engine.block_size is not None and engine.block_size != pool.spec.block_size:
                out.append(
                    Problem(
                        where(member, f"{path}.blockSize"),
                        f"block size {engine.block_size} differs from the pool's "
                        f"{pool.spec.block_size}; the block size is part of the domain "
                        "fingerprint, so this instance would never share KV",
                        f"remove it (the pool's blockSize applies) or set it to "
                        f"{pool.spec.block_size}",
                        rule=1,
                        code="engine.block-size",
                        patch=(remove_field(member, f"{path}.blockSize"),),
                    )
                )
            owned = owned_engine_flags(sim=engine.sim is not None)
            for flag in sorted({a.split("=", 1)[0] for a in engine.args} & owned):
                hint = _FLAG_FIELDS.get(flag, "the field kvpool derives it from")
                out.append(
                    Problem(
                        where(member, f"{path}.args"),
                        f"{flag} is set by kvpool on every worker (derived from the pool and "
                        "member spec)",
                        f"remove {flag} from {path}.args; set it through {hint}",
                        rule=1,
                        code=f"engine.owned-flag{flag}",
                        patch=(
                            set_field(member, f"{path}.args", _without_flag(engine.args, flag)),
                        ),
                    )
                )
    return out


def kv_events(pool: KVCachePool, members: Members) -> list[Problem]:
    """engine.kvEvents needs an engine that publishes vLLM's KV events: vLLM or engine.sim."""
    out: list[Problem] = []
    for member in members:
        for path, engine, _ in engines(member):
            if not engine.kv_events or engine.platform != "cpu" or engine.sim is not None:
                continue
            field = f"{path}.kvEvents"
            out.append(
                Problem(
                    where(member, field),
                    "kvpool's reference engine (platform cpu without engine.sim) publishes no "
                    "vLLM KV events, so no router would learn what its instances hold",
                    f"remove {field.removeprefix('spec.')}, or run the simulated engine "
                    f"({path.removeprefix('spec.')}.sim) or vLLM (platform ascend or cuda)",
                    code="engine.kv-events",
                    patch=(remove_field(member, field),),
                )
            )
    return out


def _hashing(members: Members) -> list[Problem]:
    """vLLM engines (ascend, cuda) and the reference engine (cpu) hash chunks differently
    (LMCache's NONE_HASH seeded from PYTHONHASHSEED or not): one domain, one kind."""
    ordered = sorted(members, key=lambda m: (m.kind, m.metadata.name))
    if not ordered:
        return []
    first = ordered[0]
    want = member_platforms(first)[0]
    vllm = want != "cpu"
    out: list[Problem] = []
    for member in ordered[1:]:
        if all((p != "cpu") == vllm for p in member_platforms(member)):
            continue
        paths = [path for path, _, _ in engines(member)]
        out.append(
            Problem(
                where(member, f"{paths[0]}.platform"),
                f"{key(first)} runs {'vLLM' if vllm else 'the reference engine'} (platform "
                f"{want}) and this member "
                f"{'the reference engine (platform cpu)' if vllm else 'vLLM'}: their chunk hashes "
                "differ (vLLM seeds LMCache's NONE_HASH from PYTHONHASHSEED), so they would "
                "never share KV in one domain",
                f"set {', '.join(p.removeprefix('spec.') for p in paths)}.platform: {want}, or "
                "put this member in a pool of its own",
                rule=1,
                code="domain.hashing",
                patch=tuple(set_field(member, f"{path}.platform", want) for path in paths),
            )
        )
    return out


def _controller_ports(pool: KVCachePool) -> list[Problem]:
    """The controller binds each of its ports once: two equal ones fail at start."""
    ports = pool.spec.controller.ports.model_dump(by_alias=True)
    out: list[Problem] = []
    seen: dict[int, str] = {}
    used = set(ports.values())
    for name, port in ports.items():
        if port not in seen:
            seen[port] = name
            continue
        free = next(p for p in range(port + 1, 65536) if p not in used)
        used.add(free)
        out.append(
            Problem(
                where(pool, f"spec.controller.ports.{name}"),
                f"port {port} is also the controller's {seen[port]} port: the controller "
                "cannot bind both",
                f"set controller.ports.{name}: {free}",
                rule=2,
                code="controller.ports",
                patch=(set_field(pool, f"spec.controller.ports.{name}", free),),
            )
        )
    return out


def pool_checks(pool: KVCachePool, members: Members) -> list[Problem]:
    """The pool's own settings: one remote tier, persistence and its URL."""
    out: list[Problem] = []
    remote = pool.spec.tiers.remote
    if remote is not None and (remote.mooncake is None) == (remote.redis is None):
        keep, drop = ("mooncake", "redis") if remote.mooncake is not None else ("", "remote")
        out.append(
            Problem(
                where(pool, "spec.tiers.remote"),
                "set exactly one remote tier (mooncake or redis)",
                "keep one of tiers.remote.mooncake and tiers.remote.redis"
                if keep
                else "remove tiers.remote, or add tiers.remote.redis or .mooncake",
                code="tiers.remote",
                patch=(
                    remove_field(pool, f"spec.tiers.remote.{drop}")
                    if keep
                    else remove_field(pool, "spec.tiers.remote"),
                ),
            )
        )
    out += _controller_ports(pool)
    persistence = pool.spec.controller.persistence
    if persistence.mode == "redis" and not persistence.redis_url:
        out.append(
            Problem(
                where(pool, "spec.controller.persistence.redisUrl"),
                "persistence mode redis needs a Redis URL",
                "use mode: full-sync, or set redisUrl (e.g. redis://kv-redis:6379/0)",
                code="persistence.url",
                patch=(set_field(pool, "spec.controller.persistence.mode", "full-sync"),),
            )
        )
    if persistence.mode != "redis" and persistence.redis_url:
        out.append(
            Problem(
                where(pool, "spec.controller.persistence.redisUrl"),
                f"a Redis URL is set but persistence mode is {persistence.mode}: the controller "
                "would refuse to start (it writes to Redis only in mode redis)",
                "set mode: redis to persist the index in Redis, or remove redisUrl",
                code="persistence.mode",
                patch=(set_field(pool, "spec.controller.persistence.mode", "redis"),),
            )
        )
    return out


def _tp_that_splits(heads: int, tp: int) -> int:
    """The largest TP size <= ``tp`` over which vLLM can split (or replicate) ``heads``."""
    return max(d for d in range(1, tp + 1) if heads % d == 0 or d % heads == 0)


def model_relations(pool: KVCachePool, members: Members) -> list[Problem]:
    """Chunk vs block size, KV heads vs TP (MLA exempt), MLA vs serde, engine memory."""
    out = _chunk_block(pool) + _reference_dtype(pool, members) + _mla(pool)
    for member in members:
        out += _member_engines(pool, member)
    return out


def _chunk_block(pool: KVCachePool) -> list[Problem]:
    """The chunk size a multiple of the vLLM block size."""
    spec = pool.spec
    if not spec.chunk_size % spec.block_size:
        return []
    fixed = math.ceil(spec.chunk_size / spec.block_size) * spec.block_size
    return [
        Problem(
            where(pool, "spec.chunkSize"),
            f"chunk size {spec.chunk_size} is not a multiple of blockSize "
            f"{spec.block_size}: LMCache stores whole vLLM blocks per chunk and its vLLM "
            "connector refuses this chunk size",
            f"set chunkSize: {fixed} (a multiple of blockSize {spec.block_size}), or a "
            "blockSize that divides chunkSize",
            code="chunk.block",
            patch=(set_field(pool, "spec.chunkSize", fixed),),
        )
    ]


def _reference_dtype(pool: KVCachePool, members: Members) -> list[Problem]:
    """A KV dtype the reference engine keeps, when a member runs it."""
    kv_dtype = pool.spec.model.kv_dtype
    cpu = sorted(
        key(m)
        for m in members
        if any(e.platform == "cpu" and e.sim is None for _, e, _ in engines(m))
    )  # the simulated engine only counts KV bytes: every dtype of the API is fine for it
    if not cpu or kv_dtype in REFERENCE_ENGINE_KV_DTYPES:
        return []
    return [
        Problem(
            where(pool, "spec.model.kvDtype"),
            f"{', '.join(cpu)} run kvpool's reference engine (platform cpu), which keeps KV "
            f"in {', '.join(REFERENCE_ENGINE_KV_DTYPES)} only, not {kv_dtype}",
            "set model.kvDtype: bfloat16 (or float16, float32)",
            code="kv-dtype.reference",
            patch=(set_field(pool, "spec.model.kvDtype", "bfloat16"),),
        )
    ]


def _mla(pool: KVCachePool) -> list[Problem]:
    """An MLA model: naive serde on the remote tier, one latent (not KV heads) per token."""
    out: list[Problem] = []
    model, remote = pool.spec.model, pool.spec.tiers.remote
    if model.mla and remote is not None and remote.serde != "naive":
        out.append(
            Problem(
                where(pool, "spec.tiers.remote.serde"),
                f"MLA models work only with naive serde in LMCache (it raises ValueError for "
                f"{remote.serde})",
                "set tiers.remote.serde: naive, or model.mla: false if the model is not MLA",
                code="mla.serde",
                patch=(set_field(pool, "spec.tiers.remote.serde", "naive"),),
            )
        )
    if model.mla and model.num_kv_heads != 1:
        out.append(
            Problem(
                where(pool, "spec.model.numKvHeads"),
                f"an MLA model stores one latent per token, not {model.num_kv_heads} KV heads; "
                "kvpool sizes its KV from headDim alone",
                "set numKvHeads: 1 (and headDim to latent + rope dimension)",
                severity="warning",
                code="mla.heads",
                patch=(set_field(pool, "spec.model.numKvHeads", 1),),
            )
        )
    return out


def _member_engines(pool: KVCachePool, member: P2PGroup | PDPair) -> list[Problem]:
    """Each engine of a member: KV heads that split over its TP size, memory kvpool can add to."""
    out: list[Problem] = []
    model = pool.spec.model
    for path, engine, tp in engines(member):
        tp_field = path.removesuffix("engine") + "tensorParallelSize"
        heads = model.num_kv_heads
        if not model.mla and heads % tp and tp % heads:
            fixed_tp = _tp_that_splits(heads, tp)
            out.append(
                Problem(
                    where(member, tp_field),
                    f"{heads} KV heads do not split evenly over {tp} TP ranks: vLLM needs "
                    "numKvHeads divisible by the TP size (or the TP size a multiple of "
                    "numKvHeads, replicating heads)",
                    f"set {tp_field.removeprefix('spec.')}: {fixed_tp}",
                    code="tp.heads",
                    patch=(set_field(member, tp_field, fixed_tp),),
                )
            )
        for table in ("requests", "limits"):
            value = getattr(engine.resources, table).get("memory")
            if value is None:
                continue
            try:
                parse_quantity(value)
            except ValueError as exc:
                field = f"{path}.resources.{table}.memory"
                out.append(
                    Problem(
                        where(member, field),
                        f"{exc}; kvpool adds LMCache's host memory to it",
                        "write it in bytes or with a binary suffix (e.g. 8Gi), or remove it",
                        code="engine.memory",
                        patch=(remove_field(member, field),),
                    )
                )
    return out
