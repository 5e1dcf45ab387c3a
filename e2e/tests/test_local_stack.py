"""End to end: ``kvpool-operator up -f examples/cpu-demo.yaml``, the render run as it is.

Why: the controller, the workers, the gateway and the operator are each tested alone; only
here do the rendered command lines, environment and LMCache YAML meet the real processes
(``kvpool-controller``, ``kvpool-worker serve --engine reference`` with the real LMCache 0.5.6
engine and its P2P/PD backends over NIXL, ``kvpool-gateway``), all on 127.0.0.1 through the
product command. Nothing is mocked and nothing of the render is changed but what a cluster
provides (``kvpool.operator.local.plan``'s rewrite, checked independently). One domain is
brought up for the module; the tests that break a process (SIGKILL, controller restart) rely
on ``up`` restarting it the way a kubelet would.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from promcheck import firing, wait_for_series
from upstack import (
    CHUNK,
    CLUSTER_REWRITES,
    READY_S,
    SETTLE_S,
    Domain,
    bring_up,
    chat,
    messages,
    metric,
    poll,
    prefix_hits,
    processes_of,
    registered,
    sample,
    tokens,
)

from kvpool.operator.local.plan import Workload, workloads
from kvpool.operator.local.stack import LocalStack, free_port
from kvpool.operator.local.up import cluster_from_state, render_files
from kvpool.operator.monitoring.panels import Needs

P2P = ("demo-p2p-0", "demo-p2p-1")


@pytest.fixture(scope="module")
def domain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Domain]:
    # One controller replica, pinned: this module's subject is what its death costs (a full
    # sync); two hand over a warm index instead, test_controller_ha.py's subject.
    d = bring_up(tmp_path_factory.mktemp("up"), monitoring=True, controller_replicas=1)
    try:
        yield d
    finally:
        assert d.up.stop() == 0, d.up.output.read_text()[-3000:]


def test_render_runs_verbatim(domain: Domain) -> None:
    """Every rendered workload runs and is Ready on its rendered probe; the only changes to
    the render are cluster rewrites (checked apart from the rewrite code, by ``check_rewrite``),
    and no worker was refused or stopped."""
    state = domain.state
    assert state["ready"]
    pods = {p: name for name in domain.rendered for p in processes_of(state, name)}
    assert len(processes_of(state, "demo-gateway")) == 2  # the gateway's default replicas
    assert set(state["processes"]) == {*pods, "prometheus"}  # up --monitoring's
    for pod, name in pods.items():
        proc = state["processes"][pod]
        assert proc["argv"][0] == domain.rendered[name].argv[0], pod
        for line in proc["rewrites"]:
            assert CLUSTER_REWRITES.match(line), (pod, line)
        assert "refusing to start" not in domain.log(pod), pod
    a = domain.url("demo-p2p-0")
    assert chat(a, messages("verbatim", 20)).text


def test_repeated_chat_hits_lmcache_and_the_controller_names_the_instance(
    domain: Domain, record_property: Callable[[str, object], None]
) -> None:
    """The same long prompt twice: the second prefill loads KV from LMCache (same greedy
    answer), and the controller's index shows this instance's chunks."""
    a, controller = domain.url("demo-p2p-0"), domain.url("demo-controller")
    msgs = messages("the harbor", 120)
    toks = tokens(a, msgs)
    full = len(toks) // CHUNK
    assert full >= 2, len(toks)
    miss = chat(a, msgs)
    hit = chat(a, msgs)
    assert miss.cached == 0
    assert hit.cached >= full * CHUNK
    assert hit.text == miss.text and hit.text
    record_property("ttft_miss_ms", round(miss.ttft_s * 1000, 1))
    record_property("ttft_hit_ms", round(hit.ttft_s * 1000, 1))
    me = domain.instance_id("demo-p2p-0")
    poll("prefix hits", lambda: prefix_hits(controller, toks).get(me, 0) >= full)
    lookup = httpx.post(f"{controller}/lookup", json={"tokens": toks}, timeout=10).json()
    assert lookup["layout_info"][me][0] == "LocalCPUBackend"
    assert registered(controller, me)


def test_p2p_peer_serves_the_prefix_another_instance_computed(
    domain: Domain, record_property: Callable[[str, object], None]
) -> None:
    """B has never seen the prompt; A has. B pulls A's chunks over NIXL (LMCache's P2P
    backend, found through our controller) and answers exactly what a cold run answers."""
    a, b = domain.url("demo-p2p-0"), domain.url("demo-p2p-1")
    controller = domain.url("demo-controller")
    me_a, me_b = domain.instance_id("demo-p2p-0"), domain.instance_id("demo-p2p-1")
    msgs = messages("the shared prefix", 80)
    toks = tokens(a, msgs)
    full = len(toks) // CHUNK
    on_a = chat(a, msgs)
    assert on_a.cached == 0
    poll("A's chunks", lambda: prefix_hits(controller, toks).get(me_a, 0) >= full)
    assert me_b not in prefix_hits(controller, toks)
    on_b = chat(b, msgs)
    record_property("p2p_hit_tokens", on_b.cached)
    assert on_b.cached >= full * CHUNK, on_b.usage  # B computed only the tail
    assert on_b.text == on_a.text  # same render, same weights seed: the cold answer


def test_controller_restart_recovers_the_index_by_full_sync(domain: Domain) -> None:
    """The controller's process dies (the domain renders full-sync persistence and no Redis);
    ``up`` restarts it like a kubelet with the same command and ports; within the rendered
    heartbeat interval the worker re-registers, sends a full sync, and lookups answer again."""
    a, me = domain.url("demo-p2p-0"), domain.instance_id("demo-p2p-0")
    msgs = messages("the restart", 60)
    toks = tokens(a, msgs)
    full = len(toks) // CHUNK
    chat(a, msgs)
    poll("A's chunks", lambda: prefix_hits(domain.url("demo-controller"), toks).get(me) == full)
    synced_before = {p: _full_syncs(domain, p) for p in P2P}
    old = domain.kill("demo-controller", signal.SIGTERM)
    domain.restarted("demo-controller", old)
    controller = domain.url("demo-controller")
    heartbeat_s = float(domain.config("demo-p2p-0")["lmcache_worker_heartbeat_time"])
    poll(
        "recovery",
        lambda: prefix_hits(controller, toks).get(me) == full,
        timeout_s=3 * heartbeat_s + SETTLE_S,
    )
    assert re.search(
        rf"full sync \S+ of {re.escape(me)}/0 completed", domain.log("demo-controller")
    )
    assert metric(controller, "kvpool_controller_full_syncs_total", '{outcome="completed"}') >= 1
    # Leave the domain settled for the next test: LMCache drops every store while its full
    # sync runs (freeze mode, until it has polled the sync status as complete), so wait until
    # each peer's sync completed at the controller and the worker has left freeze mode.
    for name in P2P:
        _wait_settled(domain, name, synced_before[name], 3 * heartbeat_s + SETTLE_S)


def _wait_settled(domain: Domain, name: str, syncs_before: int, timeout_s: float) -> None:
    poll(f"{name}'s full sync", lambda: _full_syncs(domain, name) > syncs_before, timeout_s)
    frozen = "kvpool_engine_lmcache_frozen"  # a missing gauge is not "0"
    poll(f"{name} out of freeze mode", lambda: sample(domain.url(name), frozen) == 0.0)


def _full_syncs(domain: Domain, name: str) -> int:
    """Full syncs of ``name`` the controller's log (all its runs) says completed."""
    me = re.escape(domain.instance_id(name))
    return len(re.findall(rf"full sync \S+ of {me}/0 completed", domain.log("demo-controller")))


