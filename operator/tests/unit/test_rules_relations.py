"""Relations between model, chunk, block, TP, PD mode and buffer device that LMCache or vLLM
require: each refused with the field and the fix, each valid neighbour accepted."""

from __future__ import annotations

from op_builders import p2p, pd, pool

from kvpool.operator.api import KVCachePool, P2PGroup, PDPair
from kvpool.operator.render import render_domain
from kvpool.operator.validation import Problem, validate_domain


def _code(the_pool: KVCachePool, *members: P2PGroup | PDPair, code: str) -> list[Problem]:
    return [p for p in validate_domain(the_pool, list(members)) if p.code == code]


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    (problem,) = _code(pool(chunkSize=200, blockSize=128), code="chunk.block")
    assert problem.path == "KVCachePool/pool: spec.chunkSize"
    assert "not a multiple of blockSize 128" in problem.message
    assert problem.fix.startswith("set chunkSize: 256")
    assert _code(pool(chunkSize=256, blockSize=64), code="chunk.block") == []


def test_kv_heads_must_split_over_tp_except_for_mla() -> None:
    (problem,) = _code(pool(), p2p(tensorParallelSize=3), code="tp.heads")
    assert problem.path == "P2PGroup/grp: spec.tensorParallelSize"
    assert "8 KV heads do not split evenly over 3 TP ranks" in problem.message
    assert problem.fix == "set tensorParallelSize: 2"
    pair = pd(decode={"tensorParallelSize": 3})
    assert [p.path for p in _code(pool(), pair, code="tp.heads")] == [
        "PDPair/pair: spec.decode.tensorParallelSize"
    ]
    # TP a multiple of the KV heads replicates them; MLA has one latent, never split.
    assert _code(pool(model={"numKvHeads": 2}), p2p(tensorParallelSize=4), code="tp.heads") == []
    mla = pool(model={"mla": True, "numKvHeads": 1})
    assert _code(mla, p2p(tensorParallelSize=3), code="tp.heads") == []


def test_pd_sides_need_one_tp_size() -> None:
    pair = pd(prefill={"tensorParallelSize": 4}, decode={"tensorParallelSize": 2})
    (problem,) = _code(pool(), pair, code="pd.tp")
    assert problem.path == "PDPair/pair: spec.decode.tensorParallelSize"
    assert "pd_peer_init_port[rank]" in problem.message
    assert problem.fix == "set decode.tensorParallelSize: 4"


def test_pd_buffer_device_follows_platform_and_mode() -> None:
    cuda = {"engine": {"platform": "cuda"}}
    bad = pd(prefill=cuda, decode=cuda, transfer={"mode": "push", "bufferDevice": "npu"})
    (problem,) = _code(pool(), bad, code="pd.device")
    assert problem.message == "pd_buffer_device npu cannot be allocated on platform cuda"
    ok = pd(prefill=cuda, decode=cuda, transfer={"mode": "push", "bufferDevice": "cpu"})
    assert _code(pool(), ok, code="pd.device") == []
    offload = pd(transfer={"mode": "cpu-offload-pull-delay", "bufferDevice": "cpu"})
    (problem,) = _code(pool(), offload, code="pd.mode-device")
    assert problem.severity == "error" and problem.fix == "set transfer.bufferDevice: npu"
    delay = pd(transfer={"mode": "pull-delay", "bufferDevice": "cpu"})
    assert [p.severity for p in _code(pool(), delay, code="pd.mode-device")] == ["warning"]


def test_mla_needs_naive_serde() -> None:
    the_pool = pool(
        model={"mla": True, "numKvHeads": 1},
        tiers={"remote": {"redis": {"url": "redis://r:6379"}, "serde": "cachegen"}},
    )
    (problem,) = _code(the_pool, code="mla.serde")
    assert problem.path == "KVCachePool/pool: spec.tiers.remote.serde"
    assert problem.fix.startswith("set tiers.remote.serde: naive")


def test_two_pd_pairs_never_share_a_proxy_port() -> None:
    problems = _code(pool(), pd("a"), pd("b", ports={"base": 31000}), code="ports.proxy")
    assert [(p.path, p.fix) for p in problems] == [
        ("PDPair/b: spec.proxy.port", "set proxy.port: 7501")
    ]


def test_unparseable_engine_memory_is_refused_not_a_traceback() -> None:
    group = p2p(engine={"resources": {"requests": {"memory": "500m"}}})
    (problem,) = _code(pool(), group, code="engine.memory")
    assert problem.path == "P2PGroup/grp: spec.engine.resources.requests.memory"


def test_override_values_lmcache_refuses_are_refused_here() -> None:
    bad = pd(
        decode={
            "engine": {
                "platform": "ascend",
                "lmcacheOverrides": {"store_location": "PDBackend", "pd_backend_mode": "fast"},
            }
        }
    )
    problems = _code(pool(), bad, code="override.value")
    assert sorted(p.path.rsplit(".", 1)[1] for p in problems) == [
        "pd_backend_mode",
        "store_location",
    ]
    ok = p2p(engine={"lmcacheOverrides": {"min_retrieve_tokens": 64, "pd_backend_mode": "async"}})
    assert _code(pool(), ok, code="override.value") == []


def test_a_domain_never_mixes_vllm_and_reference_engines() -> None:
    """vLLM seeds LMCache's NONE_HASH from PYTHONHASHSEED, the reference engine does not."""
    cpu = p2p("a", engine={"platform": "cpu"}, transfer={}, enableAsyncLoading=True)
    (problem,) = _code(pool(), cpu, p2p("b", ports={"base": 21000}), code="domain.hashing")
    assert problem.path == "P2PGroup/b: spec.engine.platform"
    assert "never share KV" in problem.message
    assert problem.fix.startswith("set engine.platform: cpu")
    assert _code(pool(), p2p("a"), pd(), code="domain.hashing") == []


def test_the_controller_hashes_like_the_engines() -> None:
    def controller_command(*members: P2PGroup | PDPair) -> list[str]:
        objects = render_domain(pool(), list(members))
        deployment = next(
            o
            for o in objects
            if o["metadata"]["name"] == "pool-controller" and o["kind"] == "Deployment"
        )
        command: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        return command

    assert "--vllm" in controller_command(p2p())
    cpu = p2p(engine={"platform": "cpu"}, transfer={}, enableAsyncLoading=True)
    assert "--vllm" not in controller_command(cpu)


def test_controller_ports_are_distinct() -> None:
    (problem,) = _code(pool(controller={"ports": {"reply": 8300}}), code="controller.ports")
    assert problem.path == "KVCachePool/pool: spec.controller.ports.reply"
    assert "also the controller's pull port" in problem.message
    assert problem.fix == "set controller.ports.reply: 8301"
    assert _code(pool(), code="controller.ports") == []


def test_the_reference_engine_keeps_kv_in_float_dtypes_only() -> None:
    cpu = p2p(engine={"platform": "cpu"}, transfer={}, enableAsyncLoading=True)
    (problem,) = _code(pool(model={"kvDtype": "int8"}), cpu, code="kv-dtype.reference")
    assert problem.path == "KVCachePool/pool: spec.model.kvDtype"
    assert _code(pool(model={"kvDtype": "float32"}), cpu, code="kv-dtype.reference") == []
    assert _code(pool(model={"kvDtype": "int8"}), p2p(), code="kv-dtype.reference") == []
