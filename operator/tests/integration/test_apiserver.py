"""The API server of ``kvpool-operator cluster`` over HTTP, as clients see it (no kubectl).

What the real kubectl and Helm need from it is driven end to end in e2e/tests/test_cluster.py;
here each behaviour is checked on its own, fast: CRDs installed through the API (discovery,
Established, OpenAPI v2 as protobuf and v3), custom resources pruned, defaulted and refused
by schema and CEL (422 with causes), Table output, field selectors, watch resumption with
bookmarks and 410 Gone, the scale subresource, ownerReference garbage collection (and
Orphan), graceful pod deletion, dry runs, server-side apply, and Helm's protobuf Secrets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kmock
import pytest

from kvpool.operator import gen
from kvpool.operator.cluster import store as store_module
from kvpool.operator.cluster.apiserver import ApiServer
from kvpool.operator.cluster.protobuf import K8S_MAGIC, _bytes

P2PGS = "/apis/kvpool.io/v1alpha1/namespaces/default/p2pgroups"
CMS = "/api/v1/namespaces/default/configmaps"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


@pytest.fixture
async def http() -> AsyncIterator[tuple[ApiServer, aiohttp.ClientSession]]:
    async with (
        ApiServer(declare_kvpool=False, bookmark_every_s=0.2) as server,
        kmock.Server(server) as listener,
        aiohttp.ClientSession(str(listener.url)) as session,
    ):
        for args in gen.KINDS:
            async with session.post(
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=gen.crd(*args)
            ) as resp:
                assert resp.status == 201, await resp.text()
        yield server, session


def _p2p(name: str = "g", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "P2PGroup",
        "metadata": {"name": name},
        "spec": {"poolRef": {"name": "pool"}, "replicas": 2, "engine": {"platform": "cpu"}, **spec},
    }


async def _json(resp: aiohttp.ClientResponse) -> Any:
    return json.loads(await resp.text())


async def test_crds_are_served_with_discovery_and_openapi(
    http: tuple[ApiServer, aiohttp.ClientSession],
) -> None:
    server, s = http
    crd = server.store.get(
        ("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None, "p2pgroups.kvpool.io"
    )
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    async with s.get("/apis/kvpool.io/v1alpha1") as resp:
        found = {r["name"]: r for r in (await _json(resp))["resources"]}
    assert found["p2pgroups"]["shortNames"] == ["p2pg"]
    assert found["p2pgroups/scale"]["kind"] == "Scale"
    async with s.get(
        "/openapi/v2",
        headers={"Accept": "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"},
    ) as resp:
        assert resp.headers["Content-Type"].endswith("+protobuf")
        assert b"io.kvpool.v1alpha1.P2PGroup" in await resp.read()
    async with s.get("/openapi/v3") as resp:
        url = (await _json(resp))["paths"]["apis/kvpool.io/v1alpha1"]["serverRelativeURL"]
    async with s.get(url) as resp:
        assert "io.kvpool.v1alpha1.P2PGroup" in (await _json(resp))["components"]["schemas"]


async def test_custom_resources_are_pruned_defaulted_and_validated(
    http: tuple[ApiServer, aiohttp.ClientSession],
) -> None:
    _server, s = http
    async with s.post(P2PGS, json=_p2p(typo=1)) as resp:
        body = await _json(resp)
        assert resp.status == 201, body
    assert "typo" not in body["spec"] and body["spec"]["p2p"] is True
    async with s.post(P2PGS, json=_p2p("bad", replicas=99)) as resp:
        assert resp.status == 422
        body = await _json(resp)
    assert body["details"]["causes"][0]["field"] == "spec.replicas"
    assert body["message"].startswith('P2PGroup.kvpool.io "bad" is invalid: spec.replicas')
    transfer = {"delayPull": True}
    async with s.post(P2PGS, json=_p2p("cel", transfer=transfer)) as resp:
        assert resp.status == 422
        assert "delayPull needs pullMode and useNPU" in (await _json(resp))["message"]
    async with s.post(P2PGS + "?dryRun=All", json=_p2p("dry")) as resp:
        assert resp.status == 201
    async with s.get(P2PGS + "/dry") as resp:
        assert resp.status == 404


async def test_tables_selectors_and_the_scale_subresource(
    http: tuple[ApiServer, aiohttp.ClientSession],
) -> None:
    _server, s = http
    for name in ("a", "b"):
        async with s.post(P2PGS, json=_p2p(name)) as resp:
            assert resp.status == 201
    async with s.get(P2PGS, headers={"Accept": TABLE}) as resp:
        table = await _json(resp)
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]][:3] == ["Name", "Pool", "Instances"]
    assert [r["cells"][:2] for r in table["rows"]] == [["a", "pool"], ["b", "pool"]]
    async with s.get(P2PGS, params={"fieldSelector": "metadata.name=b"}) as resp:
        assert [o["metadata"]["name"] for o in (await _json(resp))["items"]] == ["b"]
    headers = {"Content-Type": "application/merge-patch+json"}
    async with s.patch(P2PGS + "/a/scale", data='{"spec":{"replicas":3}}', headers=headers) as r:
        scale = await _json(r)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    async with s.get(P2PGS + "/a") as resp:
        assert (await _json(resp))["spec"]["replicas"] == 3
    async with s.patch(P2PGS + "/a/scale", data='{"spec":{"replicas":65}}', headers=headers) as r:
        assert r.status == 422  # the schema's maximum holds through the scale subresource


async def test_watch_resumes_bookmarks_and_answers_410_when_too_old(
    http: tuple[ApiServer, aiohttp.ClientSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    _server, s = http
    async with s.get(CMS) as resp:
        rv = (await _json(resp))["metadata"]["resourceVersion"]
    for i in range(3):
        async with s.post(CMS, json={"metadata": {"name": f"c{i}"}, "data": {}}) as resp:
            assert resp.status == 201
    params = {
        "watch": "true",
        "resourceVersion": rv,
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "1",
    }
    async with s.get(CMS, params=params) as resp:
        events = [json.loads(line) for line in (await resp.read()).splitlines()]
    assert [e["type"] for e in events[:3]] == ["ADDED"] * 3
    assert "BOOKMARK" in {e["type"] for e in events[3:]}
    monkeypatch.setattr(store_module, "HISTORY", 2)
    async with s.post(CMS, json={"metadata": {"name": "c9"}, "data": {}}) as resp:
        assert resp.status == 201
    async with s.get(CMS, params={**params, "resourceVersion": "1"}) as resp:
        (event,) = [json.loads(line) for line in (await resp.read()).splitlines()]
    assert event["type"] == "ERROR" and event["object"]["code"] == 410


async def test_garbage_collection_orphans_and_graceful_pod_deletion(
    http: tuple[ApiServer, aiohttp.ClientSession],
) -> None:
    _server, s = http
    async with s.post(P2PGS, json=_p2p("owner")) as resp:
        owner = await _json(resp)
    ref = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "P2PGroup",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    body = {"metadata": {"name": "child", "ownerReferences": [ref]}, "data": {}}
    async with s.post(CMS, json=body) as resp:
        assert resp.status == 201
    async with s.post(P2PGS, json=_p2p("owner2")) as resp:
        orphaning = await _json(resp)
    ref2 = {**ref, "name": "owner2", "uid": orphaning["metadata"]["uid"]}
    async with s.post(CMS, json={"metadata": {"name": "kept", "ownerReferences": [ref2]}}) as r:
        assert r.status == 201
    async with s.delete(P2PGS + "/owner2?propagationPolicy=Orphan") as resp:
        assert resp.status == 200
    async with s.get(CMS + "/kept") as resp:
        assert "ownerReferences" not in (await _json(resp))["metadata"]
    async with s.delete(P2PGS + "/owner") as resp:
        assert resp.status == 200
    for _ in range(50):
        async with s.get(CMS + "/child") as resp:
            if resp.status == 404:
                break
        await asyncio.sleep(0.02)
    assert resp.status == 404
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "n", "containers": [{"name": "c"}]}}
    async with s.post("/api/v1/namespaces/default/pods", json=pod) as resp:
        assert resp.status == 201
    async with s.delete("/api/v1/namespaces/default/pods/p") as resp:
        assert (await _json(resp))["metadata"]["deletionTimestamp"]  # Terminating
    async with s.delete("/api/v1/namespaces/default/pods/p?gracePeriodSeconds=0") as resp:
        assert resp.status == 200
    async with s.get("/api/v1/namespaces/default/pods/p") as resp:
        assert resp.status == 404


async def test_server_side_apply_and_helms_protobuf_secrets(
    http: tuple[ApiServer, aiohttp.ClientSession],
) -> None:
    _server, s = http
    apply = {"Content-Type": "application/apply-patch+yaml"}
    doc = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: applied}\ndata: {a: '1'}\n"
    async with s.patch(CMS + "/applied?fieldManager=helm", data=doc, headers=apply) as resp:
        assert resp.status == 201
    doc = doc.replace("{a: '1'}", "{b: '2'}")
    async with s.patch(CMS + "/applied?fieldManager=helm", data=doc, headers=apply) as resp:
        assert (await _json(resp))["data"] == {"a": "1", "b": "2"}
    meta = _bytes(1, b"rel") + _bytes(11, _bytes(1, b"owner") + _bytes(2, b"helm"))
    secret = _bytes(1, meta) + _bytes(2, _bytes(1, b"k") + _bytes(2, b"v")) + _bytes(3, b"Opaque")
    body = K8S_MAGIC + _bytes(1, _bytes(1, b"v1") + _bytes(2, b"Secret")) + _bytes(2, secret)
    headers = {"Content-Type": "application/vnd.kubernetes.protobuf"}
    async with s.post("/api/v1/namespaces/default/secrets", data=body, headers=headers) as resp:
        created = await _json(resp)
        assert resp.status == 201, created
    assert created["data"] == {"k": "dg=="} and created["metadata"]["labels"] == {"owner": "helm"}


class _HeldUpdates:
    """Admission that holds every UPDATE until released (a webhook answering slowly under
    load), so another write lands while the first is in review."""

    def __init__(self) -> None:
        self.in_review = asyncio.Event()
        self.release = asyncio.Event()

    async def review(self, operation: str, *_: Any) -> list[str]:
        if operation == "UPDATE":
            self.in_review.set()
            await self.release.wait()
        return []


async def test_a_write_reviewed_while_the_object_is_deleted_keeps_the_deletion() -> None:
    """A patch built on the version before a delete must not store that version's metadata
    over the delete's: the deletionTimestamp stays, and the patch is applied on top (the API
    server's guaranteed update). e2e test_cluster met it: kopf's patch of a pool in review at
    the webhook while kubectl deleted it, and the pool was never deleted."""
    held = _HeldUpdates()
    async with (
        ApiServer(declare_kvpool=False, admission=held) as server,
        kmock.Server(server) as listener,
        aiohttp.ClientSession(str(listener.url)) as s,
    ):
        async with s.post(CMS, json={"metadata": {"name": "c", "finalizers": ["x/y"]}}) as resp:
            assert resp.status == 201, await resp.text()
        merge = {"Content-Type": "application/merge-patch+json"}
        patch = asyncio.create_task(
            s.patch(f"{CMS}/c", data=json.dumps({"data": {"k": "v"}}), headers=merge)
        )
        await asyncio.wait_for(held.in_review.wait(), 10)
        async with s.delete(f"{CMS}/c") as resp:
            assert resp.status == 200, await resp.text()
        held.release.set()
        async with await patch as resp:
            assert resp.status == 200, await resp.text()
        async with s.get(f"{CMS}/c") as resp:
            obj = await _json(resp)
        assert obj["metadata"].get("deletionTimestamp"), obj
        assert obj["data"] == {"k": "v"}