def test_killed_worker_is_routed_around_and_leaves_the_index(domain: Domain) -> None:
    """B alone computed a prefix, then is SIGKILLed (no deregistration). Lookups keep
    answering at once; the gateway sends the next request for that prefix to A (B is gone),
    which answers what B answered (a dead peer in the index never hangs A's P2P lookup). Its
    KV died with it: once ``up`` has restarted B, the index lists none of B's old chunks."""
    b = domain.url("demo-p2p-1")
    gateway, controller = domain.url("demo-gateway"), domain.url("demo-controller")
    me_a, me_b = domain.instance_id("demo-p2p-0"), domain.instance_id("demo-p2p-1")
    msgs = messages("the crash", 60)
    toks = tokens(b, msgs)
    full = len(toks) // CHUNK
    on_b = chat(b, msgs)
    # a controller restarted by an earlier test learns B's chunks once B has re-registered and
    # full-synced: within the rendered heartbeat interval, like the recovery test
    heartbeat_s = float(domain.config("demo-p2p-1")["lmcache_worker_heartbeat_time"])
    poll(
        "B's chunks",
        lambda: prefix_hits(controller, toks).get(me_b, 0) >= full,
        timeout_s=3 * heartbeat_s + SETTLE_S,
    )
    assert me_a not in prefix_hits(controller, toks)
    old = domain.kill("demo-p2p-1")
    t0 = time.monotonic()
    assert prefix_hits(controller, toks).get(me_b, 0) in (0, full)
    assert time.monotonic() - t0 < 5  # a dead instance never makes a lookup hang
    rerouted = chat(gateway, msgs)
    assert rerouted.headers.get("x-kvpool-instance") == "demo-p2p-0", rerouted.headers
    assert rerouted.text == on_b.text
    domain.restarted("demo-p2p-1", old)
    poll("B's old chunks gone", lambda: me_b not in prefix_hits(controller, toks), READY_S)
    # A computed it when rerouted; its admits reach the index asynchronously (LMCache batches them)
    poll("A's chunks", lambda: prefix_hits(controller, toks).get(me_a, 0) >= full)


