"""``kvpool-operator up``'s plan of a rendered domain: only what a cluster provides changes.

Why: every end-to-end claim of ``e2e/tests/test_local_stack.py`` rests on the processes
running the operator's render, not a hand-made variant. These tests run no process: they
take the real render of ``examples/cpu-demo.yaml`` and check that the local form differs from
it only by DNS names, bind addresses, ports and mount paths, that those rewrites are
consistent across workloads (a worker's controller URL reaches the controller's local
socket), and that the independent rewrite check fails on any other change.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kvpool.operator.local import plan as ls
from kvpool.operator.local import rewrite as lr
from kvpool.operator.local.stack import pid_alive
from kvpool.operator.local.up import render_files

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cpu-demo.yaml"
#: The controller's API token, which a cluster keeps in the domain's Secret (up: a fresh value).
SECRETS = {("demo-controller-token", "token"): "s3cret"}
#: the downward API of a controller replica (with several, they elect on their pod's name)
FIELDS = lr.pod_fields("demo-controller-0", "default")


@pytest.fixture(scope="module")
def objects() -> list[ls.Obj]:
    return render_files([EXAMPLE]).objects


def _ports() -> ls.Allocate:
    """Local ports for the plan: pure, deterministic (no socket is opened here)."""
    return itertools.count(40000).__next__


def test_extracts_every_workload_with_its_mounted_lmcache_config(objects: list[ls.Obj]) -> None:
    loads = ls.workloads(objects)
    workers = {n for n, w in loads.items() if w.component == "worker"}
    assert workers == {"demo-p2p-0", "demo-p2p-1", "demo-pd-prefill-0", "demo-pd-decode-0"}
    assert loads["demo-controller"].argv[0] == "kvpool-controller"
    for name in workers:
        w = loads[name]
        assert w.argv[:2] == ["kvpool-worker", "serve"]
        mounted = w.env["LMCACHE_CONFIG_FILE"]
        assert list(w.files) == [mounted]
        assert yaml.safe_load(w.files[mounted])["lmcache_instance_id"].startswith(f"{name}~")


def test_rewrite_touches_only_cluster_provided_values(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    cmap = ls.cluster_map(objects, _ports())
    for name, w in ls.workloads(objects).items():
        lw = lr.localize(w, cmap, tmp_path, SECRETS, FIELDS)
        changes = lr.check_rewrite(w, lw, cmap)
        assert changes, name
        assert all(v == ls.LOOPBACK or not v.startswith("0.0.0.0") for v in lw.argv)
        # Identity, seed and every non-address setting are byte-for-byte the render's.
        for key in ("PYTHONHASHSEED", "KVPOOL_DOMAIN_FINGERPRINT"):
            assert lw.env[key] == w.env[key]
        for mounted, text in w.files.items():
            if w.component != "worker":
                continue  # nested configs: check_rewrite above covers every leaf
            before = yaml.safe_load(text)
            after = yaml.safe_load(lw.files[lw.file_map[mounted]])
            assert set(before) == set(after)
            kept = {k for k in before if not any(s in k.lower() for s in ("port", "host", "url"))}
            assert {k: after[k] for k in kept} == {k: before[k] for k in kept}


def test_gateway_routing_config_reaches_local_workers(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    """Nested addresses (the gateway's instance URLs) move with their workers' ports."""
    cmap = ls.cluster_map(objects, _ports())
    loads = ls.workloads(objects)
    gw = lr.localize(loads["demo-gateway"], cmap, tmp_path)
    cfg = yaml.safe_load(next(iter(gw.files.values())))
    urls = {i["name"]: i["url"] for g in cfg["p2pGroups"] for i in g["instances"]}
    for name, url in urls.items():
        port = lr.localize(loads[name], cmap, tmp_path).ports["http"]
        assert url == f"http://{ls.LOOPBACK}:{port}"
    ctl = lr.localize(loads["demo-controller"], cmap, tmp_path, SECRETS, FIELDS)
    assert cfg["controllerUrl"] == f"http://{ls.LOOPBACK}:{ctl.ports['http']}"


def test_a_gateway_replica_binds_its_own_ports_and_reaches_the_decoders_ports(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    """A replica binds its own ports (its PD proxy port too), but a bare port number of another
    workload in its config (a PD decoder's init and alloc ports) is that workload's local port:
    the NIXL sender of the prefill reaches the decoder there, not at its container port."""
    cmap = ls.cluster_map(objects, _ports())
    loads = ls.workloads(objects)
    one = cmap.for_replica("demo-gateway", 1)
    gw = lr.localize(loads["demo-gateway"], one, tmp_path)
    lr.check_rewrite(loads["demo-gateway"], gw, one)
    (pair,) = yaml.safe_load(next(iter(gw.files.values())))["pdPairs"]
    (decode,) = pair["decode"]
    assert decode["initPorts"] == [cmap.ports[21011]] and decode["allocPorts"] == [
        cmap.ports[21012]
    ]
    own = cmap.replicas["demo-gateway"][1]
    assert pair["proxyPort"] == own[7500] != cmap.ports[7500]
    assert gw.ports == {n: own[p] for n, p in loads["demo-gateway"].ports.items()}


def test_worker_and_controller_addresses_meet_on_the_same_local_sockets(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    cmap = ls.cluster_map(objects, _ports())
    loads = ls.workloads(objects)
    ctl = lr.localize(loads["demo-controller"], cmap, tmp_path, SECRETS, FIELDS)
    monitor = json.loads(ctl.argv[ctl.argv.index("--monitor-ports") + 1])
    assert monitor["pull"] == ctl.ports["pull"] and monitor["reply"] == ctl.ports["reply"]
    assert ctl.argv[ctl.argv.index("--port") + 1] == str(ctl.ports["http"])
    for name in ("demo-p2p-0", "demo-p2p-1"):
        lw = lr.localize(loads[name], cmap, tmp_path)
        cfg = yaml.safe_load(next(iter(lw.files.values())))
        assert cfg["controller_pull_url"] == f"{ls.LOOPBACK}:{monitor['pull']}"
        assert cfg["controller_reply_url"] == f"{ls.LOOPBACK}:{monitor['reply']}"
        assert cfg["lmcache_worker_ports"] == [lw.ports["wrk-0"]]
        assert lw.argv[lw.argv.index("--port") + 1] == str(lw.ports["http"])
        assert lw.env["POD_IP"] == lw.env["LMCACHE_P2P_HOST"] == ls.LOOPBACK
    all_ports = list(cmap.ports.values())
    assert len(set(all_ports)) == len(all_ports)


@pytest.mark.parametrize(
    ("where", "mutate"),
    [
        ("chunk_size", lambda cfg: cfg.update(chunk_size=128)),
        ("lmcache_instance_id", lambda cfg: cfg.update(lmcache_instance_id="other~0123456789ab")),
        ("controller_pull_url", lambda cfg: cfg.update(controller_pull_url="10.0.0.9:8300")),
        ("enable_p2p", lambda cfg: cfg.update(enable_p2p=False)),
    ],
)
def test_rewrite_check_refuses_any_other_change(
    objects: list[ls.Obj], tmp_path: Path, where: str, mutate: object
) -> None:
    cmap = ls.cluster_map(objects, _ports())
    w = ls.workloads(objects)["demo-p2p-0"]
    lw = lr.localize(w, cmap, tmp_path)
    path = next(iter(lw.files))
    cfg = yaml.safe_load(lw.files[path])
    mutate(cfg)  # type: ignore[operator]
    lw.files[path] = yaml.safe_dump(cfg)
    with pytest.raises(ls.StackError, match=where):
        lr.check_rewrite(w, lw, cmap)


def test_rewrite_check_refuses_a_changed_flag_or_env(objects: list[ls.Obj], tmp_path: Path) -> None:
    cmap = ls.cluster_map(objects, _ports())
    w = ls.workloads(objects)["demo-p2p-0"]
    lw = lr.localize(w, cmap, tmp_path)
    lw.argv[lw.argv.index("--block-size") + 1] = "32"
    with pytest.raises(ls.StackError, match="'16' -> '32'"):
        lr.check_rewrite(w, lw, cmap)
    lw = lr.localize(w, cmap, tmp_path)
    lw.env["PYTHONHASHSEED"] = "1"
    with pytest.raises(ls.StackError, match="PYTHONHASHSEED"):
        lr.check_rewrite(w, lw, cmap)


def test_a_port_outside_the_domain_is_an_error(objects: list[ls.Obj], tmp_path: Path) -> None:
    cmap = ls.cluster_map(objects, _ports())
    w = ls.workloads(objects)["demo-p2p-0"]
    path = next(iter(w.files))
    cfg = yaml.safe_load(w.files[path])
    cfg["controller_pull_url"] = "demo-controller.default.svc:1234"
    w.files[path] = yaml.safe_dump(cfg)
    with pytest.raises(ls.StackError, match="port 1234 is not a port of any Service"):
        lr.localize(w, cmap, tmp_path)


def _redis_domain(tmp_path: Path) -> list[ls.Obj]:
    text = EXAMPLE.read_text().replace(
        "  tiers:\n    cpu:\n      size: 1Gi\n",
        "  tiers:\n    cpu:\n      size: 1Gi\n    remote:\n      redis: {url: redis://kv-redis:6379}\n"
        "  controller:\n    persistence: {mode: redis, redisUrl: 'redis://kv-redis:6379/1'}\n",
    )
    assert "kv-redis" in text
    path = tmp_path / "redis.yaml"
    path.write_text(text)
    return render_files([path]).objects


def test_a_redis_the_pool_names_is_one_local_service_for_every_reader(tmp_path: Path) -> None:
    """The tier's remote_url and the controller's --redis-url move to the same local Redis."""
    objects = _redis_domain(tmp_path)
    pool = render_files([tmp_path / "redis.yaml"]).pools[0]
    services = ls.named_services(pool)
    assert [(s.kind, s.host, s.port) for s in services] == [("redis", "kv-redis", 6379)]
    cmap = ls.cluster_map(objects, _ports(), services)
    port = cmap.external[("kv-redis", 6379)]
    loads = ls.workloads(objects)
    ctl = lr.localize(loads["demo-controller"], cmap, tmp_path, SECRETS, FIELDS)
    assert ctl.argv[ctl.argv.index("--redis-url") + 1] == f"redis://{ls.LOOPBACK}:{port}/1"
    lr.check_rewrite(loads["demo-controller"], ctl, cmap)
    wrk = lr.localize(loads["demo-p2p-0"], cmap, tmp_path)
    cfg = yaml.safe_load(next(iter(wrk.files.values())))
    assert cfg["remote_url"] == f"redis://{ls.LOOPBACK}:{port}"
    lr.check_rewrite(loads["demo-p2p-0"], wrk, cmap)
    # Another Redis address is not the named one: refused by the check.
    cfg["remote_url"] = f"redis://{ls.LOOPBACK}:{port + 1}"
    wrk.files[next(iter(wrk.files))] = yaml.safe_dump(cfg)
    with pytest.raises(ls.StackError, match="remote_url"):
        lr.check_rewrite(loads["demo-p2p-0"], wrk, cmap)


def test_a_secret_the_pod_reads_needs_a_value(objects: list[ls.Obj], tmp_path: Path) -> None:
    cmap = ls.cluster_map(objects, _ports())
    w = ls.workloads(objects)["demo-gateway"]
    w.secret_env["KVPOOL_GATEWAY_AUTH_TOKEN"] = ("token", "token")
    with pytest.raises(ls.StackError, match="Secret token/token"):
        lr.localize(w, cmap, tmp_path)
    lw = lr.localize(w, cmap, tmp_path, {("token", "token"): "s3cret"})
    assert lw.env["KVPOOL_GATEWAY_AUTH_TOKEN"] == "s3cret"
    assert any("secretKeyRef token/token" in c for c in lr.check_rewrite(w, lw, cmap))


def test_up_starts_a_cluster_s_order_and_refuses_engines_it_cannot_run(tmp_path: Path) -> None:
    from kvpool.operator.local.stack import LocalStack
    from kvpool.operator.local.up import stages, start_order

    stack = LocalStack(render_files([EXAMPLE]).objects, tmp_path, cluster=ls.ClusterMap(
        frozenset(), {}, {}))  # fmt: skip
    order = start_order(stack)
    assert [stack.rendered[s[0]].component for s in stages(stack, order)] == [
        "controller",
        "worker",
        "gateway",
    ]
    gpu = LocalStack(
        render_files([EXAMPLE.parent / "cuda-mooncake.yaml"]).objects,
        tmp_path,
        cluster=ls.ClusterMap(frozenset(), {}, {}),
    )
    with pytest.raises(ls.StackError, match=r"engine\.platform: cpu"):
        start_order(gpu)


def test_a_mounted_file_named_by_a_flag_is_the_local_file(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    """The gateway's ``--config /etc/kvpool/gateway/gateway.yaml`` reads the local copy."""
    cmap = ls.cluster_map(objects, _ports())
    w = ls.workloads(objects)["demo-gateway"]
    lw = lr.localize(w, cmap, tmp_path)
    local = lw.argv[lw.argv.index("--config") + 1]
    assert local in lw.files and local != w.argv[w.argv.index("--config") + 1]
    lr.check_rewrite(w, lw, cmap)


def test_gflags_style_flags_and_kubelet_env_references_are_rewritten(tmp_path: Path) -> None:
    """Mooncake's ``--port=50051`` and the store's ``$(POD_IP)`` / master address move too."""
    pool = next(yaml.safe_load_all(EXAMPLE.read_text()))
    pool["spec"]["tiers"]["remote"] = {"mooncake": {"segmentSize": "256Mi"}}
    (tmp_path / "mc.yaml").write_text(yaml.safe_dump(pool))
    objects = render_files([tmp_path / "mc.yaml"]).objects
    cmap = ls.cluster_map(objects, _ports())
    loads = ls.workloads(objects)
    master = lr.localize(loads["demo-mooncake-master"], cmap, tmp_path)
    local = cmap.ports[50051]
    assert master.argv[1] == f"--port={local}"
    lr.check_rewrite(loads["demo-mooncake-master"], master, cmap)
    store = lr.localize(loads["demo-mooncake-store"], cmap, tmp_path)
    assert store.env["MOONCAKE_MASTER"] == f"{ls.LOOPBACK}:{local}"
    assert store.env["MOONCAKE_LOCAL_HOSTNAME"] == ls.LOOPBACK  # $(POD_IP), expanded
    lr.check_rewrite(loads["demo-mooncake-store"], store, cmap)
    master.argv[2] = "--eviction_ratio=0.5"
    with pytest.raises(ls.StackError, match="eviction_ratio"):
        lr.check_rewrite(loads["demo-mooncake-master"], master, cmap)


def test_local_stack_root_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes run with cwd=root and get config paths under it: a relative --state-dir (the
    default .kvpool/up) must not turn into paths relative to the wrong directory."""
    from kvpool.operator.local.stack import LocalStack

    monkeypatch.chdir(tmp_path)
    stack = LocalStack([], Path(".kvpool/up"))
    assert stack.root == tmp_path / ".kvpool" / "up"
    assert stack.root.is_dir()


def test_an_exited_child_not_yet_reaped_is_not_alive() -> None:
    """``down`` waits for ``up`` to exit; when ``up`` is a child of the caller (``UpProcess``)
    it stays a zombie until waited on, which must not count as running."""
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while pid_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(proc.pid)
    assert proc.wait(timeout=5) == 0
    assert pid_alive(os.getpid())


def test_two_controller_replicas_get_own_ports_behind_the_services_proxy(tmp_path: Path) -> None:
    """With ``spec.controller.replicas: 2`` each replica binds its own local ports; the
    controller Service's ports become one proxy (``balance.balanced_services``) selecting the
    leader at run time, and every address naming the Service (the workers' controller URLs, a
    replica's own --leader-pub-url and --heartbeat-url) goes to the proxy, never to a replica.
    The gateway's two replicas (the default) are behind their Service's proxy as well."""
    from kvpool.operator.local.balance import balanced_services
    from kvpool.protocol.domain import CONTROLLER_LEADER, CONTROLLER_ROLE_LABEL

    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    docs[0]["spec"]["controller"] = {"replicas": 2}
    path = tmp_path / "ha.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    objects = render_files([path]).objects
    cmap = ls.cluster_map(objects, _ports())
    (a, b) = cmap.replicas["demo-controller"]
    service_ports = {cmap.ports[p] for p in a}
    assert set(a) == set(b) and not (set(a.values()) & set(b.values()))
    assert not (set(a.values()) | set(b.values())) & service_ports
    proxies = {p.service: p for p in balanced_services(objects, cmap)}
    assert set(proxies) == {"demo-controller", "demo-gateway"}
    assert set(cmap.replicas) == {"demo-controller", "demo-gateway"}
    proxy = proxies["demo-controller"]
    assert proxy.service == proxy.workload == "demo-controller"
    assert proxy.selector[CONTROLLER_ROLE_LABEL] == CONTROLLER_LEADER
    assert set(proxy.listen) == service_ports and set(proxy.listen.values()) == set(a)

    loads = ls.workloads(objects)
    assert loads["demo-controller"].replicas == 2
    replica = lr.localize(
        loads["demo-controller"],
        cmap.for_replica("demo-controller", 1),
        tmp_path,
        SECRETS,
        lr.pod_fields("demo-controller-1", "default"),
    )
    assert replica.ports == {n: b[p] for n, p in loads["demo-controller"].ports.items()}
    pub = cmap.ports[pool_port(objects, "pub")]
    argv = replica.argv
    assert argv[argv.index("--leader-pub-url") + 1] == f"tcp://{ls.LOOPBACK}:{pub}"
    heartbeat = cmap.ports[pool_port(objects, "heartbeat")]
    assert argv[argv.index("--heartbeat-url") + 1] == f"{ls.LOOPBACK}:{heartbeat}"
    assert replica.env["POD_NAME"] == "demo-controller-1"
    lr.check_rewrite(loads["demo-controller"], replica, cmap.for_replica("demo-controller", 1))
    worker = lr.localize(loads["demo-p2p-0"], cmap, tmp_path)
    pull = cmap.ports[pool_port(objects, "pull")]
    assert (
        f"{ls.LOOPBACK}:{pull}"
        in yaml.safe_load(next(iter(worker.files.values())))["controller_pull_url"]
    )


def test_replica_maps_handed_out_are_kept_as_the_cluster_changes(objects: list[ls.Obj]) -> None:
    """``kvpool-operator cluster``'s kubelet keeps a replica's ports for its pod's lifetime:
    maps handed out stay as they are, a scale-up adds maps, a Deployment scaled to one keeps
    its maps (and so its Service's proxy) while they are handed back, a port the template adds
    is mapped in each kept map."""
    cmap = ls.cluster_map(objects, _ports())
    kept = dict(cmap.replicas)
    again = ls.cluster_map(objects, _ports(), (), cmap.ports, kept)
    assert again.replicas == kept and again.ports == cmap.ports
    scaled = copy.deepcopy(objects)
    (gateway,) = [
        o for o in scaled if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-gateway"
    ]
    gateway["spec"]["replicas"] = 3
    up = ls.cluster_map(scaled, _ports(), (), cmap.ports, kept)
    assert up.replicas["demo-gateway"][:2] == kept["demo-gateway"]
    assert len(up.replicas["demo-gateway"]) == 3
    used = {p for maps in kept.values() for m in maps for p in m.values()} | set(
        cmap.ports.values()
    )
    assert not set(up.replicas["demo-gateway"][2].values()) & used
    gateway["spec"]["replicas"] = 1
    down = ls.cluster_map(scaled, _ports(), (), cmap.ports, kept)
    assert down.replicas["demo-gateway"] == kept["demo-gateway"]
    assert "demo-gateway" not in ls.cluster_map(scaled, _ports(), (), cmap.ports).replicas
    gateway["spec"]["template"]["spec"]["containers"][0]["ports"].append(
        {"name": "extra", "containerPort": 8099}
    )
    grown = ls.cluster_map(scaled, _ports(), (), cmap.ports, kept)
    for old, new in zip(kept["demo-gateway"], grown.replicas["demo-gateway"], strict=True):
        assert {p: new[p] for p in old} == old and 8099 in new


def pool_port(objects: list[ls.Obj], role: str) -> int:
    (controller,) = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-controller"
    ]
    (container,) = controller["spec"]["template"]["spec"]["containers"]
    return next(int(p["containerPort"]) for p in container["ports"] if p["name"] == role)
