"""End to end with the real clients: ``helm install`` and ``kubectl`` against
``kvpool-operator cluster``, the operator running as the chart describes it.

Why: users meet kvpool through Helm and kubectl. Here the real kubectl binary (1.32) and Helm's
own install action (helm-python-sdk: Helm v4's Go SDK) drive the local control plane, and the
real operator (the chart's Deployment: ``kvpool-operator run`` under its service account's
token, RBAC enforcing the chart's ClusterRole, its self-signed webhook) reconciles a simulated
domain (tests/sim-small.yaml: examples/sim-fleet.yaml with 4 instances, the product's simulated
engine) into processes the cluster's kubelet runs:

- ``kubectl apply`` with client-side validation (a typo'd field is refused by kubectl itself),
  ``kubectl wait --for=condition=Ready``, ``kubectl get`` with the CRDs' printer columns,
  ``kubectl explain``;
- the controller and the gateway run their default two replicas, each pod on its own ports,
  the gateway's Service the kubelet's proxy to both, the controller's to the leader;
- a request through the gateway's Service reaches the instance that holds its prefix (kv-hit,
  the cached tokens reported), also through the API server's services proxy;
- a domain the schemas accept refused at ``kubectl apply`` by the operator's webhook with the
  rule's message and fix;
- new routing (policy, weights) and ``kubectl scale p2pgroup`` reach each running gateway
  replica through its mounted gateway.yaml: the same processes apply them, nothing restarts
  them;
- ``kubectl scale p2pgroup``, a deleted worker pod recreated and registered again, a spec change
  rolling every pod of the domain onto the new fingerprint (the workers start while the new
  controller replicas still elect: they wait for the leader before LMCache registers);
- ``kubectl delete kvcachepool`` refused while members exist; the members' finalizers
  deregister their instances from the controller (through the cluster's service proxy), then
  the pool goes, and every pod's process with it.

One cluster for the module (the tests run in order and build on each other); bounded waits,
127.0.0.1 only. Skipped, saying why, only where kubectl is not installed. About 1 minute on
the shared 2-core box.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from upstack import CHUNK, chat, messages, poll, prefix_hits, registered, tokens

from kvpool.operator.cluster.main import ClusterProcess, service_url
from kvpool.operator.local.stack import pid_alive

ROOT = Path(__file__).resolve().parents[2]
DOMAIN = Path(__file__).resolve().parent / "sim-small.yaml"
KUBECTL = shutil.which("kubectl")
INSTANCES = [f"simsmall-sim-{i}" for i in range(4)]
#: spec.controller.replicas and spec.gateway.replicas as sim-small.yaml leaves them: the defaults
CONTROLLERS, GATEWAYS = 2, 2
READY_S = 240.0  # the operator, a controller, two gateways and four sims on a 2-core box

pytestmark = [
    pytest.mark.skipif(
        KUBECTL is None,
        reason="kubectl is not on PATH: these tests drive the real kubectl binary "
        "(https://kubernetes.io/docs/tasks/tools/)",
    ),
    pytest.mark.timeout(600),
]


@dataclass
class Cluster:
    """The running control plane and a kubectl bound to its kubeconfig."""

    proc: ClusterProcess
    state: dict[str, Any]

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        assert KUBECTL is not None
        env = {**os.environ, "KUBECONFIG": self.state["kubeconfig"]}
        done = subprocess.run(
            [KUBECTL, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.returncode}\n{done.stderr}")
        return done.stdout + done.stderr

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def url(self, service: str, port: str = "") -> str:
        return service_url(self.proc.state_dir, "default", service, port)

    def log(self) -> str:
        return self.proc.output.read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster"))
    state = proc.start()
    try:
        yield Cluster(proc, state)
    finally:
        proc.stop()


def _pods(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in cluster.json("get", "pods")["items"]}


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _instance_ids(cluster: Cluster) -> dict[str, str]:
    data = cluster.json("get", "configmap", "simsmall-sim-lmcache")["data"]
    out = {}
    for key, text in data.items():
        line = next(x for x in text.splitlines() if x.startswith("lmcache_instance_id:"))
        out[key.removesuffix(".yaml")] = line.split(":", 1)[1].strip()
    return out


def _gone(cluster: Cluster, kind: str, name: str) -> None:
    """Wait until the object is deleted (its finalizer handled); say why not, if not."""
    try:
        poll(
            f"{kind}/{name} deleted",
            lambda: "NotFound" in cluster.kubectl("get", kind, name, check=False),
            READY_S,
        )
    except AssertionError as exc:
        left = cluster.kubectl("get", kind, name, "-o", "yaml", check=False)
        logs = cluster.kubectl(
            "logs", "-n", "kvpool-system", "deployment/kvpool-operator", check=False
        )
        raise AssertionError(f"{exc}\n{left}\noperator log:\n{logs[-4000:]}") from None


def _columns(plural: str, wide: bool = False) -> list[str]:
    """NAME and the printer columns kubectl shows for a kind (``wide``: all of them)."""
    crd = yaml.safe_load((ROOT / "crds" / f"kvpool.io_{plural}.yaml").read_text())
    printer = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    return ["NAME", *(c["name"].upper() for c in printer if wide or not c.get("priority"))]


def _tables(text: str) -> list[list[dict[str, str]]]:
    """kubectl's tables (blank-line separated), each row a dict by header, cut at the header's
    column offsets (a cell may be empty)."""
    out = []
    for block in text.strip().split("\n\n"):
        header, *rows = block.splitlines()
        starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]
        names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        out.append(
            [
                {
                    n: row[a:b].strip()
                    for n, a, b in zip(names, starts, [*starts[1:], None], strict=True)
                }
                for row in rows
            ]
        )
    return out


def _registration(controller: str, instance_id: str) -> float:
    resp = httpx.post(
        f"{controller}/query_worker_info", json={"instance_id": instance_id}, timeout=10
    )
    infos = resp.json().get("worker_infos") or [] if resp.status_code == 200 else []
    return max((float(i["registration_time"]) for i in infos), default=0.0)


def test_helm_installs_the_chart_and_the_operator_runs_as_the_chart_describes(
    cluster: Cluster,
) -> None:
    import helm_python as helm

    with helm.Config(kubeconfig_path=cluster.state["kubeconfig"], namespace="kvpool-system") as h:
        release = h.install(
            ROOT / "charts" / "kvpool",
            "kvpool",
            {},
            namespace="kvpool-system",
            create_namespace=True,
            timeout=120,
        )
    assert release["status"] == "deployed"
    crds = cluster.kubectl("get", "crds")
    assert "kvcachepools.kvpool.io" in crds and "p2pgroups.kvpool.io" in crds
    cluster.kubectl(
        "wait",
        "--for=condition=Available",
        "deployment/kvpool-operator",
        "-n",
        "kvpool-system",
        f"--timeout={READY_S:.0f}s",
        timeout=READY_S + 10,
    )
    (pod,) = cluster.json("get", "pods", "-n", "kvpool-system")["items"]
    assert pod["spec"]["serviceAccountName"] == "kvpool-operator"
    assert pod["spec"]["containers"][0]["command"] == ["kvpool-operator", "run"]
    webhook = cluster.json("get", "validatingwebhookconfiguration", "kvpool.io")
    names = {w["name"] for w in webhook["webhooks"]}
    assert "kvcachepool.validate.kvpool.io" in names
    assert all(w["clientConfig"]["caBundle"] for w in webhook["webhooks"])
    assert all(
        w["clientConfig"]["service"]["name"] == "kvpool-operator-webhook"
        for w in webhook["webhooks"]
    )
    assert "Activity 'register.<locals>.login_handler' succeeded" in cluster.kubectl(
        "logs", "-n", "kvpool-system", pod["metadata"]["name"]
    )
    # The pod's API credentials are its service account's: RBAC grants what the chart's
    # ClusterRole says (the operator's lists; Secrets, for each domain's controller token),
    # refuses the rest (PersistentVolumeClaims).
    account = cluster.proc.state_dir / "pods" / "kvpool-system" / pod["metadata"]["name"]
    as_operator = ["--kubeconfig", str(account / "serviceaccount" / "kubeconfig")]
    assert "No resources found" in cluster.kubectl("get", "kvcachepools", "-A", *as_operator)
    assert "sh.helm.release" in cluster.kubectl(
        "get", "secrets", "-n", "kvpool-system", *as_operator
    )
    denied = cluster.kubectl("get", "pvc", "-n", "kvpool-system", *as_operator, check=False)
    assert (
        'User "system:serviceaccount:kvpool-system:kvpool-operator" cannot list resource '
        '"persistentvolumeclaims"' in denied
    ), denied


def test_apply_with_client_side_validation_wait_get_and_explain(cluster: Cluster) -> None:
    typo = DOMAIN.read_text().replace("replicas: 4", "replicaz: 4")
    typo_file = cluster.proc.state_dir / "typo.yaml"
    typo_file.write_text(typo)
    refused = cluster.kubectl("apply", "--validate=strict", "-f", str(typo_file), check=False)
    assert 'unknown field "replicaz"' in refused or "unknown field" in refused, refused
    assert "simsmall-sim" not in cluster.kubectl("get", "p2pgroups")
    cluster.kubectl("delete", "-f", str(typo_file), "--ignore-not-found")
    out = cluster.kubectl("apply", "-f", str(DOMAIN))
    assert "p2pgroup.kvpool.io/simsmall-sim created" in out
    cluster.kubectl(
        "wait",
        "--for=condition=Ready",
        "kvcachepool/simsmall",
        "p2pgroup/simsmall-sim",
        f"--timeout={READY_S:.0f}s",
        timeout=READY_S + 10,
    )
    cluster.kubectl(
        "wait",
        "--for=condition=Available",
        "deployment/simsmall-gateway",
        f"--timeout={READY_S:.0f}s",
        timeout=READY_S + 10,
    )
    _replicas_on_their_own_ports(cluster)
    pools, groups = _tables(cluster.kubectl("get", "kvcachepools,p2pgroups,pdpairs"))
    assert list(pools[0]) == _columns("kvcachepools")  # the CRD's printer columns, in order
    assert pools[0]["NAME"] == "kvcachepool.kvpool.io/simsmall"
    assert (pools[0]["READY"], pools[0]["SEED"], pools[0]["MEMBERS"]) == ("True", "0", "1")
    assert list(groups[0]) == _columns("p2pgroups")
    assert groups[0]["NAME"] == "p2pgroup.kvpool.io/simsmall-sim"
    assert (groups[0]["POOL"], groups[0]["INSTANCES"], groups[0]["READY"]) == (
        "simsmall",
        "4",
        "True",
    )
    (wide,) = _tables(cluster.kubectl("get", "p2pg", "-o", "wide"))
    assert list(wide[0]) == _columns("p2pgroups", wide=True)
    explained = cluster.kubectl("explain", "kvcachepool.spec.tiers")
    assert "KIND:       KVCachePool" in explained
    assert "cpu\t<Object>" in explained and "disk\t<Object>" in explained


def _replicas_on_their_own_ports(cluster: Cluster) -> None:
    """Every replica of the controller and of the gateway runs, each on ports of its own; the
    address of the Service of several replicas is the kubelet's proxy
    (tests/integration/test_cluster_replicas.py in operator/ checks whom it sends connections
    to): the controller's reaches the leader (its selector's role label), the gateway's both
    replicas (Ready)."""
    running = cluster.proc.state()["pods"]["default"]
    for component, count in (("controller", CONTROLLERS), ("gateway", GATEWAYS)):
        pods = cluster.json("get", "pods", "-l", f"kvpool.io/component={component}")["items"]
        names = [p["metadata"]["name"] for p in pods]
        assert len(names) == count, names
        ports = [running[n]["ports"]["http"] for n in names]
        assert len(set(ports)) == count, ports
        slots = sorted(running[n]["replica"] for n in names)
        assert slots == (list(range(count)) if count > 1 else [None])  # one replica: no slot
    if CONTROLLERS > 1:
        _one_leader_behind_the_service(cluster)
    gateways = cluster.json("get", "pods", "-l", "kvpool.io/component=gateway")["items"]
    assert all(_ready(p) for p in gateways)  # both endpoints of the gateway's Service
    proxied = cluster.proc.state()["services"]["default"]
    gateway = f"http://127.0.0.1:{proxied['simsmall-gateway']['8000']}"
    assert cluster.url("simsmall-gateway") == gateway
    assert gateway not in {f"http://127.0.0.1:{p['ports']['http']}" for p in running.values()}


def _one_leader_behind_the_service(cluster: Cluster) -> None:
    """With several controller replicas one leads, and the controller Service reaches it."""
    running = cluster.proc.state()["pods"]["default"]
    leader = poll(
        "one controller replica leading",
        lambda: [
            p["metadata"]["name"]
            for p in cluster.json("get", "pods", "-l", "kvpool.io/controller-role=leader")["items"]
        ],
        READY_S,
    )
    assert len(leader) == 1, leader
    controller = cluster.url("simsmall-controller", "9000")
    assert controller not in {f"http://127.0.0.1:{p['ports']['http']}" for p in running.values()}
    role = httpx.get(f"{controller}/readyz", timeout=10).json()["election"]
    assert role["role"] == "leader" and role["identity"].startswith(f"{leader[0]}_"), role


def test_a_request_through_the_gateway_service_hits_the_previous_ones_kv(
    cluster: Cluster,
) -> None:
    controller = cluster.url("simsmall-controller", "9000")
    ids = _instance_ids(cluster)
    poll(
        "every instance registered",
        lambda: all(registered(controller, i) for i in ids.values()),
        READY_S,
    )
    _a_repeat_hits(cluster, ids, "the cluster's harbor")
    models = json.loads(
        cluster.kubectl(
            "get",
            "--raw",
            "/api/v1/namespaces/default/services/simsmall-gateway:http/proxy/v1/models",
        )
    )
    assert models["data"][0]["id"] == "meta-llama/Llama-3.1-8B-Instruct"


def _a_repeat_hits(cluster: Cluster, ids: dict[str, str], topic: str) -> None:
    """A prompt through the gateway's Service is indexed under the instance that served it (its
    LMCache admits reach the controller), and the same prompt again is routed there as a
    kv-hit with its full chunks cached."""
    gateway, controller = (
        cluster.url("simsmall-gateway"),
        cluster.url("simsmall-controller", "9000"),
    )
    msgs = messages(topic, 120)
    toks = tokens(cluster.url("simsmall-sim-0"), msgs)
    full = len(toks) // CHUNK
    first = chat(gateway, msgs)
    served = first.headers["x-kvpool-instance"]
    assert served in INSTANCES
    poll(
        "the prefix indexed",
        lambda: prefix_hits(controller, toks).get(ids[served], 0) >= full,
        READY_S,
    )
    again = chat(gateway, msgs)
    assert again.headers["x-kvpool-instance"] == served, again.headers
    assert again.headers["x-kvpool-route-reason"] == "kv-hit", again.headers
    assert again.cached >= full * CHUNK, again.usage


def test_a_domain_the_schemas_accept_is_refused_by_the_webhook_with_the_fix(
    cluster: Cluster,
) -> None:
    bad = ROOT / "examples" / "invalid" / "cpu-mistakes.yaml"
    out = cluster.kubectl("apply", "-f", str(bad), check=False)
    assert "kvcachepool.kvpool.io/cpu-mistakes created" in out
    assert 'admission webhook "p2pgroup.validate.kvpool.io" denied the request' in out
    assert "2 KV heads do not split evenly over 3 TP ranks" in out
    assert "fix: set tensorParallelSize: 2" in out
    assert "[rule 4]" in out and "fix: remove tiers.disk from this pool" in out
    assert "cpu-mistakes-p2p" not in cluster.kubectl("get", "p2pgroups")
    cluster.kubectl("delete", "kvcachepool", "cpu-mistakes", "--wait=false")
    _gone(cluster, "kvcachepool", "cpu-mistakes")


def _gateway_process(cluster: Cluster) -> list[tuple[str, str, int, int]]:
    """Each gateway pod's (name, uid, process id, restart count)."""
    pods = cluster.json("get", "pods", "-l", "kvpool.io/component=gateway")["items"]
    running = cluster.proc.state()["pods"]["default"]
    out = []
    for pod in pods:
        name = pod["metadata"]["name"]
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        out.append((name, pod["metadata"]["uid"], running[name]["pid"], restarts))
    assert len(out) == GATEWAYS, out
    return sorted(out)


