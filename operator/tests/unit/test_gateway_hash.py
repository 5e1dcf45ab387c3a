"""The gateway's ``kvpool.io/config-hash`` covers only what a running gateway cannot apply.

Why (issue 17 part 5): the gateway re-reads its mounted gateway.yaml and applies routing,
guards, P2P instances and PD pairs live (``kvpool.protocol.gateway_config.LIVE_KEYS``); a pod
template change would restart it for nothing. So new routing, a scaled P2PGroup or a PD pair
becoming ready change the ConfigMap and leave the template as it was, and a change only a
restart applies (the tokenizer here) changes the template's hash.
"""

from __future__ import annotations

from typing import Any

import yaml
from op_builders import pd, plain_p2p, pool

from kvpool.operator.api import KVCachePool, P2PGroup, PDPair
from kvpool.operator.derive import names
from kvpool.operator.render import render_domain
from kvpool.protocol.gateway_config import LIVE_KEYS


def _gateway(
    the_pool: KVCachePool, members: list[P2PGroup | PDPair], ready: frozenset[str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the gateway Deployment's pod template annotations, its gateway.yaml)."""
    objects = render_domain(the_pool, members, ready)
    name = "pool-gateway"
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name
    ]
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    annotations: dict[str, Any] = deployment["spec"]["template"]["metadata"]["annotations"]
    return annotations, yaml.safe_load(cm["data"]["gateway.yaml"])


def test_live_changes_leave_the_gateway_template_alone() -> None:
    members: list[P2PGroup | PDPair] = [plain_p2p(replicas=2), pd()]
    base, config = _gateway(pool(), members)
    assert {"routing", "p2pGroups", "pdPairs"} <= set(config) and set(config) - LIVE_KEYS
    weighted = pool(gateway={"routing": {"policy": "least-load", "weights": {"load": 2.5}}})
    scaled: list[P2PGroup | PDPair] = [plain_p2p(replicas=3), pd()]
    for the_pool, its_members, ready in (
        (weighted, members, None),
        (pool(), scaled, None),
        (pool(), members, frozenset()),  # the PD pair not ready yet: left out of pdPairs
    ):
        annotations, changed = _gateway(the_pool, its_members, ready)
        assert changed != config  # the running gateway gets it through the ConfigMap
        assert annotations == base  # and is not restarted for it


def test_a_restart_only_change_rolls_the_gateway() -> None:
    members: list[P2PGroup | PDPair] = [plain_p2p(replicas=2)]
    base, config = _gateway(pool(), members)
    with_tokenizer = pool(gateway={"tokenizer": {"path": "/models/tok"}})
    annotations, changed = _gateway(with_tokenizer, members)
    assert changed["tokenizer"] == "/models/tok" != config.get("tokenizer")
    assert annotations[names.ANNOTATION_CONFIG] != base[names.ANNOTATION_CONFIG]
