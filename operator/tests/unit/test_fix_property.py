"""Every fix the validator suggests, applied as written, makes its problem go away.

Hypothesis builds domains out of the mistakes the rules exist for (wrong chunk/block/TP
relations, colliding ports and names, Ascend-only options elsewhere, owned overrides, small
buffers, pods larger than a node, ...). For each problem, its patch (the first alternative its
``fix`` text names, as data) is applied to the YAML documents; the patched documents must still
load, and the problem (same field path, same check) must be gone.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_builders import PD, POOL, merge

from kvpool.operator.api import KVCachePool
from kvpool.operator.loader import Loaded, LoadError, parse_document
from kvpool.operator.validation import Problem, apply_patches, validate_domain

#: Problems whose fix is a judgement a person makes (no single patch is "as written").
NO_PATCH_CODES = {"ports.overlap"}  # only when both members list explicit ports
MODES = ["push", "pull-eager", "pull-delay", "cpu-offload-pull-delay"]
SIM = "h100-llama-3.1-8b-vllm"


def _pool(draw: st.DrawFn) -> dict[str, Any]:
    remote = draw(
        st.sampled_from(
            [
                None,
                {"redis": {"url": "redis://r:6379"}},
                {"mooncake": {"segmentSize": "1Gi"}, "serde": "cachegen"},
                {"redis": {"url": "redis://r:6379"}, "serde": "kivi"},
                {"redis": {"url": "redis://r:6379"}, "mooncake": {"segmentSize": "1Gi"}},
            ]
        )
    )
    tiers: dict[str, Any] = {"cpu": {"size": draw(st.sampled_from(["1Gi", "16Gi"]))}}
    if remote is not None:
        tiers["remote"] = remote
    if draw(st.booleans()):
        tiers["disk"] = {"path": "/kv", "size": "10Gi"}
    persistence = draw(
        st.sampled_from(
            [
                {},
                {"mode": "redis"},
                {"mode": "full-sync", "redisUrl": "redis://r"},
                {"mode": "none"},
            ]
        )
    )
    spec: dict[str, Any] = {
        "model": {
            "numKvHeads": draw(st.sampled_from([1, 2, 6, 8])),
            "mla": draw(st.booleans()),
            "kvDtype": draw(st.sampled_from(["bfloat16", "int8"])),
        },
        "chunkSize": draw(st.sampled_from([64, 100, 256, 300])),
        "blockSize": draw(st.sampled_from([16, 48, 128])),
        "hashSeed": draw(st.sampled_from(["auto", "123", "4294967296"])),
        "tiers": tiers,
        "gateway": {"port": draw(st.sampled_from([8000, 7500]))},
        "controller": {
            "persistence": persistence,
            "ports": draw(st.sampled_from([{}, {"reply": 8300}, {"pub": 9000, "snapshot": 9000}])),
        },
    }
    allocatable = draw(st.sampled_from([None, "8Gi", "40Gi"]))
    if allocatable is not None:
        spec["nodeAllocatableMemory"] = allocatable
    return merge(POOL, {"spec": spec})


def _engine(draw: st.DrawFn, platform: str) -> dict[str, Any]:
    engine: dict[str, Any] = {"platform": platform}
    args = draw(st.sets(st.sampled_from(["--block-size=16", "--enforce-eager", "--dtype"])))
    if args:
        engine["args"] = sorted(args)
    overrides = draw(
        st.sets(
            st.sampled_from(
                [
                    "lmcache_worker_heartbeat_time",
                    "chunk_sise",
                    "store_async",
                    "remote_serde",
                    "enable_blending",
                ]
            )
        )
    )
    if overrides:
        engine["lmcacheOverrides"] = {k: 1 for k in sorted(overrides)}
    sim = draw(
        st.sampled_from([None, None, {"profile": SIM}, {"profile": SIM, "deviceKVGiB": 0.01}])
    )
    if sim is not None:  # kvpool's simulated engine (its own rules: cpu, TP 1, no PD, ...)
        engine["sim"] = sim
    choice = draw(st.sampled_from(["none", "block", "count", "resource", "memory", "bad-memory"]))
    if choice == "block":
        engine["blockSize"] = 16
    elif choice == "count":
        engine["acceleratorCount"] = 1
    elif choice == "resource":
        engine["acceleratorResource"] = ""
    elif choice in ("memory", "bad-memory"):
        engine["resources"] = {"requests": {"memory": "3Gi" if choice == "memory" else "500m"}}
    return engine


def _p2p(draw: st.DrawFn, name: str, base: int) -> dict[str, Any]:
    platform = draw(st.sampled_from(["ascend", "cuda", "cpu"]))
    transfer: dict[str, Any] = {
        "pullMode": draw(st.booleans()),
        "delayPull": draw(st.booleans()),
        "useNPU": draw(st.booleans()),
        "npuBufferSize": draw(st.sampled_from(["1Mi", "128Mi"])),
        "hostStaging": {
            "enabled": draw(st.booleans()),
            "bytes": draw(st.sampled_from(["1Mi", "8Gi"])),
            "expectedConcurrentRequests": 4,
            "expectedHitTokens": 8192,
        },
    }
    channel = draw(st.sampled_from([None, "hccl", "hixl", "nixl"]))
    if channel is not None:
        transfer["channel"] = channel
    spec: dict[str, Any] = {
        "poolRef": {"name": "pool"},
        "p2p": draw(st.booleans()),
        "replicas": draw(st.sampled_from([0, 1, 2])),
        "tensorParallelSize": draw(st.sampled_from([1, 2, 3, 4])),
        "engine": _engine(draw, platform),
        "transfer": transfer,
        "enableAsyncLoading": draw(st.booleans()),
        "saveOnlyFirstRank": draw(st.booleans()),
        "useLayerwise": draw(st.booleans()),
        "hostNetwork": draw(st.booleans()),
        "ports": {"base": base},
    }
    if draw(st.booleans()):
        spec["cachePolicy"] = "LRU"
    explicit = draw(st.sampled_from([None, "ok", "short", "reused"]))
    if explicit is not None:
        tp = spec["tensorParallelSize"]
        width = tp - 1 if explicit == "short" else tp
        spec["ports"]["instances"] = [
            {
                "http": 8010 + i,
                "workerPorts": [
                    9000 + (0 if explicit == "reused" else 100 * i) + r for r in range(width)
                ],
                "initPorts": [9030 + 100 * i + r for r in range(tp)],
                "lookupPorts": [9060 + 100 * i + r for r in range(tp)],
            }
            for i in range(draw(st.sampled_from([spec["replicas"], 1])))
        ]
    return {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "P2PGroup",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }


def _pd(draw: st.DrawFn, name: str, base: int) -> dict[str, Any]:
    platform = draw(st.sampled_from(["ascend", "cuda", "cpu"]))
    transfer: dict[str, Any] = {
        "mode": draw(
            st.sampled_from(["push", "pull-eager", "pull-delay", "cpu-offload-pull-delay"])
        ),
        "bufferSize": draw(st.sampled_from(["1Mi", "256Mi"])),
        "cpuBufferSize": draw(st.sampled_from(["1Mi", "20Gi"])),
    }
    device = draw(st.sampled_from([None, "npu", "cuda", "cpu"]))
    if device is not None:
        transfer["bufferDevice"] = device
    sides = {
        side: {
            "replicas": draw(st.sampled_from([0, 1])),
            "tensorParallelSize": draw(st.sampled_from([1, 2, 3])),
            "engine": _engine(draw, draw(st.sampled_from([platform, platform, "cuda"]))),
        }
        for side in ("prefill", "decode")
    }
    return merge(
        PD,
        {
            "metadata": {"name": name},
            "spec": {
                **sides,
                "transfer": transfer,
                "proxy": {"port": draw(st.sampled_from([7500, 8000]))},
                "hostNetwork": draw(st.booleans()),
                "ports": {"base": base},
                "useLayerwise": draw(st.booleans()),
            },
        },
    )


@st.composite
def domains(draw: st.DrawFn) -> list[dict[str, Any]]:
    docs = [_pool(draw)]
    bases = st.sampled_from([20000, 20010, 64990])
    names = ["grp", "grp-0", "pool-controller", "pair", "pair-prefill-0"]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    for name in chosen:
        build = _p2p if draw(st.booleans()) else _pd
        docs.append(build(draw, name, draw(bases)))
    return docs


def _validate(docs: list[dict[str, Any]]) -> list[Problem]:
    loaded = Loaded()
    for i, doc in enumerate(docs):
        parsed = parse_document(doc, f"doc#{i}")
        if isinstance(parsed, LoadError):
            loaded.errors.append(parsed)
        elif isinstance(parsed, KVCachePool):
            loaded.pools.append(parsed)
        else:
            loaded.members.append(parsed)
    domain_list = loaded.domains()
    assert not loaded.errors, [str(e) for e in loaded.errors]
    assert len(domain_list) == 1
    return validate_domain(domain_list[0].pool, domain_list[0].members)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(docs=domains())
def test_every_suggested_fix_makes_its_problem_go_away(docs: list[dict[str, Any]]) -> None:
    for problem in _validate(docs):
        if not problem.patch:
            assert problem.code.split(":")[0] in NO_PATCH_CODES, problem
            continue
        patched = [apply_patches(doc, problem.patch) for doc in docs]
        after = _validate(patched)
        same = [p for p in after if (p.path, p.code) == (problem.path, problem.code)]
        assert not same, f"fix {problem.fix!r} left {same[0]}"


def test_patches_are_data_a_person_can_read() -> None:
    """The patch of a known problem names the field and value its fix text names."""
    docs = [merge(POOL, {"spec": {"chunkSize": 100, "blockSize": 16}})]
    (problem,) = [p for p in _validate(docs) if p.code == "chunk.block"]
    assert problem.fix.startswith("set chunkSize: 112")
    assert problem.patch[0].field == ("spec", "chunkSize") and problem.patch[0].value == 112
