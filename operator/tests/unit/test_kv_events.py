"""engine.kvEvents: vLLM's KV-cache events for external KV-aware routers (vllm-router's
kv_aware, llm-d), on ports kvpool allocates per instance.

Each failing case asserts the field path and the message a person reads; the render cases pin
the ``--kv-events-config`` the worker parses (e2e/tests/test_render_parsers.py runs it through
the worker's own parser, the sim's build and the vLLM command it would exec) and the ports
``kvpool-operator up`` maps to local ones.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from op_builders import EXAMPLES, merge, p2p, pd, plain_p2p, pool

from kvpool.operator.api import P2PGroup
from kvpool.operator.derive.ports import member_port_range, p2p_ports, pd_ports
from kvpool.operator.local import plan as ls
from kvpool.operator.local import rewrite as lr
from kvpool.operator.local.up import render_files
from kvpool.operator.render import render
from kvpool.operator.validation import apply_patches, validate_domain
from kvpool.operator.validation.problems import Problem

PROFILE = "h100-llama-3.1-8b-vllm"
LLAMA = {"name": "llama", "numLayers": 32, "numKvHeads": 8, "headDim": 128}


def sim_group(**spec: Any) -> P2PGroup:
    engine = {"platform": "cpu", "sim": {"profile": PROFILE}, "kvEvents": True}
    base: dict[str, Any] = {"tensorParallelSize": 1, "engine": engine, "p2p": False}
    return plain_p2p(**merge(base, spec))


def sim_pool() -> Any:
    return pool(model=LLAMA, blockSize=16)


def _one(problems: list[Problem], code: str) -> Problem:
    (found,) = [p for p in problems if p.code == code]
    return found


def _objects(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _patched(group: P2PGroup, problem: Problem) -> P2PGroup:
    doc = apply_patches(group.model_dump(by_alias=True, exclude_none=True), problem.patch)
    return P2PGroup.model_validate(doc)


def _events_flag(command: list[str]) -> dict[str, Any]:
    head = command[: command.index("--")] if "--" in command else command
    assert head.count("--kv-events-config") == 1, command
    value: dict[str, Any] = json.loads(head[head.index("--kv-events-config") + 1])
    return value


# ports ----------------------------------------------------------------------------------------


def test_each_instance_gets_its_own_pub_and_replay_port_after_its_lists() -> None:
    group = p2p(replicas=3, engine={"platform": "cuda", "kvEvents": True}, transfer={})
    insts = p2p_ports(group)  # TP 2, P2P on: HTTP + 3 lists of 2 -> KV events at +7, +8
    assert [i.kv_events for i in insts] == [(20007, 20008), (20017, 20018), (20027, 20028)]
    assert member_port_range(group) == (20000, 20029)
    wide = p2p(tensorParallelSize=3, engine={"platform": "cuda", "kvEvents": True}, transfer={})
    # HTTP + 9 list ports fill a block of ten: the two event ports take the next block of ten.
    assert [i.kv_events for i in p2p_ports(wide)] == [(20010, 20011), (20030, 20031)]
    off = p2p(tensorParallelSize=3, transfer={})
    assert [i.kv_events for i in p2p_ports(off)] == [None, None]
    assert member_port_range(off) == (20000, 20019)


def test_pd_sides_publish_independently_on_one_block_layout() -> None:
    pair = pd(
        prefill={"replicas": 2, "engine": {"platform": "cuda", "kvEvents": True}},
        decode={"engine": {"platform": "cuda"}},
        transfer={"mode": "push", "channel": "nixl", "bufferDevice": "cuda"},
    )
    insts = pd_ports(pair, sender_pull=False)
    assert [(i.name, i.kv_events) for i in insts] == [
        ("pair-prefill-0", (30005, 30006)),
        ("pair-prefill-1", (30015, 30016)),
        ("pair-decode-0", None),
    ]
    assert not [p for p in validate_domain(pool(), [pair]) if p.rule == 2]


def test_explicit_ports_must_name_both_event_ports_when_the_engine_publishes() -> None:
    one = {"http": 8010, "workerPorts": [9000]}
    group = sim_group(replicas=1, ports={"instances": [one]})
    problem = _one(validate_domain(sim_pool(), [group]), "ports.explicit-kv-events")
    assert problem.path == "P2PGroup/grp: spec.ports.instances[0]"
    assert "do not name both kvEvents and kvEventsReplay" in problem.message
    full = {**one, "kvEvents": 9001, "kvEventsReplay": 9002}
    named = sim_group(replicas=1, ports={"instances": [full]})
    assert validate_domain(sim_pool(), [named]) == []
    assert p2p_ports(named)[0].kv_events == (9001, 9002)
    clash = sim_group(replicas=1, ports={"instances": [{**full, "kvEventsReplay": 9000}]})
    assert _one(validate_domain(sim_pool(), [clash]), "ports.duplicate").message == (
        "ports [9000] are used more than once"
    )
    quiet = sim_group(replicas=1, engine={"kvEvents": False}, ports={"instances": [full]})
    stray = _one(validate_domain(sim_pool(), [quiet]), "ports.explicit-kv-events-unused")
    assert stray.fix == (
        "remove kvEvents and kvEventsReplay from ports.instances, or set engine.kvEvents: true"
    )
    assert validate_domain(sim_pool(), [_patched(quiet, stray)]) == []


def test_host_network_members_with_events_do_not_overlap() -> None:
    a = sim_group(replicas=2, hostNetwork=True, ports={"base": 20000})
    b = plain_p2p(
        "other",
        tensorParallelSize=1,
        p2p=False,
        engine={"platform": "cpu", "sim": {"profile": PROFILE}},
        hostNetwork=True,
        ports={"base": 20015},
    )
    problem = _one(validate_domain(sim_pool(), [a, b]), "ports.overlap:P2PGroup/grp")
    assert "20015-20034 overlaps P2PGroup/grp's 20000-20019" in problem.message


# rules ----------------------------------------------------------------------------------------


def test_the_reference_engine_cannot_publish_and_the_fix_names_the_field() -> None:
    ref = plain_p2p(tensorParallelSize=1, p2p=False, engine={"platform": "cpu", "kvEvents": True})
    problem = _one(validate_domain(sim_pool(), [ref]), "engine.kv-events")
    assert problem.path == "P2PGroup/grp: spec.engine.kvEvents"
    assert problem.severity == "error"
    assert "reference engine (platform cpu without engine.sim) publishes no" in problem.message
    assert problem.fix == (
        "remove engine.kvEvents, or run the simulated engine (engine.sim) or vLLM (platform "
        "ascend or cuda)"
    )
    pair = pd(decode={"engine": {"platform": "cpu", "kvEvents": True}})
    paths = [p.path for p in validate_domain(pool(), [pair]) if p.code == "engine.kv-events"]
    assert paths == ["PDPair/pair: spec.decode.engine.kvEvents"]
    assert [
        p for p in validate_domain(sim_pool(), [sim_group()]) if p.code.startswith("engine")
    ] == []


@pytest.mark.parametrize(
    "engine", [{"platform": "cuda"}, {"platform": "cpu", "sim": {"profile": PROFILE}}]
)
def test_the_events_flag_is_kvpools_and_refused_in_engine_args(engine: dict[str, Any]) -> None:
    args = ["--kv-events-config", '{"enable_kv_cache_events":true}', "--enforce-eager"]
    group = plain_p2p(tensorParallelSize=1, p2p=False, engine={**engine, "args": args})
    problem = _one(validate_domain(sim_pool(), [group]), "engine.owned-flag--kv-events-config")
    assert problem.fix == (
        "remove --kv-events-config from spec.engine.args; set it through engine.kvEvents "
        "(kvpool allocates its ports per instance)"
    )
    assert _patched(group, problem).spec.engine.args == ["--enforce-eager"]


# render ---------------------------------------------------------------------------------------


def test_sim_and_vllm_workers_get_vllms_config_on_their_own_ports() -> None:
    objects = render(sim_pool(), sim_group(replicas=2))
    for i in range(2):
        sts = _objects(objects, "StatefulSet", f"grp-{i}")
        container = sts["spec"]["template"]["spec"]["containers"][0]
        assert _events_flag(container["command"]) == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{20002 + 10 * i}",
            "replay_endpoint": f"tcp://*:{20003 + 10 * i}",
        }
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert (ports["kv-events"], ports["kv-replay"]) == (20002 + 10 * i, 20003 + 10 * i)
        svc = _objects(objects, "Service", f"grp-{i}")
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}.items() >= {
            "kv-events": 20002 + 10 * i,
            "kv-replay": 20003 + 10 * i,
        }.items()
    cuda = p2p(engine={"platform": "cuda", "kvEvents": True, "args": ["--enforce-eager"]})
    command = _objects(render(pool(), cuda), "StatefulSet", "grp-1")["spec"]["template"]["spec"][
        "containers"
    ][0]["command"]
    assert command[command.index("--engine") + 1] == "vllm"
    assert _events_flag(command)["endpoint"] == "tcp://*:20017"
    assert command[-2:] == ["--", "--enforce-eager"]  # the flag is kvpool's, before the engine's


def test_no_flag_and_no_ports_without_kv_events() -> None:
    objects = render(sim_pool(), sim_group(engine={"kvEvents": False}))
    container = _objects(objects, "StatefulSet", "grp-0")["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert "--kv-events-config" not in container["command"]
    assert not {"kv-events", "kv-replay"} & {p["name"] for p in container["ports"]}


# kvpool-operator up ---------------------------------------------------------------------------


def test_up_keeps_the_wildcard_bind_and_maps_both_ports(tmp_path: Path) -> None:
    """``tcp://*:PORT`` inside the JSON flag: still a bind (vLLM connects to any other host),
    on the instance's local port; the rewrite check accepts exactly that."""
    objects = render_files([EXAMPLES / "sim-fleet.yaml"]).objects
    cmap = ls.cluster_map(objects, itertools.count(40000).__next__)
    loads = ls.workloads(objects)
    seen: set[int] = set()
    for name in ("fleet-sim-0", "fleet-sim-15"):
        w = loads[name]
        lw = lr.localize(w, cmap, tmp_path)
        local = _events_flag(lw.argv)
        assert local["endpoint"] == f"tcp://*:{lw.ports['kv-events']}"
        assert local["replay_endpoint"] == f"tcp://*:{lw.ports['kv-replay']}"
        assert local["enable_kv_cache_events"] is True and local["publisher"] == "zmq"
        seen |= {lw.ports["kv-events"], lw.ports["kv-replay"]}
        changes = lr.check_rewrite(w, lw, cmap)
        assert any("<json>.endpoint: 'tcp://*:" in c for c in changes), changes
        i = lw.argv.index("--kv-events-config") + 1
        for bad in (
            json.dumps({**local, "endpoint": f"tcp://127.0.0.1:{lw.ports['kv-events']}"}),
            json.dumps({**local, "endpoint": "tcp://*:1"}),
        ):
            lw.argv[i] = bad
            with pytest.raises(ls.StackError, match="is not a cluster rewrite"):
                lr.check_rewrite(w, lw, cmap)
    assert len(seen) == 4


def test_up_leaves_a_json_flag_without_addresses_byte_for_byte(tmp_path: Path) -> None:
    objects = render_files([EXAMPLES / "ascend-p2p.yaml"]).objects
    cmap = ls.cluster_map(objects, itertools.count(40000).__next__)
    for w in ls.workloads(objects).values():
        if "--rope-scaling" in w.argv:
            lw = lr.localize(w, cmap, tmp_path)
            i = w.argv.index("--rope-scaling") + 1
            assert lw.argv[i] == w.argv[i]
            return
    pytest.fail("no --rope-scaling in ascend-p2p's render")
