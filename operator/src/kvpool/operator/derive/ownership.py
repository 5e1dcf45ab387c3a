"""What kvpool owns in a worker: LMCache keys and engine flags, derived from what it renders.

Why: an override of a key kvpool sets (``lmcache_worker_heartbeat_time: 999`` against a
controller that purges after 60 s) silently breaks the domain. Instead of a hand-kept list,
the owned keys are the keys the LMCache config builders emit, over a set of probe domains that
takes every branch of the builders (each platform, each PD mode, every tier, HostStaging,
MLA); the owned flags are the flags of the rendered worker command plus the vLLM flags the
worker derives from them. A key the builders start emitting is owned from then on.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from kvpool.operator.api.members import SIM_PROFILES, P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.instances import (
    instances,
    member_instances,
    owned_flags,
    worker_command,
)
from kvpool.operator.derive.lmcache_config import p2p_config, pd_config
from kvpool.protocol.domain import WORKER_VLLM_FLAGS

_MODES = ("push", "pull-eager", "pull-delay", "cpu-offload-pull-delay")
_PLATFORMS = ("ascend", "cuda", "cpu")


def owned_configs(
    pool: KVCachePool, member: P2PGroup | PDPair, fingerprint: str
) -> dict[str, dict[str, Any]]:
    """kvpool's LMCache settings of every instance (no overrides), keyed by instance name."""
    out: dict[str, dict[str, Any]] = {}
    for inst in member_instances(member):
        if isinstance(member, P2PGroup):
            out[inst.name] = p2p_config(pool, member, inst, fingerprint)
        else:
            out[inst.name] = pd_config(pool, member, inst, fingerprint)
    return out


def _probe_pools() -> list[KVCachePool]:
    base: dict[str, Any] = {
        "metadata": {"name": "probe"},
        "spec": {"model": {"name": "m", "numLayers": 1, "numKvHeads": 1, "headDim": 1}},
    }
    tiers: list[dict[str, Any]] = [
        {"disk": {"path": "/d", "size": 1}, "remote": {"redis": {"url": "redis://r"}}},
        {"remote": {"mooncake": {"segmentSize": 1}}},
    ]
    return [
        KVCachePool.model_validate({**base, "spec": {**base["spec"], "tiers": t}}) for t in tiers
    ]


def _sim_probe() -> P2PGroup:
    """A simulated group setting every optional sim field (every sim flag is rendered)."""
    sim = {"profile": SIM_PROFILES[0], "deviceKVGiB": 1, "maxNumSeqs": 1, "maxNumBatchedTokens": 1}
    engine = {"platform": "cpu", "sim": sim, "kvEvents": True}
    spec = {"poolRef": {"name": "probe"}, "engine": engine}
    return P2PGroup.model_validate({"metadata": {"name": "s"}, "spec": spec})


def _probe_members() -> list[P2PGroup | PDPair]:
    out: list[P2PGroup | PDPair] = []
    for platform in _PLATFORMS:
        transfer: dict[str, Any] = {}
        if platform == "ascend":
            transfer = {
                "pullMode": True,
                "delayPull": True,
                "useNPU": True,
                "hostStaging": {"enabled": True},
            }
        spec: dict[str, Any] = {
            "poolRef": {"name": "probe"},
            "engine": {"platform": platform},
            "transfer": transfer,
            "cachePolicy": "LRU",
            "saveOnlyFirstRank": True,
        }
        out.append(P2PGroup.model_validate({"metadata": {"name": "p"}, "spec": spec}))
        for mode in _MODES:
            side = {"engine": {"platform": platform}}
            pd_spec = {
                "poolRef": {"name": "probe"},
                "prefill": side,
                "decode": side,
                "transfer": {"mode": mode},
            }
            out.append(PDPair.model_validate({"metadata": {"name": "d"}, "spec": pd_spec}))
    return out


@cache
def owned_lmcache_keys() -> frozenset[str]:
    """Every top-level LMCache key kvpool's config builders emit, in any configuration."""
    keys: set[str] = set()
    for pool in _probe_pools():
        for member in _probe_members():
            for cfg in owned_configs(pool, member, "0" * 12).values():
                keys.update(cfg)
    return frozenset(keys)


@cache
def owned_engine_flags(*, sim: bool = False) -> frozenset[str]:
    """Every flag kvpool puts on a worker's command line, plus the vLLM flags it derives;
    ``sim``: of a simulated engine (its own flags too: ``--max-num-seqs`` is kvpool's there,
    while a vLLM engine's args may set vLLM's)."""
    flags: set[str] = set(WORKER_VLLM_FLAGS)
    pool = _probe_pools()[0]
    for member in [*_probe_members(), *([_sim_probe()] if sim else [])]:
        for inst in instances(member):
            flags.update(owned_flags(worker_command(pool, inst)))
    return frozenset(flags)


def instance_configs(
    pool: KVCachePool, member: P2PGroup | PDPair, fingerprint: str
) -> dict[str, dict[str, Any]]:
    """The LMCache config of every instance: kvpool's settings plus the overrides of keys kvpool
    does not own (validation refuses the others; they are never applied)."""
    engines = {inst.name: inst.engine for inst in instances(member)}
    owned = owned_lmcache_keys()
    out: dict[str, dict[str, Any]] = {}
    for name, cfg in owned_configs(pool, member, fingerprint).items():
        merged = dict(cfg)
        for key, value in engines[name].lmcache_overrides.items():
            if key not in owned and key not in cfg:
                merged[key] = value
        out[name] = dict(sorted(merged.items()))
    return out
