"""``kubectl get kvcachepools,p2pgroups,pdpairs`` over a reconciled cpu-demo domain.

The table is built from the generated CRDs' printer columns (kubectl.py) and the objects the
operator reconciled in the emulator, with every worker StatefulSet reported ready as a
cluster would. Set KVPOOL_KUBECTL_GET_OUT=path to write it (operator/README.md shows it).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from kubectl import jsonpath, kubectl_get
from test_reconcile import P2PGS, PDPS, POOLS, STS, condition, one


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
    later = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=42)
    out = kubectl_get(apiserver, ["kvcachepools", "p2pgroups", "pdpairs"], now=later)
    lines = out.splitlines()
    fingerprint = one(apiserver, POOLS, "demo")["status"]["domainFingerprint"]
    assert lines[0].split() == ["NAME", "READY", "DOMAIN", "SEED", "MEMBERS", "AGE"]
    assert lines[1].split()[:5] == ["kvcachepool.kvpool.io/demo", "True", fingerprint, "0", "2"]
    assert lines[3].split() == ["NAME", "POOL", "INSTANCES", "TP", "READY", "AGE"]
    assert lines[4].split()[:5] == ["p2pgroup.kvpool.io/demo-p2p", "demo", "2", "1", "True"]
    assert lines[7].split()[:5] == ["pdpair.kvpool.io/demo-pd", "demo", "2", "1/1", "True"]
    assert all(line.split()[-1].endswith("s") for line in lines if "kvpool.io/" in line)
    target = os.environ.get("KVPOOL_KUBECTL_GET_OUT")
    if target:
        Path(target).write_text(out + "\n", encoding="utf-8")


def test_jsonpath_subset() -> None:
    obj = {
        "status": {"conditions": [{"type": "A", "status": "x"}, {"type": "Ready", "status": "y"}]}
    }
    assert jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == "y"
    assert jsonpath(obj, ".status.missing") is None
