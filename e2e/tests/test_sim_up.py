"""End to end: ``kvpool-operator up`` of a simulated domain (engine.sim, p2p: false).

Why: the render of a sim member and ``kvpool-worker serve --engine sim`` are one contract; here
the product command runs ``tests/sim-small.yaml`` (examples/sim-fleet.yaml's model, profile and
``p2p: false``, with 4 instances) as real processes on 127.0.0.1, once with one process per pod
and once with every instance in one ``kvpool-worker host`` process (``up --sim-host``): every
instance registers with the real controller, the real gateway answers, routes a repeated long
prompt to the instance that holds it (``kv-hit``) and the answer reports the cached tokens, and
``down`` stops every process. Nothing is mocked; the render runs as it is (the rewrite check).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from upstack import (
    CHUNK,
    CLUSTER_REWRITES,
    chat,
    messages,
    poll,
    prefix_hits,
    processes_of,
    registered,
    tokens,
)

from kvpool.operator.local.plan import Workload, workloads
from kvpool.operator.local.stack import pid_alive
from kvpool.operator.local.up import UpProcess, render_files

DOMAIN = Path(__file__).resolve().parent / "sim-small.yaml"
INSTANCES = [f"simsmall-sim-{i}" for i in range(4)]
READY_S = 180.0  # four simulated instances, a controller, two gateways on a shared 2-core box


@pytest.fixture(scope="module")
def rendered() -> dict[str, Workload]:
    return workloads(render_files([DOMAIN]).objects)


@pytest.fixture(params=[False, True], ids=["process-per-pod", "sim-host"])
def up(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UpProcess]:
    proc = UpProcess([str(DOMAIN)], tmp_path / "up", sim_host=request.param)
    try:
        proc.start(READY_S)
        yield proc
    finally:
        proc.stop()


def _instance_id(w: Workload) -> str:
    (text,) = w.files.values()
    found = re.search(r"^lmcache_instance_id: (\S+)$", text, re.M)
    assert found, text
    return found.group(1)


def test_sim_domain_registers_routes_kv_hits_and_goes_down(
    up: UpProcess, rendered: dict[str, Workload]
) -> None:
    state = up.state()
    processes = state["processes"]
    for name in rendered:  # the gateway: two replicas, by default
        for pod in processes_of(state, name):
            assert pod in processes, pod
            for line in processes[pod]["rewrites"]:
                assert CLUSTER_REWRITES.match(line), (pod, line)
    assert len(processes_of(state, "simsmall-gateway")) == 2
    hosts = {p["hosted_by"] for n, p in processes.items() if n in INSTANCES and "hosted_by" in p}
    assert hosts == ({"simsmall-sim-host"} if up.sim_host else set())
    if up.sim_host:
        assert processes["simsmall-sim-host"]["hosts"] == INSTANCES
        assert len({processes[n]["pgid"] for n in INSTANCES}) == 1
    else:
        assert len({processes[n]["pgid"] for n in INSTANCES}) == len(INSTANCES)
    endpoints = state["endpoints"]
    controller, gateway = endpoints["simsmall-controller"], endpoints["simsmall-gateway"]

    ids = {name: _instance_id(rendered[name]) for name in INSTANCES}
    poll("every instance registered", lambda: all(registered(controller, i) for i in ids.values()))

    msgs = messages("the simulated harbor", 120)
    toks = tokens(endpoints[INSTANCES[0]], msgs)
    full = len(toks) // CHUNK
    assert full >= 4, len(toks)
    first = chat(gateway, msgs)
    assert first.text and first.prompt_tokens == len(toks)
    served = first.headers["x-kvpool-instance"]
    assert served in INSTANCES
    poll("the prefix indexed", lambda: prefix_hits(controller, toks).get(ids[served], 0) >= full)
    again = chat(gateway, msgs)
    assert again.headers["x-kvpool-instance"] == served, again.headers
    assert again.headers["x-kvpool-route-reason"] == "kv-hit", again.headers
    assert again.cached >= full * CHUNK, again.usage

    pgids = {int(p["pgid"]) for p in processes.values()}
    assert up.stop() == 0, up.output.read_text()[-3000:]
    assert not [g for g in pgids if pid_alive(g)]
    assert not (up.state_dir / "state.json").exists()
