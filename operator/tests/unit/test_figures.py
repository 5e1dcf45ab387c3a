"""The live figures, pure: reading the controller's and the gateway's answers, the hit window,
the pool's and members' ``status.live``, FiguresCurrent and the merge patch that writes them.

The answers are produced by the components' own code (the controller's reply builder in
kvpool.protocol.http_api, the gateway's GatewayMetrics), so a renamed field or metric fails
here, not silently in a cluster.
"""

from __future__ import annotations

import pytest
from op_builders import demo_docs, p2p, pd, pool

from kvpool.gateway.metrics import GatewayMetrics
from kvpool.operator import figures as fig
from kvpool.operator.derive.sizing import chunk_bytes_per_rank
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.operator.runtime import plan
from kvpool.protocol.domain import instance_id
from kvpool.protocol.http_api import stats_reply

POOL = pool()
GROUP = p2p("grp", replicas=3)  # ascend, TP 2: grp-0, grp-1, grp-2
PAIR = pd("pair")
FP = pool_fingerprint(POOL)


def controller(**over: object) -> fig.ControllerReading:
    body = stats_reply(
        {instance_id("grp-0", FP): 2, instance_id("grp-1", FP): 1, "stray~0123456789ab": 1},
        5,
        {"LocalCPUBackend": 8, "LocalDiskBackend": 2},
        {"fingerprint": 3},
        {"grp-2~ffffffffffff": "cache-domain fingerprint mismatch", "other~eeeeeeeeeeee": "x"},
    )
    body.update(over)
    return fig.read_controller(body)


def gateway_text(hits: dict[str, int], prompts: dict[str, int]) -> str:
    m = GatewayMetrics()
    for name, n in hits.items():
        m.predicted_hit_tokens.labels(name).inc(n)
    for name, n in prompts.items():
        m.prompt_tokens.labels(name).inc(n)
    return m.render().decode()


def test_the_controllers_stats_are_read_and_bad_answers_say_what_is_wrong() -> None:
    got = controller()
    assert got.workers[instance_id("grp-0", FP)] == 2
    assert (got.chunks, got.refusals) == (5, 3)
    assert got.chunk_locations == {"LocalCPUBackend": 8, "LocalDiskBackend": 2}
    for bad, message in (
        ([], "not a JSON object"),
        ({"instances": {}, "chunk_locations": {}}, "chunks"),
        ({"instances": [], "chunks": 1, "chunk_locations": {}}, "instances is not an object"),
        ({"instances": {"a": "x"}, "chunks": 1, "chunk_locations": {}}, "not a number"),
    ):
        with pytest.raises(fig.ReadError, match=message):
            fig.read_controller(bad)


def test_the_gateways_counters_are_summed_over_instances_and_its_frozen_instances_read() -> None:
    text = gateway_text({"grp-0": 300, "grp-1": 100}, {"grp-0": 500, "grp-1": 500, "x": 24})
    assert fig.read_gateway_counters(text) == (400.0, 1024.0)
    assert fig.read_gateway_counters(gateway_text({}, {})) == (0.0, 0.0)  # a fresh gateway
    with pytest.raises(fig.ReadError, match="not a kvpool gateway"):
        fig.read_gateway_counters("up 1\n")
    readyz = {
        "instances": {
            "grp-0": {"ready": True, "frozen": True},
            "grp-1": {"ready": False, "frozen": True},  # its last probe failed: unknown now
            "grp-2": {"ready": True, "frozen": False},
        }
    }
    assert fig.read_gateway_frozen(readyz) == {"grp-0"}
    with pytest.raises(fig.ReadError, match="instances"):
        fig.read_gateway_frozen({"status": "ready"})


def test_the_hit_window_spans_at_least_its_length_and_restarts_when_a_counter_drops() -> None:
    w = fig.HitWindow(seconds=60)
    w.add(0, 0, 0)
    assert w.current() is None
    w.add(30, 50, 100)
    assert w.current() == fig.Window(50, 100, 30)
    w.add(60, 50, 100)
    w.add(90, 150, 300)
    assert w.current() == fig.Window(100, 200, 60)  # from t=30, the newest at least 60 s old
    w.add(120, 10, 20)  # another gateway replica, or a restart
    assert w.current() is None
    w.add(150, 10, 20)
    assert fig.hit_ratio(w.current()) is None  # nothing routed: idle


def reading(**over: object) -> fig.Reading:
    base: dict[str, object] = {
        "controller": controller(),
        "gateway": fig.GatewayReading(400, 1000, frozenset({"grp-1", "pair-decode-0"})),
        "window": fig.Window(400, 1000, 300),
    }
    base.update(over)
    return fig.Reading(**base)  # type: ignore[arg-type]


