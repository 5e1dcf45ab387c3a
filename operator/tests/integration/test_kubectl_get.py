"""``kubectl get kvcachepools,p2pgroups,pdpairs`` over a reconciled cpu-demo domain, as the API
server's Table output (what kubectl prints, column for column).

The columns are the generated CRDs' printer columns served by ``kvpool-operator cluster``'s
API server (the emulator here, with the kinds served without their schema); the values are the
status the operator reconciled, with every worker StatefulSet reported ready as a cluster
would. The real kubectl prints these tables in e2e/tests/test_cluster.py and the README.
"""

from __future__ import annotations

import aiohttp
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from test_reconcile import P2PGS, PDPS, POOLS, STS, condition, one

ACCEPT = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


async def _table(url: str, plural: str) -> dict[str, list[object]]:
    async with (
        aiohttp.ClientSession(url) as http,
        http.get(
            f"/apis/kvpool.io/v1alpha1/namespaces/default/{plural}", headers={"Accept": ACCEPT}
        ) as resp,
    ):
        table = await resp.json()
    names = [c["name"] for c in table["columnDefinitions"] if not c["priority"]]
    rows = [
        [
            c
            for c, d in zip(r["cells"], table["columnDefinitions"], strict=True)
            if not d["priority"]
        ]
        for r in table["rows"]
    ]
    return {"columns": names, **{str(r[0]): r for r in rows}}


async def test_kubectl_get_shows_ready_domain_seed_members_and_member_columns(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    for doc in example("cpu-demo"):
        await client.create(doc)
    sts = await eventually(lambda: len(apiserver.live(STS)) == 4 and apiserver.live(STS))
    for obj in sts:
        name = obj["metadata"]["name"]
        await client.patch("StatefulSet", name, {"status": {"readyReplicas": 1}}, status=True)
    for resource, name in ((POOLS, "demo"), (P2PGS, "demo-p2p"), (PDPS, "demo-pd")):
        await eventually(
            lambda r=resource, n=name: condition(one(apiserver, r, n), "Ready")["status"] == "True"
        )
    url = str(apiserver.servers[0].url)
    fingerprint = one(apiserver, POOLS, "demo")["status"]["domainFingerprint"]
    pools = await _table(url, "kvcachepools")
    assert pools["columns"] == [
        "Name", "Ready", "Domain", "Seed", "Members", "Instances", "Hit", "Age"
    ]  # fmt: skip
    assert pools["demo"][:5] == ["demo", "True", fingerprint, "0", 2]
    p2p = await _table(url, "p2pgroups")
    assert p2p["columns"] == ["Name", "Pool", "Instances", "TP", "Ready", "Age"]
    assert p2p["demo-p2p"][:5] == ["demo-p2p", "demo", 2, "1", "True"]
    pd = await _table(url, "pdpairs")
    assert pd["demo-pd"][:5] == ["demo-pd", "demo", 2, "1/1", "True"]
    assert all(str(t[n][-1]).endswith("s") for t, n in ((pools, "demo"), (p2p, "demo-p2p")))