def _gateway_configs(cluster: Cluster) -> list[dict[str, Any]]:
    """What each gateway replica applies now (asked on its own port, not the Service's)."""
    out = []
    for name, *_ in _gateway_process(cluster):
        port = cluster.proc.state()["pods"]["default"][name]["ports"]["http"]
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).json()
        out.append(
            {"policy": ready["routing"], "instances": sorted(ready["instances"]), **ready["config"]}
        )
    return out


def _gateway_config(cluster: Cluster) -> dict[str, Any]:
    """What every gateway replica applies (policy, instances, source, last refusal) with each
    one's config generation, or {} while they differ."""
    configs = _gateway_configs(cluster)
    shared = [{k: c[k] for k in ("policy", "instances", "source", "rejected")} for c in configs]
    if any(s != shared[0] for s in shared):
        return {}
    return {**shared[0], "generations": [c["generation"] for c in configs]}


def test_new_routing_reaches_the_running_gateway_without_a_restart(cluster: Cluster) -> None:
    process = _gateway_process(cluster)
    before = poll("the gateway replicas agreeing", lambda: _gateway_config(cluster), READY_S)
    assert before["policy"] == "kv-aware" and before["source"] == "start", _gateway_configs(cluster)
    patch = '{"spec":{"gateway":{"routing":{"policy":"least-load","weights":{"load":2.5}}}}}'
    cluster.kubectl("patch", "kvcachepool", "simsmall", "--type", "merge", "-p", patch)
    poll(
        "every gateway replica applying the ConfigMap's new routing",
        lambda: _gateway_config(cluster).get("policy") == "least-load",
        READY_S,
    )
    after = _gateway_config(cluster)
    assert after["source"] == "file" and all(
        a > b for a, b in zip(after["generations"], before["generations"], strict=True)
    )
    assert after["rejected"] is None
    file = yaml.safe_load(
        cluster.json("get", "configmap", "simsmall-gateway")["data"]["gateway.yaml"]
    )
    assert file["routing"]["weights"]["load"] == 2.5
    back = '{"spec":{"gateway":{"routing":{"policy":"kv-aware"}}}}'
    cluster.kubectl("patch", "kvcachepool", "simsmall", "--type", "merge", "-p", back)
    poll("kv-aware again", lambda: _gateway_config(cluster).get("policy") == "kv-aware", READY_S)
    assert _gateway_process(cluster) == process  # same pods, same processes, never restarted