def test_pool_figures_count_registered_instances_tiers_hits_and_refusals() -> None:
    live = fig.dump(fig.pool_figures(POOL, [GROUP, PAIR], reading()))
    per_chunk = chunk_bytes_per_rank(POOL, 2)
    assert live == {
        "instances": "1/3",  # grp-0 has both ranks; grp-1 one of two; grp-2 was refused
        "hit": "40.0%",
        "instancesRegistered": 1,
        "instancesExpected": 3,  # the PD pair's instances do not register
        "workersRegistered": 3,
        "workersExpected": 6,
        "unexpectedInstances": ["stray~0123456789ab"],
        "chunks": 5,
        "tiers": {
            "LocalCPUBackend": {"chunkLocations": 8, "bytes": 8 * per_chunk},
            "LocalDiskBackend": {"chunkLocations": 2, "bytes": 2 * per_chunk},
        },
        "hitRatio": 0.4,
        "hitTokens": 400,
        "promptTokens": 1000,
        "windowSeconds": 300.0,
        "instancesFrozen": 2,
        "refusedRegistrations": 3,
        "refused": [
            {"instanceId": "grp-2~ffffffffffff", "reason": "cache-domain fingerprint mismatch"},
            {"instanceId": "other~eeeeeeeeeeee", "reason": "x"},
        ],
    }


def test_a_side_that_was_not_read_leaves_its_figures_out() -> None:
    no_controller = fig.dump(fig.pool_figures(POOL, [GROUP], reading(controller=None)))
    assert no_controller["instances"] == "?/3" and "tiers" not in no_controller
    assert no_controller["hit"] == "40.0%"
    no_gateway = fig.dump(fig.pool_figures(POOL, [GROUP], reading(gateway=None, window=None)))
    assert no_gateway["hit"] == "?" and "hitRatio" not in no_gateway
    assert no_gateway["instances"] == "1/3"
    first = fig.dump(fig.pool_figures(POOL, [GROUP], reading(window=None)))
    assert first["hit"] == "-"
    idle = fig.dump(fig.pool_figures(POOL, [GROUP], reading(window=fig.Window(0, 0, 300))))
    assert idle["hit"] == "idle" and idle["promptTokens"] == 0 and "hitRatio" not in idle


def test_tier_bytes_are_left_out_when_instances_hold_chunks_of_different_sizes() -> None:
    mixed = [GROUP, p2p("solo", replicas=1, tensorParallelSize=1)]
    live = fig.dump(fig.pool_figures(POOL, mixed, reading()))
    assert live["tiers"]["LocalCPUBackend"] == {"chunkLocations": 8}
    assert live["workersExpected"] == 7


def test_member_figures_say_which_instances_are_registered_frozen_or_refused() -> None:
    group = fig.dump(fig.member_figures(POOL, GROUP, reading()))
    assert group == {
        "instancesRegistered": 1,
        "instancesFrozen": 1,
        "instancesRefused": 1,
        "frozen": ["grp-1"],
        "refused": ["grp-2"],
    }
    pair = fig.dump(fig.member_figures(POOL, PAIR, reading()))
    assert pair == {
        "instancesFrozen": 1,
        "instancesRefused": 0,
        "frozen": ["pair-decode-0"],
        "refused": [],
    }
    # a refused id of an instance now registered under the right one (an old pod) is history
    healed = controller(instances={instance_id(f"grp-{i}", FP): 2 for i in range(3)})
    assert fig.member_figures(POOL, GROUP, reading(controller=healed)).instances_refused == 0
    assert fig.dump(fig.member_figures(POOL, GROUP, fig.Reading())) == {}


def test_figures_current_names_the_side_that_failed_and_when_it_last_answered() -> None:
    assert fig.health(reading()) == fig.Health(
        True, "Read", "the controller and the gateway answered"
    )
    down = fig.health(
        fig.Reading(controller_error="http://c/v1/stats: no answer within 2 s"),
        {"controller": "2026-01-01T00:00:00Z"},
    )
    assert (down.ok, down.reason) == (False, "ControllerUnavailable")
    assert "no answer within 2 s; last answered 2026-01-01T00:00:00Z" in down.message
    both = fig.health(fig.Reading(controller_error="a", gateway_error="b"))
    assert both.reason == "Unavailable" and "never answered" in both.message


def test_merge_replace_names_dropped_keys_null() -> None:
    old = {"instances": "1/3", "tiers": {"A": {"chunkLocations": 1}, "B": {"bytes": 2}}, "x": 1}
    new = {"instances": "?/3", "tiers": {"A": {"chunkLocations": 2}}}
    assert fig.merge_replace(old, new) == {
        "x": None,
        "instances": "?/3",
        "tiers": {"B": None, "A": {"chunkLocations": 2}},
    }
    assert fig.merge_replace(None, new) == new


def test_a_pass_reports_figures_current_once_the_poller_has_read_the_domain() -> None:
    pool_doc, *members = demo_docs()
    now = "2026-01-01T00:00:00Z"

    def conditions(health: fig.Health | None) -> dict[str, dict[str, str]]:
        observed = plan.Observed("default", "demo", pool_doc, members, figures=health)
        result = plan.plan_domain(observed, now, lambda children, owner: None)
        (status,) = [st for body, st in result.statuses if body["kind"] == "KVCachePool"]
        return {c["type"]: c for c in status["conditions"]}

    assert "FiguresCurrent" not in conditions(None)
    down = conditions(fig.Health(False, "GatewayUnavailable", "the gateway could not be read"))
    assert down["FiguresCurrent"]["status"] == "False"
    assert down["FiguresCurrent"]["reason"] == "GatewayUnavailable"
    assert conditions(fig.Health(True, "Read", "ok"))["FiguresCurrent"]["reason"] == "Read"
