"""``kvpool_gateway_breaker_open{instance}``: the gateway's circuit breakers as Prometheus sees
them (the alert KvpoolGatewayBreakerOpen and the routing dashboard read it), from the state a
real ``build_state`` wires; failures open a breaker, a success closes it again."""

from __future__ import annotations

import re

from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.state import build_state


def _breakers(text: str) -> dict[str, float]:
    found = re.findall(r'^kvpool_gateway_breaker_open\{instance="([^"]+)"\} (\S+)$', text, re.M)
    return {name: float(value) for name, value in found}


def test_breaker_open_is_exported_per_instance_at_scrape_time() -> None:
    raw = {
        "model": "m",
        "chunkSize": 256,
        "controllerUrl": "http://127.0.0.1:1",
        "p2pGroups": [{"name": "g", "instances": [
            {"name": "a", "url": "http://127.0.0.1:1"}, {"name": "b", "url": "http://127.0.0.1:2"}]}],
    }  # fmt: skip
    state = build_state(parse_config(raw), GatewayEnv(), pd_bind_host="127.0.0.1")
    assert _breakers(state.metrics.render().decode()) == {"a": 0.0, "b": 0.0}
    breaker = state.instances.by_name["b"].breaker
    for _ in range(breaker.failure_threshold):
        breaker.failure(now=1.0)
    assert _breakers(state.metrics.render().decode()) == {"a": 0.0, "b": 1.0}
    assert breaker.acquire(now=1.0 + breaker.cooldown_s)  # half-open: still cut off
    assert _breakers(state.metrics.render().decode())["b"] == 1.0
    breaker.success()
    assert _breakers(state.metrics.render().decode()) == {"a": 0.0, "b": 0.0}


def test_inflight_is_read_from_the_load_tracker_at_scrape_time() -> None:
    """In flight per instance rises at admit and falls back when the request ends (it used to
    be set at admit only, so it kept the last value after the requests finished)."""
    raw = {
        "model": "m",
        "chunkSize": 256,
        "controllerUrl": "http://127.0.0.1:1",
        "p2pGroups": [{"name": "g", "instances": [{"name": "a", "url": "http://127.0.0.1:1"}]}],
    }
    state = build_state(parse_config(raw), GatewayEnv(), pd_bind_host="127.0.0.1")

    def inflight() -> dict[str, float]:
        text = state.metrics.render().decode()
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^kvpool_gateway_inflight\{instance="(\w+)"\} (\S+)$', text, re.M)
        }

    assert inflight() == {"a": 0.0}
    tickets = [state.load.start("a", 100, now=0.0) for _ in range(2)]
    assert inflight() == {"a": 2.0}
    for t in tickets:
        state.load.finish(t)
    assert inflight() == {"a": 0.0}
