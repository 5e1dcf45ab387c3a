"""Leader election against a Kubernetes API: the controller's Lease client and election steps
(``kube.py``, ``ha.py``) with the ServiceAccount, Role and RoleBinding the operator renders for
the cpu-demo domain with two controller replicas, RBAC enforced.

Mock: the API server is ``kvpool-operator cluster``'s (kmock's Kubernetes emulator, grown; the
operator's integration tests use it too): no real API server can run on these machines. It
stores Leases with resourceVersions (409 on a stale update or a second create), merge-patches
pods and authorizes every request by the stored Roles and bindings. Time is the candidates'
own monotonic clocks, injected, so a lease "expires" without waiting for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest

from kvpool.controller.ha import Ha
from kvpool.controller.kube import ConflictError, KubeClient, KubeConfig, KubeError
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.operator.cluster.apiserver import ApiServer
from kvpool.operator.loader import load_text
from kvpool.operator.render import render_domain

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cpu-demo.yaml"
NS, LEASE = "default", "demo-controller"
ADMIN, SA = "admin-token", "controller-token"
PODS = ("demo-controller-a", "demo-controller-b")


@pytest.fixture
async def api() -> AsyncIterator[tuple[str, ApiServer]]:
    users = {
        ADMIN: {"username": "admin", "groups": ["system:masters", "system:authenticated"]},
        SA: {
            "username": f"system:serviceaccount:{NS}:{LEASE}",
            "groups": ["system:serviceaccounts", "system:authenticated"],
        },
    }
    async with (
        ApiServer(declare_kvpool=False, record=False, authorize=True, users=users) as server,
        kmock.Server(server),
    ):
        url = str(server.url).rstrip("/")
        rendered = _rendered_election_objects()
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}
        ) as admin:
            for obj in rendered:
                group = obj["apiVersion"]
                root = "/api/v1" if group == "v1" else f"/apis/{group}"
                plural = {"ServiceAccount": "serviceaccounts", "Role": "roles"}.get(
                    obj["kind"], "rolebindings"
                )
                resp = await admin.post(f"{root}/namespaces/{NS}/{plural}", json=obj)
                assert resp.status_code == 201, resp.text
            for pod in PODS:
                body = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod, "namespace": NS},
                    "spec": {"containers": [{"name": "c", "image": "i"}]},
                }
                resp = await admin.post(f"/api/v1/namespaces/{NS}/pods", json=body)
                assert resp.status_code == 201, resp.text
        yield url, server


def _rendered_election_objects() -> list[dict[str, Any]]:
    loaded = load_text(EXAMPLE.read_text(encoding="utf-8"), str(EXAMPLE))
    (domain,) = loaded.domains()
    domain.pool.spec.controller.replicas = 2  # election (and its RBAC) only with several
    objects = render_domain(domain.pool, domain.members)
    return [
        o
        for o in objects
        if o["kind"] in ("ServiceAccount", "Role", "RoleBinding") and o["metadata"]["name"] == LEASE
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def candidate(url: str, pod: str, clock: Clock) -> Ha:
    settings = ControllerSettings(
        lease_name=LEASE,
        leader_pub_url="tcp://127.0.0.1:1",
        leader_snapshot_url="tcp://127.0.0.1:2",
        pod_name=pod,
        pod_namespace=NS,
    )
    kube = KubeClient(KubeConfig(server=url, token=SA), NS)
    return Ha(ControllerServer(settings), kube, clock=clock)


async def _lease(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as admin:
        resp = await admin.get(
            f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}",
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        resp.raise_for_status()
        spec: dict[str, Any] = resp.json()["spec"]
        return spec


async def _label(url: str, pod: str) -> str | None:
    async with httpx.AsyncClient(base_url=url) as admin:
        resp = await admin.get(
            f"/api/v1/namespaces/{NS}/pods/{pod}", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        labels = resp.json()["metadata"].get("labels") or {}
        return labels.get("kvpool.io/controller-role")


async def test_one_leader_then_the_standby_after_the_lease_expires(
    api: tuple[str, ApiServer],
) -> None:
    """a creates the Lease and leads; b waits on its own clock; a renews (b's clock restarts);
    a dies (stops renewing): 3 s later on b's clock b takes over (transition 1); a, alive
    again, finds its update refused (409), reads b as holder and steps down; b releases on a
    graceful stop and a new candidate takes the Lease at once (transition 2)."""
    url, _ = api
    ca, cb = Clock(), Clock()
    a, b = candidate(url, PODS[0], ca), candidate(url, PODS[1], cb)
    await a.label("standby")
    await b.label("standby")
    assert await _label(url, PODS[0]) == "standby"

    assert await a.try_acquire()
    spec = await _lease(url)
    assert spec["holderIdentity"] == a.identity and spec["leaseTransitions"] == 0
    assert spec["leaseDurationSeconds"] == 3 and spec["acquireTime"] == spec["renewTime"]
    await a.label("leader")
    assert await _label(url, PODS[0]) == "leader"

    assert not await b.try_acquire()  # valid: b waits
    ca.now += 0.5
    assert await a.renew(reread=False)
    cb.now += 2.9
    assert not await b.try_acquire()  # the renewal restarted b's clock
    cb.now += 2.9
    assert not await b.try_acquire()  # 2.9 s since it saw the renewal: still valid
    cb.now += 0.2  # a is gone: nothing changed for 3.1 s of b's time
    assert await b.try_acquire()
    spec = await _lease(url)
    assert spec["holderIdentity"] == b.identity and spec["leaseTransitions"] == 1

    ca.now += 0.5
    with pytest.raises(ConflictError):  # its stale resourceVersion
        await a.renew(reread=False)
    assert not await a.renew(reread=True)  # b holds it: step down at once
    assert not a.leading

    await b.release()
    spec = await _lease(url)
    assert spec["holderIdentity"] == "" and spec["leaseTransitions"] == 1
    c = candidate(url, PODS[0], Clock())  # a restarted: a new identity
    assert await c.try_acquire()
    spec = await _lease(url)
    assert spec["holderIdentity"] == c.identity and spec["leaseTransitions"] == 2
    for x in (a, b, c):
        await x.kube.close()


async def test_candidates_racing_for_a_released_lease_get_one_winner(
    api: tuple[str, ApiServer],
) -> None:
    """Four candidates read the same released Lease and update it at once with the same
    resourceVersion: the API server accepts one update, the rest get 409 and stay standby."""
    url, _ = api
    first = candidate(url, PODS[0], Clock())
    assert await first.try_acquire()
    await first.release()
    racers = [candidate(url, PODS[i % 2], Clock()) for i in range(4)]
    won = await asyncio.gather(*(r.try_acquire() for r in racers))
    assert sorted(won) == [False, False, False, True]
    winner = racers[won.index(True)]
    assert (await _lease(url))["holderIdentity"] == winner.identity
    for x in (first, *racers):
        await x.kube.close()


async def test_the_rendered_role_grants_election_and_nothing_more(
    api: tuple[str, ApiServer],
) -> None:
    """The controller's service account may use its own Lease and patch pods; another Lease,
    deleting its own, and Secrets are refused (403)."""
    url, _ = api
    kube = KubeClient(KubeConfig(server=url, token=SA), NS)
    assert await kube.get_lease(LEASE) is None
    other = KubeClient(KubeConfig(server=url, token=SA), NS)
    with pytest.raises(KubeError) as refused:
        await other.get_lease("someone-elses-lease")
    assert refused.value.status == 403
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {SA}"}) as c:
        resp = await c.delete(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}")
        assert resp.status_code == 403
        resp = await c.get(f"/api/v1/namespaces/{NS}/secrets")
        assert resp.status_code == 403
    await kube.close()
    await other.close()


async def test_bad_credentials_are_a_clear_error(tmp_path: Path) -> None:
    from kvpool.controller.kube import load_config

    with pytest.raises(KubeError, match="no Kubernetes API credentials"):
        load_config({})
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(KubeError, match="current-context"):
        load_config({"KUBECONFIG": str(bad)})