@pytest.mark.parametrize(
    ("env", "value"),
    [("PYTHONHASHSEED", "1"), ("KVPOOL_DOMAIN_FINGERPRINT", "0123456789ab")],
)
def test_hand_edited_pod_is_refused_by_the_worker(
    domain: Domain, tmp_path: Path, env: str, value: str
) -> None:
    """A pod whose seed or fingerprint was edited by hand refuses to start, exit 2, and says
    which value is wrong (the controller never hears of it)."""

    def edit(w: Workload) -> None:
        assert w.env[env] != value
        w.env[env] = value

    controller = domain.url("demo-controller")
    before = metric(controller, "kvpool_controller_messages_total", '{type="RegisterMsg"}')
    with LocalStack(
        render_files([domain.file]).objects, tmp_path, cluster=cluster_from_state(domain.state)
    ) as stack:
        run = stack.start(stack.prepare("demo-p2p-1", edit=edit, as_name=f"edited-{env}"))
        assert run.proc.wait(timeout=READY_S) == 2
        log = run.log.read_text()
    assert "refusing to start" in log and "KVPOOL_DOMAIN_FINGERPRINT" in log, log
    assert ('"hash_seed":"1"' if env == "PYTHONHASHSEED" else "0123456789ab") in log, log
    after = metric(controller, "kvpool_controller_messages_total", '{type="RegisterMsg"}')
    assert after == before


def _refused(url: str) -> bool:
    try:
        resp = httpx.get(url, timeout=5)
    except httpx.TransportError:
        return False
    return resp.status_code == 503 and resp.json().get("status") == "refused"


def test_worker_of_another_domain_is_refused_by_the_controller(
    domain: Domain, tmp_path: Path
) -> None:
    """A worker rendered for the same pool with another hashSeed (an old-seed pod left over
    from a rollout) is self-consistent, so it starts; the controller refuses its registration
    by fingerprint, counts it and never indexes its KV; the worker turns unready, saying why."""
    other = tmp_path / "cpu-demo-seed1.yaml"
    docs = [d for d in yaml.safe_load_all(domain.file.read_text()) if d]
    assert docs[0]["spec"]["hashSeed"] == "0"
    docs[0]["spec"]["hashSeed"] = "1"
    other.write_text(yaml.safe_dump_all(docs))
    controller = domain.url("demo-controller")
    refusals = '{reason="fingerprint"}'
    before = metric(controller, "kvpool_controller_refusals_total", refusals)
    objects = render_files([other]).objects
    shared = cluster_from_state(domain.state)  # this domain's controller, fresh own ports
    own = {p: free_port() for p in workloads(objects)["demo-p2p-1"].ports.values()}
    cluster = dataclasses.replace(shared, ports={**shared.ports, **own})
    with LocalStack(objects, tmp_path, cluster=cluster) as old:
        stranger = old.rendered["demo-p2p-1"]
        (cfg,) = stranger.files.values()
        stranger_id = next(
            line.split(": ")[1] for line in cfg.splitlines() if "lmcache_instance_id" in line
        )
        run = old.start(old.prepare("demo-p2p-1", as_name="stranger"))
        poll(
            "refusal",
            lambda: metric(controller, "kvpool_controller_refusals_total", refusals) > before,
            READY_S,
        )
        log = domain.log("demo-controller")
        assert f"refusing instance {stranger_id}" in log and "fingerprint mismatch" in log
        assert not registered(controller, stranger_id)
        # The refused pod says why on its readiness probe, so it never receives traffic.
        ready = f"{run.url}/readyz"
        poll("refused pod unready", lambda: _refused(ready), READY_S)
        assert "refused" in httpx.get(ready, timeout=5).json()["status"]
        old.close(grace_s=5)  # a test pod: no need for the kubelet's full grace period
    print(json.dumps({"refused": stranger_id}))


def test_prometheus_sees_what_only_lmcache_exports_and_the_refusal_alert_fires(
    domain: Domain,
) -> None:
    """Last in the module, after the controller restart (a full sync) and the refused worker
    above, with one P2P pull and one PD request here (the P2P puller of the tests above was
    killed since, and its counters with it): every dashboard query and catalogued metric only
    the real LMCache engine with P2P and PD exports has series in the Prometheus of
    ``up --monitoring`` (the simulated domain covers the rest: test_monitoring.py), and the
    refused registration fired KvpoolFingerprintRefused for this pool."""
    prometheus, gateway = domain.url("prometheus"), domain.url("demo-gateway")
    a, b, controller = (domain.url(n) for n in (*P2P, "demo-controller"))
    msgs = messages("the pulled ledger", 60)
    toks = tokens(a, msgs)
    full = len(toks) // CHUNK
    assert chat(a, msgs).text
    me_a = domain.instance_id(P2P[0])
    poll("A's chunks", lambda: prefix_hits(controller, toks).get(me_a, 0) >= full)
    assert chat(b, msgs).cached >= full * CHUNK  # pulled from A
    reply = chat(gateway, messages("the PD ledger", 40), headers={"x-kvpool-pd": "demo-pd"})
    assert reply.text and reply.headers["x-kvpool-route-reason"] == "pd", reply.headers
    wait_for_series(prometheus, Needs.LMCACHE)

    def refused_alert() -> bool:
        return any(
            a["alertname"] == "KvpoolFingerprintRefused" and a["pool"] == "demo"
            for a in firing(prometheus)
        )

    poll("KvpoolFingerprintRefused firing", refused_alert, 60.0)
