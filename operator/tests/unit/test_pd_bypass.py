"""``spec.gateway.pd.bypassMinCachedRatio``: the gateway's PD bypass and what it renders.

Why: the gateway can send a request straight to a decoder only if that decoder keeps what it
decoded and the controller's index knows it. So turning the bypass on gives each decoder of a
platform cpu PDPair the pool's CPU tier and a controller registration (its worker ports at the
end of its block, which nothing else binds), counts that tier in its memory budget, and puts
the ratio on the pair in gateway.yaml (a live key: the gateway is not restarted). Off (the
default) renders exactly what it did before. A ratio out of [0, 1] is refused naming the field;
a decoder block without room for its worker ports is refused with a fix that works; a vLLM pair
(its PD consumer keeps nothing) is warned about and left as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from op_builders import pd, pool

from kvpool.operator import figures as fig
from kvpool.operator.api import KVCachePool, PDPair
from kvpool.operator.derive.ports import pd_ports
from kvpool.operator.loader import load_text
from kvpool.operator.render import lmcache_configs, render_domain
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.operator.validation import memory_budgets, validate_domain
from kvpool.operator.validation.problems import apply_patches
from kvpool.protocol.domain import instance_id
from kvpool.protocol.gateway_config import LIVE_KEYS
from kvpool.protocol.http_api import stats_reply

CPU = {"engine": {"platform": "cpu"}}


def _cpu_pd(decode_tp: int = 1) -> PDPair:
    return pd(
        prefill={"tensorParallelSize": 1, **CPU},
        decode={"tensorParallelSize": decode_tp, **CPU},
        transfer={"mode": "push", "bufferSize": "128Mi"},
    )


def _bypass(ratio: float | None = 0.5) -> KVCachePool:
    return pool(tiers={"cpu": {"size": "512Mi"}}, gateway={"pd": {"bypassMinCachedRatio": ratio}})


def _gateway_pairs(the_pool: KVCachePool, pair: PDPair) -> list[dict[str, Any]]:
    objects = render_domain(the_pool, [pair])
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith(
        "-gateway")]  # fmt: skip
    pairs: list[dict[str, Any]] = yaml.safe_load(cm["data"]["gateway.yaml"])["pdPairs"]
    return pairs


def test_off_by_default_renders_what_it_did() -> None:
    pair = _cpu_pd()
    for off in (pool(tiers={"cpu": {"size": "512Mi"}}), _bypass(None), _bypass(0)):
        for name, cfg in lmcache_configs(off, pair).items():
            assert cfg["local_cpu"] is False and "enable_controller" not in cfg, name
        assert "bypassMinCachedRatio" not in _gateway_pairs(off, pair)[0]
        assert "CPU cache" not in memory_budgets(off, [pair])["PDPair/pair"].formula


def test_on_the_decoders_keep_and_register_and_the_gateway_gets_the_ratio() -> None:
    the_pool, pair = _bypass(0.5), _cpu_pd()
    assert [p for p in validate_domain(the_pool, [pair]) if p.severity == "error"] == []
    configs = lmcache_configs(the_pool, pair)
    ports = {i.name: i for i in pd_ports(pair, sender_pull=False)}
    prefill, decode = ports["pair-prefill-0"], ports["pair-decode-0"]
    sender = configs["pair-prefill-0"]
    assert sender["local_cpu"] is False and "enable_controller" not in sender
    cfg = configs["pair-decode-0"]
    assert cfg["local_cpu"] is True and cfg["max_local_cpu_size"] == 0.5
    assert cfg["enable_controller"] is True
    assert cfg["controller_pull_url"].startswith("pool-controller.")
    (worker_port,) = cfg["lmcache_worker_ports"]
    # its own block's last port: no other port of the pair moves, none collides
    assert decode.http < worker_port < decode.http + 10
    assert worker_port not in decode.all_ports() + prefill.all_ports()
    assert cfg["pd_peer_init_port"] == decode.lists["pd_peer_init_port"]
    extra = cfg["extra_config"]
    assert "kvpool_pd_unclaimed_ttl_seconds" in extra  # the receiver's own key stays
    assert extra["worker_socket_recv_timeout_ms"] == 3000 and "full_sync_startup_delay_s" in extra
    (entry,) = _gateway_pairs(the_pool, pair)
    assert entry["bypassMinCachedRatio"] == 0.5 and "pdPairs" in LIVE_KEYS
    formula = memory_budgets(the_pool, [pair])["PDPair/pair"].formula
    assert "CPU cache" in formula


@pytest.mark.parametrize("ratio", [1.5, -0.1])
def test_a_ratio_out_of_range_is_refused_naming_the_field(ratio: float) -> None:
    doc = _bypass(0.5).model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["gateway"]["pd"]["bypassMinCachedRatio"] = ratio
    loaded = load_text(yaml.safe_dump(doc), "pool.yaml")
    assert loaded.errors, loaded
    text = " ".join(str(e) for e in loaded.errors)
    assert "gateway.pd.bypassMinCachedRatio" in text, text


def test_a_decoder_block_without_room_is_refused_with_a_fix_that_works() -> None:
    the_pool, pair = _bypass(0.5), _cpu_pd(decode_tp=4)  # 1 + 2x4 ports of 10: no room for 4
    problems = [p for p in validate_domain(the_pool, [pair]) if p.code == "pd.bypass_ports"]
    (problem,) = problems
    assert problem.severity == "error"
    assert problem.path == "KVCachePool/pool: spec.gateway.pd.bypassMinCachedRatio"
    fixed = KVCachePool.model_validate(
        apply_patches(the_pool.model_dump(by_alias=True, exclude_none=True), problem.patch)
    )
    assert not [p for p in validate_domain(fixed, [pair]) if p.code == "pd.bypass_ports"]


def test_a_vllm_pair_is_warned_about_and_left_as_it_was() -> None:
    the_pool, pair = _bypass(0.5), pd()  # the base pair: ascend (vLLM)
    (warning,) = [p for p in validate_domain(the_pool, [pair]) if p.code == "pd.bypass_vllm"]
    assert warning.severity == "warning" and "keeps no KV" in warning.message
    for cfg in lmcache_configs(the_pool, pair).values():
        assert cfg["local_cpu"] is False and "enable_controller" not in cfg
    assert "bypassMinCachedRatio" not in _gateway_pairs(the_pool, pair)[0]


def test_a_keeping_decoder_is_an_expected_registration_not_a_stranger() -> None:
    """The pool's live figures count the decoders that register for the bypass among the
    expected instances (not under unexpectedInstances); the prefill never registers."""
    the_pool, pair = _bypass(0.5), _cpu_pd()
    fp = pool_fingerprint(the_pool)
    body = stats_reply({instance_id("pair-decode-0", fp): 1}, 3, {"LocalCPUBackend": 3}, {}, {})
    reading = fig.Reading(controller=fig.read_controller(body), gateway=None, window=None)
    live = fig.pool_figures(the_pool, [pair], reading)
    assert (live.instances, live.instances_expected, live.unexpected_instances) == ("1/1", 1, [])
    off = fig.pool_figures(_bypass(None), [pair], reading)
    assert (off.instances_expected, off.unexpected_instances) == (
        0,
        [instance_id("pair-decode-0", fp)],
    )
