"""The pure half of live reconfiguration (kvpool.gateway.reconfig): what changed between two
gateway.yaml documents, and whether a running gateway may apply it."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.gateway.config import ConfigError, GatewayConfig, parse_config
from kvpool.gateway.reconfig import InstanceFacts, diff, instance_facts, router_for
from kvpool.protocol.gateway_config import LIVE_KEYS, restart_part


def doc(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "m",
        "chunkSize": 256,
        "controllerUrl": "http://ctl:9000",
        "p2pGroups": [
            {
                "name": "g",
                "instances": [
                    {"name": "a", "url": "http://a:1"},
                    {"name": "b", "url": "http://b:1"},
                ],
            }
        ],
    }
    base.update(over)
    return base


def cfg(**over: Any) -> GatewayConfig:
    return parse_config(doc(**over))


PAIR = {
    "name": "pd",
    "mode": "push",
    "proxyPort": 7000,
    "prefill": [{"name": "p0", "url": "http://p0:1"}],
    "decode": [
        {"name": "d0", "url": "http://d0:1", "host": "d0", "initPorts": [1], "allocPorts": [2]}
    ],
}


def test_the_same_document_and_written_out_defaults_change_nothing() -> None:
    assert diff(cfg(), cfg()).empty
    explicit = cfg(routing={"policy": "kv-aware", "weights": {"prefixHit": 1.0, "load": 1.0}})
    assert diff(cfg(), explicit).empty


def test_weights_and_policy_apply_live_with_a_new_router() -> None:
    change = diff(cfg(), cfg(routing={"policy": "least-load", "weights": {"load": 2.0}}))
    assert not change.needs_restart and change.routing and not change.empty
    assert "routing.policy: 'kv-aware' -> 'least-load'" in change.live
    assert "routing.weights.load: 1.0 -> 2.0" in change.live
    assert "routing.weights.load: 1.0 -> 2.0" in change.summary()
    assert router_for(cfg(routing={"policy": "least-load"})).policy.name == "least-load"


def test_guards_apply_live_with_a_new_router() -> None:
    change = diff(cfg(), cfg(guards={"imbalanceAbs": 3}))
    assert change.routing and not change.needs_restart
    assert change.live == ("guards.imbalanceAbs: 8 -> 3",)


def test_instances_added_removed_and_moved() -> None:
    group = {
        "name": "g",
        "instances": [
            {"name": "b", "url": "http://b-new:1"},  # moved: another URL under the old name
            {"name": "c", "url": "http://c:1"},
        ],
    }
    change = diff(cfg(), cfg(p2pGroups=[group]))
    assert (change.added, change.removed, change.moved) == (("c",), ("a",), ("b",))
    assert not change.routing and not change.needs_restart
    lines = change.summary()
    assert "instances added: c" in lines and "instances removed: a" in lines
    assert any(line.startswith("instances replaced") and line.endswith(": b") for line in lines)


def test_a_group_that_stops_pulling_moves_its_members() -> None:
    group = {**doc()["p2pGroups"][0], "p2p": False}
    change = diff(cfg(), cfg(p2pGroups=[group]))
    assert change.moved == ("a", "b") and not change.added and not change.removed


def test_pd_pairs_added_changed_removed() -> None:
    with_pair = cfg(pdPairs=[PAIR])
    assert diff(cfg(), with_pair).pd_added == ("pd",)
    assert diff(cfg(), with_pair).added == ("p0", "d0")
    assert diff(with_pair, cfg()).pd_removed == ("pd",)
    moved_port = cfg(pdPairs=[{**PAIR, "proxyPort": 7001}])
    change = diff(with_pair, moved_port)
    assert change.pd_changed == ("pd",) and not change.needs_restart


@pytest.mark.parametrize(
    ("over", "line"),
    [
        ({"chunkSize": 128}, "chunkSize: 256 -> 128"),
        ({"model": "other"}, "model: 'm' -> 'other'"),
        ({"vllm": True}, "vllm: False -> True"),
        ({"hashAlgorithm": "sha256_cbor"}, "hashAlgorithm: 'builtin' -> 'sha256_cbor'"),
        ({"tokenizer": "reference"}, "tokenizer: None -> 'reference'"),
        ({"controllerUrl": "http://ctl2:9000"}, "controllerUrl: 'http://ctl:9000' -> "),
        ({"limits": {"maxInflight": 3}}, "limits.maxInflight: 256 -> 3"),
    ],
)
def test_what_the_process_is_built_around_needs_a_restart_naming_the_key(
    over: dict[str, Any], line: str
) -> None:
    change = diff(cfg(), cfg(**over, routing={"weights": {"load": 2.0}}))
    assert change.needs_restart
    assert any(r.startswith(line) for r in change.restart), change.restart
    assert change.summary()[0].startswith("needs a restart: ")


def test_the_live_keys_are_keys_of_gateway_yaml() -> None:
    dumped = cfg().model_dump(by_alias=True)
    assert set(LIVE_KEYS) <= set(dumped)
    assert not set(restart_part(dumped)) & LIVE_KEYS
    assert set(restart_part(dumped)) | LIVE_KEYS == set(dumped)


def test_instance_facts_of_peers_and_pd_sides() -> None:
    facts = instance_facts(cfg(pdPairs=[PAIR]))
    assert facts[0] == InstanceFacts("a", "http://a:1", "peer", "g", True)
    assert [(f.name, f.role, f.group) for f in facts[2:]] == [
        ("p0", "prefill", "pd"),
        ("d0", "decode", "pd"),
    ]


def test_an_instance_listed_twice_is_refused_naming_both_places() -> None:
    with pytest.raises(ConfigError) as err:
        cfg(pdPairs=[{**PAIR, "prefill": [{"name": "a", "url": "http://x:1"}]}])
    message = str(err.value)
    assert "pdPairs[0].prefill[0].name: instance 'a' is listed twice" in message
    assert "p2pGroups[0].instances[0]" in message and "Value error" not in message
