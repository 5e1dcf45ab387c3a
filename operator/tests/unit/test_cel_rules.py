"""The CRDs' CEL rules (x-kubernetes-validations) compile and mean what the validation says.

No API server runs here, so the rules are evaluated with cel-python on each example CR after
defaulting (pydantic's dump with defaults, as the API server defaults before CEL runs), and on
objects that break them.
"""

from __future__ import annotations

from typing import Any

import celpy
import pytest
import yaml
from op_builders import EXAMPLES, p2p, pd, pool

from kvpool.operator import gen
from kvpool.operator.loader import load_text

SIM = "h100-llama-3.1-8b-vllm"
CRDS = {
    kind: gen.crd(kind, plural, short, spec, status)
    for kind, plural, short, spec, status in gen.KINDS
}


def _rules(node: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    out: list[tuple[tuple[str, ...], str]] = []
    if not isinstance(node, dict):
        return out
    for rule in node.get("x-kubernetes-validations", []):
        out.append((path, rule["rule"]))
    for name, sub in node.get("properties", {}).items():
        out += _rules(sub, (*path, name))
    return out


def _all_rules(kind: str) -> list[tuple[tuple[str, ...], str]]:
    return _rules(CRDS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def _check(kind: str, obj: dict[str, Any]) -> list[str]:
    """Rules of ``kind`` that ``obj`` (already defaulted) violates."""
    env = celpy.Environment()
    failed = []
    for path, rule in _all_rules(kind):
        node: Any = obj
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue  # CEL rules do not run on absent or null objects
        result = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(node)})
        if not bool(result):
            failed.append(rule)
    return failed


def test_crds_carry_rules() -> None:
    assert len(_all_rules("KVCachePool")) == 2
    assert len(_all_rules("P2PGroup")) == 3  # delay pull; a sim engine on cpu; kvEvents
    assert len(_all_rules("PDPair")) == 5  # sim on cpu and kvEvents (each side); no sim in PD


def test_every_example_satisfies_every_rule() -> None:
    checked = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        loaded = load_text(path.read_text(), path.name)
        for resource in [*loaded.pools, *loaded.members]:
            dumped = resource.model_dump(by_alias=True, exclude_none=True)
            assert _check(resource.kind, dumped) == [], (path.name, resource.kind)
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize(
    ("kind", "obj", "rule"),
    [
        (
            "P2PGroup",
            p2p(transfer={"useNPU": False}).model_dump(by_alias=True, exclude_none=True),
            "!self.delayPull || (self.pullMode && self.useNPU)",
        ),
        (
            "KVCachePool",
            pool(controller={"persistence": {"mode": "redis"}}).model_dump(
                by_alias=True, exclude_none=True
            ),
            "self.mode != 'redis' || has(self.redisUrl)",
        ),
        (
            "KVCachePool",
            yaml.safe_load(
                "spec: {tiers: {remote: {redis: {url: 'redis://r'}, mooncake: {segmentSize: 1Gi}}}}"
            ),
            "has(self.mooncake) != has(self.redis)",
        ),
        (
            "P2PGroup",
            p2p(engine={"platform": "cuda", "sim": {"profile": SIM}}, transfer={}).model_dump(
                by_alias=True, exclude_none=True
            ),
            "!has(self.sim) || self.platform == 'cpu'",
        ),
        (
            "PDPair",
            pd(decode={"engine": {"platform": "cpu", "sim": {"profile": SIM}}}).model_dump(
                by_alias=True, exclude_none=True
            ),
            "!has(self.prefill.engine.sim) && !has(self.decode.engine.sim)",
        ),
        (
            "P2PGroup",
            p2p(engine={"platform": "cpu", "kvEvents": True}, transfer={}).model_dump(
                by_alias=True, exclude_none=True
            ),
            "!has(self.kvEvents) || !self.kvEvents || self.platform != 'cpu' || has(self.sim)",
        ),
        (
            "PDPair",
            pd(decode={"engine": {"platform": "cpu", "kvEvents": True}}).model_dump(
                by_alias=True, exclude_none=True
            ),
            "!has(self.kvEvents) || !self.kvEvents || self.platform != 'cpu' || has(self.sim)",
        ),
    ],
)
def test_rules_reject_what_validation_rejects(kind: str, obj: dict[str, Any], rule: str) -> None:
    assert _check(kind, obj) == [rule]


def test_kv_events_rule_admits_vllm_and_the_sim() -> None:
    for engine in (
        {"platform": "cuda", "kvEvents": True},
        {"platform": "cpu", "sim": {"profile": SIM}, "kvEvents": True},
    ):
        group = p2p(engine=engine, transfer={}).model_dump(by_alias=True, exclude_none=True)
        assert _check("P2PGroup", group) == []