def test_scale_a_deleted_pod_recreated_and_a_spec_change_rolling_the_domain(
    cluster: Cluster,
) -> None:
    gateway = _gateway_process(cluster)
    assert "scaled" in cluster.kubectl("scale", "p2pgroup/simsmall-sim", "--replicas", "3")
    poll(
        "the fourth instance gone",
        lambda: set(_pods(cluster)) >= {f"{i}-0" for i in INSTANCES[:3]}
        and "simsmall-sim-3-0" not in _pods(cluster),
        READY_S,
    )
    poll(
        "the running gateways routing to three instances",
        lambda: _gateway_config(cluster).get("instances") == INSTANCES[:3],
        READY_S,
    )
    assert _gateway_process(cluster) == gateway  # the instance list changed live
    assert cluster.json("get", "p2pgroup", "simsmall-sim")["spec"]["replicas"] == 3
    poll(
        "three instances reported",
        lambda: cluster.json("get", "p2pgroup", "simsmall-sim")
        .get("status", {})
        .get("instancesDesired")
        == 3,
        READY_S,
    )

    controller = cluster.url("simsmall-controller", "9000")
    ids = _instance_ids(cluster)
    before = _registration(controller, ids["simsmall-sim-0"])
    old_uid = _pods(cluster)["simsmall-sim-0-0"]["metadata"]["uid"]
    cluster.kubectl("delete", "pod", "simsmall-sim-0-0")
    poll(
        "the pod recreated and Ready",
        lambda: (p := _pods(cluster).get("simsmall-sim-0-0"))
        and p["metadata"]["uid"] != old_uid
        and _ready(p),
        READY_S,
    )
    poll(
        "the instance registered again",
        lambda: _registration(controller, ids["simsmall-sim-0"]) > before,
        READY_S,
    )

    old = {n: p["metadata"]["uid"] for n, p in _pods(cluster).items()}
    fingerprint = cluster.json("get", "kvcachepool", "simsmall")["status"]["domainFingerprint"]
    cluster.kubectl(
        "patch", "kvcachepool", "simsmall", "--type", "merge", "-p", '{"spec":{"hashSeed":"7"}}'
    )
    poll(
        "a new fingerprint",
        lambda: cluster.json("get", "kvcachepool", "simsmall")["status"].get("domainFingerprint")
        not in (None, fingerprint),
        READY_S,
    )
    cluster.kubectl(
        "wait",
        "--for=condition=Ready",
        "kvcachepool/simsmall",
        f"--timeout={READY_S:.0f}s",
        timeout=READY_S + 10,
    )

    def rolled() -> bool:
        pods = _pods(cluster)
        return len(pods) == 3 + CONTROLLERS + GATEWAYS and all(
            p["metadata"]["uid"] not in old.values() and _ready(p) for p in pods.values()
        )

    poll("every pod of the domain replaced and Ready", rolled, READY_S)
    new_ids = _instance_ids(cluster)
    assert not set(new_ids.values()) & set(ids.values())  # the fingerprint is in every id
    controller = cluster.url("simsmall-controller", "9000")
    poll(
        "the new instances registered",
        lambda: all(registered(controller, i) for i in new_ids.values()),
        READY_S,
    )
    for pod in _pods(cluster).values():
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
        assert env["PYTHONHASHSEED"] == "7", pod["metadata"]["name"]
    # the workers started while the new controller replicas elected; they waited for the
    # leader before LMCache registered, so their admits reach it (a mute LMCache: 0 % hits)
    _a_repeat_hits(cluster, new_ids, "the rolled harbor")


