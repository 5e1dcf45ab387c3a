"""The operator reconciling KVCachePool / P2PGroup / PDPair against the emulated API server.

kopf runs in-process (a side thread) against ApiServer (apiserver.py), a kmock emulator taught
uid/resourceVersion/generation, JSON and merge patches, the status subresource, finalizers and
list→watch continuity. What it does not do, and where that is covered instead:
- ownerReference garbage collection: asserted as ownerReferences here; the operator prunes
  explicitly; real GC is exercised by e2e/tests/test_kind.py on a cluster;
- schema validation, defaulting and CEL of the CRDs: tests/unit/test_gen.py and
  test_cel_rules.py (kubernetes-validate, cel-python);
- admission webhooks: test_webhook.py posts AdmissionReviews to the operator's webhook server;
- RBAC: tests/unit/test_permissions.py checks every request the client makes is listed;
- pods, kubelets and StatefulSet controllers: tests create pods and set StatefulSet status
  by hand, as a cluster would.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import yaml
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example, test_settings

from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.loader import load_text
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.operator.validation import errors, validate_domain

POOLS = "kvpool.io/v1alpha1/kvcachepools"
P2PGS = "kvpool.io/v1alpha1/p2pgroups"
PDPS = "kvpool.io/v1alpha1/pdpairs"
STS = "apps/v1/statefulsets"
DEPLOY = "apps/v1/deployments"
CMS = "v1/configmaps"
EVENTS = "v1/events"


def one(server: ApiServer, resource: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in server.live(resource) if o["metadata"]["name"] == name]
    return obj


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    (cond,) = [c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype]
    return cond


def observed(server: ApiServer, resource: str, name: str) -> bool:
    obj = one(server, resource, name)
    return bool(obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"])


async def create_all(client: Client, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        await client.create(doc)


async def test_pool_and_members_become_children_with_ports_configs_and_status(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    docs = example("cpu-demo")
    await create_all(client, docs)
    await eventually(
        lambda: all(
            observed(apiserver, r, n)
            for r, n in [(POOLS, "demo"), (P2PGS, "demo-p2p"), (PDPS, "demo-pd")]
        )
    )
    pool = one(apiserver, POOLS, "demo")
    p2p = one(apiserver, P2PGS, "demo-p2p")
    sts = {o["metadata"]["name"]: o for o in apiserver.live(STS)}
    assert sorted(sts) == ["demo-p2p-0", "demo-p2p-1", "demo-pd-decode-0", "demo-pd-prefill-0"]
    owner = sts["demo-p2p-0"]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "P2PGroup",
        p2p["metadata"]["uid"],
        True,
    )
    controller = one(apiserver, DEPLOY, "demo-controller")
    assert controller["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    lmcache = one(apiserver, CMS, "demo-p2p-lmcache")["data"]
    assert sorted(lmcache) == ["demo-p2p-0.yaml", "demo-p2p-1.yaml"]
    status = p2p["status"]
    ports = {i["name"]: i["ports"] for i in status["instances"]}
    assert ports["demo-p2p-0"]["lmcache_worker_ports"] == [20001]
    assert ports["demo-p2p-1"]["p2p_init_ports"][0] != ports["demo-p2p-0"]["p2p_init_ports"][0]
    assert "lmcache_worker_ports:\n- 20001\n" in lmcache["demo-p2p-0.yaml"]
    assert status["pool"] == "demo" and status["tensorParallel"] == "1"
    assert status["memoryBudget"]["workers"] == 2
    assert condition(p2p, "ConfigValid")["status"] == "True"
    assert condition(p2p, "Ready")["reason"] == "InstancesNotReady"
    assert pool["status"]["resolvedHashSeed"] == "0"
    assert pool["status"]["memberCount"] == 2
    assert (
        pool["status"]["domainFingerprint"]
        == controller["spec"]["template"]["metadata"]["annotations"][names.ANNOTATION_FINGERPRINT]
    )
    writes = [
        r
        for r in apiserver._requests
        if r.method in ("POST", "PATCH") and "/events" not in str(r.url)
    ]
    ours = [r for r in writes if r.params.get("fieldManager") == "kvpool-operator"]
    assert ours and all("labels" in r.data.get("metadata", {}) or "status" in r.data for r in ours)


async def test_spec_edit_rerenders_and_bumps_observed_generation(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    await create_all(client, example("cpu-demo"))
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    before = one(apiserver, CMS, "demo-p2p-lmcache")["data"]["demo-p2p-0.yaml"]
    await client.patch("P2PGroup", "demo-p2p", {"spec": {"replicas": 3}})
    await eventually(lambda: one(apiserver, P2PGS, "demo-p2p")["status"]["observedGeneration"] == 2)
    assert "demo-p2p-2" in {o["metadata"]["name"] for o in apiserver.live(STS)}
    status = one(apiserver, P2PGS, "demo-p2p")["status"]
    assert status["instancesDesired"] == 3
    assert all(c["observedGeneration"] == 2 for c in status["conditions"])
    gateway = one(apiserver, CMS, "demo-gateway")["data"]["gateway.yaml"]
    assert "demo-p2p-2" in gateway
    assert one(apiserver, CMS, "demo-p2p-lmcache")["data"]["demo-p2p-0.yaml"] == before


async def test_fingerprint_change_rolls_every_workload_of_the_domain_in_one_pass(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    await create_all(client, example("cpu-demo"))
    await eventually(
        lambda: all(
            observed(apiserver, r, n)
            for r, n in [(POOLS, "demo"), (P2PGS, "demo-p2p"), (PDPS, "demo-pd")]
        )
    )
    old_fp = one(apiserver, POOLS, "demo")["status"]["domainFingerprint"]
    mark = len(apiserver._log)
    await client.patch("KVCachePool", "demo", {"spec": {"hashSeed": "7"}})
    await eventually(lambda: one(apiserver, POOLS, "demo")["status"]["domainFingerprint"] != old_fp)
    new_fp = one(apiserver, POOLS, "demo")["status"]["domainFingerprint"]
    workloads = apiserver.live(STS) + apiserver.live(DEPLOY)
    assert len(workloads) == 6  # 4 worker StatefulSets, controller and gateway
    for obj in workloads:
        annotations = obj["spec"]["template"]["metadata"]["annotations"]
        assert annotations[names.ANNOTATION_FINGERPRINT] == new_fp, obj["metadata"]["name"]
        env = {
            e["name"]: e.get("value")
            for e in obj["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["PYTHONHASHSEED"] == "7"
    # One pass: every workload's new template was written before the pool reported the new
    # fingerprint, and none was written after (no second, partial rollout).
    events = apiserver._log[mark:]
    status_at = next(
        i
        for i, (_, res, e) in enumerate(events)
        if res.plural == "kvcachepools"
        and e["object"].get("status", {}).get("domainFingerprint") == new_fp
    )
    rolled = [
        i
        for i, (_, res, e) in enumerate(events)
        if res.plural in ("statefulsets", "deployments") and e["type"] == "MODIFIED"
    ]
    assert len(rolled) == 6 and max(rolled) < status_at


async def test_invalid_spec_reports_problems_posts_event_creates_nothing_then_recovers(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    pool, p2p, _ = example("cpu-demo")
    bad_pool = copy.deepcopy(pool)
    bad_pool["spec"]["tiers"] = {"disk": {"path": "/kv", "size": "10Gi"}}
    await create_all(client, [bad_pool, p2p])
    await eventually(
        lambda: condition(one(apiserver, POOLS, "demo"), "ConfigValid")["status"] == "False"
    )
    loaded = load_text(yaml.safe_dump_all([bad_pool, p2p]), "x")
    cli_problems = errors(validate_domain(loaded.pools[0], loaded.members))
    valid = condition(one(apiserver, POOLS, "demo"), "ConfigValid")
    assert valid["reason"] == "InvalidSpec"
    for problem in cli_problems:
        assert f"{problem.path}: {problem.message} (fix: {problem.fix})" in valid["message"]
    assert condition(one(apiserver, POOLS, "demo"), "Ready")["status"] == "False"
    events = await eventually(
        lambda: [e for e in apiserver.live(EVENTS) if e["reason"] == "InvalidSpec"]
    )
    assert str(cli_problems[0]) in events[0]["message"]
    assert events[0]["involvedObject"]["kind"] == "KVCachePool"
    assert apiserver.live(STS) == [] and apiserver.live(DEPLOY) == [] and apiserver.live(CMS) == []
    passes = operator.runtime.metrics.count("domain", "invalid")
    await asyncio.sleep(0.3)
    assert operator.runtime.metrics.count("domain", "invalid") <= passes + 1
    await client.patch("KVCachePool", "demo", {"spec": {"tiers": {"disk": None}}})
    await eventually(
        lambda: condition(one(apiserver, POOLS, "demo"), "ConfigValid")["status"] == "True"
    )
    await eventually(lambda: len(apiserver.live(STS)) == 2)
    assert condition(one(apiserver, P2PGS, "demo-p2p"), "ConfigValid")["status"] == "True"


async def test_member_before_pool_is_pool_not_found_then_reconciles_when_pool_appears(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    pool, p2p, _ = example("cpu-demo")
    await client.create(p2p)
    await eventually(
        lambda: condition(one(apiserver, P2PGS, "demo-p2p"), "Ready")["reason"] == "PoolNotFound"
    )
    ready = condition(one(apiserver, P2PGS, "demo-p2p"), "Ready")
    assert "KVCachePool 'demo' does not exist in namespace 'default'" in ready["message"]
    await eventually(lambda: [e for e in apiserver.live(EVENTS) if e["reason"] == "PoolNotFound"])
    assert apiserver.live(STS) == []
    await client.create(pool)
    await eventually(lambda: len(apiserver.live(STS)) == 2)
    await eventually(
        lambda: condition(one(apiserver, P2PGS, "demo-p2p"), "Ready")["reason"]
        == "InstancesNotReady"
    )


async def test_pd_pair_is_announced_to_the_gateway_only_when_both_sides_are_ready(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    await create_all(client, example("cpu-demo"))
    await eventually(lambda: observed(apiserver, PDPS, "demo-pd"))
    assert "demo-pd" not in one(apiserver, CMS, "demo-gateway")["data"]["gateway.yaml"]
    await client.patch(
        "StatefulSet", "demo-pd-prefill-0", {"status": {"readyReplicas": 1}}, status=True
    )
    await asyncio.sleep(0.3)
    assert "demo-pd" not in one(apiserver, CMS, "demo-gateway")["data"]["gateway.yaml"]
    await client.patch(
        "StatefulSet", "demo-pd-decode-0", {"status": {"readyReplicas": 1}}, status=True
    )
    await eventually(
        lambda: "demo-pd" in one(apiserver, CMS, "demo-gateway")["data"]["gateway.yaml"]
    )
    await eventually(lambda: one(apiserver, PDPS, "demo-pd")["status"]["instancesReady"] == 2)
    assert condition(one(apiserver, PDPS, "demo-pd"), "Ready")["status"] == "True"


@pytest.mark.parametrize("settings_overrides", [{"drift_interval": 0.3}])
async def test_drift_timer_names_the_pod_with_another_seed_and_ports(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    await create_all(client, example("cpu-demo"))
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    template = one(apiserver, STS, "demo-p2p-0")["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-p2p-0-0",
            "labels": template["metadata"]["labels"],
            "annotations": {
                **template["metadata"]["annotations"],
                names.ANNOTATION_FINGERPRINT: "0123456789ab",
            },
        },
        "spec": copy.deepcopy(template["spec"]),
        "status": {"phase": "Running"},
    }
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = 31999
    await client.create(pod, "default")
    await eventually(
        lambda: condition(one(apiserver, P2PGS, "demo-p2p"), "HashSeedConsistent")["status"]
        == "False"
    )
    p2p = one(apiserver, P2PGS, "demo-p2p")
    seed = condition(p2p, "HashSeedConsistent")
    assert seed["reason"] == "PodSeedMismatch" and "pod demo-p2p-0-0" in seed["message"]
    ports = condition(p2p, "PortsConsistent")
    assert ports["status"] == "False" and "pod demo-p2p-0-0" in ports["message"]
    assert condition(p2p, "Progressing")["status"] == "True"
    pool = one(apiserver, POOLS, "demo")
    assert "demo-p2p-0-0" in condition(pool, "HashSeedConsistent")["message"]


async def test_operator_restart_keeps_the_generated_seed(
    apiserver: ApiServer, client: Client
) -> None:
    pool, p2p, _ = example("cpu-demo")
    pool = copy.deepcopy(pool)
    pool["spec"]["hashSeed"] = "auto"
    first = OperatorThread(str(apiserver.url), test_settings()).start()
    await first.wait_ready()
    await create_all(client, [pool, p2p])
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    seed = one(apiserver, POOLS, "demo")["status"]["resolvedHashSeed"]
    assert seed and one(apiserver, CMS, "demo-domain")["data"]["PYTHONHASHSEED"] == seed
    versions = {
        o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in apiserver.live(STS)
    }
    await first.stop()
    second = OperatorThread(str(apiserver.url), test_settings()).start()
    await second.wait_ready()
    await eventually(lambda: second.runtime.metrics.count("domain", "ok") >= 1)
    assert one(apiserver, POOLS, "demo")["status"]["resolvedHashSeed"] == seed
    assert {
        o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in apiserver.live(STS)
    } == versions
    await second.stop()


def test_stored_seed_survives_a_lost_status() -> None:
    from kvpool.operator.runtime.plan import stored_seed

    cm = {
        "kind": "ConfigMap",
        "metadata": {"labels": {names.LABEL_COMPONENT: "domain"}},
        "data": {"PYTHONHASHSEED": "42"},
    }
    assert stored_seed({"status": {"resolvedHashSeed": "7"}}, [cm]) == "7"
    assert stored_seed({"status": {}}, [cm]) == "42"
    assert stored_seed({}, []) is None


def test_fingerprint_in_status_is_the_render_contract() -> None:
    pool = KVCachePool.model_validate(example("cpu-demo")[0])
    assert len(pool_fingerprint(pool)) == 12
