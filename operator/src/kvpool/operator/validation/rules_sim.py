"""The simulated engine's rules: what ``kvpool-worker serve --engine sim`` runs, and what not.

Why: the sim engine refuses at start what it does not model (a remote tier, PD, layerwise
stores, CacheBlend, TP > 1, a device too small for one request), and models KV as K and V per
KV head on CPUs. Each of those would be a pod that never becomes Ready, far from the field that
caused it; here they fail at `kubectl apply` naming the field and the fix.
"""

from __future__ import annotations

import math

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import sim
from kvpool.operator.derive.instances import engines
from kvpool.operator.validation.problems import Problem, key, remove_field, set_field, where

Members = list[P2PGroup | PDPair]


def _domain(pool: KVCachePool, members: Members) -> list[Problem]:
    """Pool settings a sim member cannot run with: a remote tier, an MLA model."""
    sims = sorted(key(m) for m in sim.sim_members(members) if isinstance(m, P2PGroup))
    if not sims:
        return []
    out: list[Problem] = []
    listed = ", ".join(sims)
    if pool.spec.tiers.remote is not None:
        out.append(
            Problem(
                where(pool, "spec.tiers.remote"),
                f"{listed} run the simulated engine, which models local tiers and P2P, not a "
                "remote store",
                "remove tiers.remote or use the reference engine (remove engine.sim)",
                code="sim.remote",
                patch=(remove_field(pool, "spec.tiers.remote"),),
            )
        )
    if pool.spec.model.mla:
        out.append(
            Problem(
                where(pool, "spec.model.mla"),
                f"{listed} run the simulated engine, which sizes KV as K and V per KV head; an "
                "MLA latent is not modelled (its KV bytes would be counted twice)",
                "set model.mla: false, or use the reference engine (remove engine.sim)",
                code="sim.mla",
                patch=(set_field(pool, "spec.model.mla", False),),
            )
        )
    return out


def _device(pool: KVCachePool, member: P2PGroup, path: str) -> list[Problem]:
    """The simulated device holds one longest request (the worker refuses it otherwise)."""
    spec = member.spec.engine
    assert spec.sim is not None
    have = sim.device_blocks(pool, spec.sim)
    need = sim.blocks_for(pool, spec.max_model_len)
    if have >= need:
        return []
    per_block = sim.kv_bytes_per_token(pool) * pool.spec.block_size
    gib = math.ceil(need * per_block / sim.GIB)
    field = f"{path}.sim.deviceKVGiB"
    return [
        Problem(
            where(member, field),
            f"{sim.limits(spec.sim).device_kv_gib} GiB of simulated device KV hold {have} blocks "
            f"of {pool.spec.block_size} tokens, fewer than the {need} one request of "
            f"maxModelLen {spec.max_model_len} needs: the simulated worker refuses to start",
            f"set {field.removeprefix('spec.')}: {gib}, or lower {path}.maxModelLen",
            code="sim.device",
            patch=(set_field(member, field, gib),),
        )
    ]


def rule_sim(pool: KVCachePool, members: Members) -> list[Problem]:
    """engine.sim: platform cpu, a P2PGroup (no PD), TP 1, no remote tier, no MLA, no
    layerwise stores or CacheBlend, and a simulated device that holds one request."""
    out = _domain(pool, members)
    for member in members:
        for path, engine, tp in engines(member):
            if engine.sim is None:
                continue
            if isinstance(member, PDPair):
                out.append(
                    Problem(
                        where(member, f"{path}.sim"),
                        "PD transfers are not simulated",
                        f"remove {path.removeprefix('spec.')}.sim (run the PDPair with the "
                        "reference engine on cpu, or vLLM), or simulate P2PGroups only",
                        code="sim.pd",
                        patch=(remove_field(member, f"{path}.sim"),),
                    )
                )
                continue
            if engine.platform != "cpu":
                out.append(
                    Problem(
                        where(member, f"{path}.platform"),
                        f"a sim engine runs on CPUs, not {engine.platform}: the profile "
                        f"{engine.sim.profile} names the simulated chip",
                        "set engine.platform: cpu",
                        code="sim.platform",
                        patch=(set_field(member, f"{path}.platform", "cpu"),),
                    )
                )
            if tp != 1:
                out.append(
                    Problem(
                        where(member, "spec.tensorParallelSize"),
                        f"is {tp}; the simulated engine is one LMCache worker whose profile "
                        "times the whole instance (the worker refuses TP > 1)",
                        "set tensorParallelSize: 1",
                        code="sim.tp",
                        patch=(set_field(member, "spec.tensorParallelSize", 1),),
                    )
                )
            if member.spec.use_layerwise and not member.spec.p2p:  # with P2P: rule 8 says so
                out.append(
                    Problem(
                        where(member, "spec.useLayerwise"),
                        "layerwise stores are not simulated (the profile times whole-chunk "
                        "stores; the worker refuses use_layerwise)",
                        "set useLayerwise: false",
                        code="sim.layerwise",
                        patch=(set_field(member, "spec.useLayerwise", False),),
                    )
                )
            if engine.lmcache_overrides.get("enable_blending"):
                field = f"{path}.lmcacheOverrides.enable_blending"
                out.append(
                    Problem(
                        where(member, field),
                        "CacheBlend is not simulated (the worker refuses enable_blending)",
                        f"remove lmcacheOverrides.enable_blending, or remove {path}.sim",
                        code="sim.blending",
                        patch=(remove_field(member, field),),
                    )
                )
            out += _device(pool, member, path)
    return out


__all__ = ["rule_sim"]