def test_a_pool_with_members_is_kept_then_members_and_pool_go_with_their_processes(
    cluster: Cluster,
) -> None:
    pids = {
        n: p["pid"]
        for n, p in cluster.proc.state().get("pods", {}).get("default", {}).items()
        if p.get("pid")
    }
    assert len(pids) == 3 + CONTROLLERS + GATEWAYS
    refused = cluster.kubectl("delete", "kvcachepool", "simsmall", check=False)
    assert 'admission webhook "kvcachepool.validate.kvpool.io" denied the request' in refused
    assert "the pool still has members (P2PGroup/simsmall-sim)" in refused
    assert "fix: delete the members first" in refused
    cluster.kubectl("delete", "p2pgroup", "simsmall-sim", "--timeout=120s", timeout=130)
    log = cluster.log()
    assert "/v1/deregister" in log and "simsmall-controller.default.svc:9000" in log, log[-2000:]
    cluster.kubectl("delete", "kvcachepool", "simsmall", "--timeout=120s", timeout=130)
    (operator,) = cluster.json("get", "pods", "-n", "kvpool-system")["items"]
    statuses = operator["status"]["containerStatuses"]
    assert statuses[0]["restartCount"] == 0, "the operator restarted under the chart's RBAC"
    poll("every pod gone", lambda: not _pods(cluster), 120)
    poll("every process stopped", lambda: not [n for n, p in pids.items() if pid_alive(p)], 60)
    assert "No resources found" in cluster.kubectl("get", "kvcachepools,deployments,statefulsets")
