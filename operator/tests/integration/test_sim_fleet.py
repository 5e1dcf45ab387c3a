"""The operator reconciling examples/sim-fleet.yaml (engine.sim, p2p: false) in the emulator.

What a cluster would get: one StatefulSet per simulated instance running ``kvpool-worker serve
--engine sim`` with no accelerator and no LMCache host memory in its request, LMCache configs
without a P2P key, a gateway told the group does not pull from peers, and status that says
which sim limits came from the profile and that the simulated tiers pin no host memory. A
remote tier added to the pool later is refused in status, with the fix, and nothing changes.
"""

from __future__ import annotations

from typing import Any

import yaml
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from test_reconcile import CMS, P2PGS, POOLS, STS, condition, create_all, observed, one


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


async def test_sim_fleet_becomes_sim_workers_without_p2p_and_says_what_is_simulated(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    await create_all(client, example("sim-fleet"))
    await eventually(
        lambda: observed(apiserver, POOLS, "fleet") and observed(apiserver, P2PGS, "fleet-sim")
    )
    sts = {o["metadata"]["name"]: o for o in apiserver.live(STS)}
    assert sorted(sts) == sorted(f"fleet-sim-{i}" for i in range(16))
    container = _container(sts["fleet-sim-3"])
    command = container["command"]
    assert command[:4] == ["kvpool-worker", "serve", "--engine", "sim"]
    assert command[command.index("--sim-profile") + 1] == "h100-llama-3.1-8b-vllm"
    assert command[command.index("--num-layers") + 1] == "32"
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert "LMCACHE_P2P_HOST" not in {e["name"] for e in container["env"]}
    config = yaml.safe_load(one(apiserver, CMS, "fleet-sim-lmcache")["data"]["fleet-sim-3.yaml"])
    assert "enable_p2p" not in config and config["max_local_cpu_size"] == 16.0
    gateway = yaml.safe_load(one(apiserver, CMS, "fleet-gateway")["data"]["gateway.yaml"])
    (group,) = gateway["p2pGroups"]
    assert group["p2p"] is False and len(group["instances"]) == 16
    status = one(apiserver, P2PGS, "fleet-sim")["status"]
    assert condition(one(apiserver, P2PGS, "fleet-sim"), "ConfigValid")["status"] == "True"
    assert status["memoryBudget"]["totalBytes"] == 0
    assert "simulated and allocate no host memory" in status["memoryBudget"]["formula"]
    assert "P2PGroup/fleet-sim: spec.engine.sim.deviceKVGiB = 57 (default; the profile " in (
        "\n".join(status["defaults"])
    )
    assert set(status["instances"][0]["ports"]) == {"lmcache_worker_ports"}

    await client.patch(
        "KVCachePool", "fleet", {"spec": {"tiers": {"remote": {"redis": {"url": "redis://r"}}}}}
    )
    await eventually(lambda: one(apiserver, POOLS, "fleet")["status"]["observedGeneration"] == 2)
    pool = one(apiserver, POOLS, "fleet")
    invalid = condition(pool, "ConfigValid")
    assert invalid["status"] == "False"
    assert "models local tiers and P2P, not a remote store" in invalid["message"]
    assert "remove tiers.remote or use the reference engine" in invalid["message"]
    config_after = one(apiserver, CMS, "fleet-sim-lmcache")["data"]["fleet-sim-3.yaml"]
    assert "remote_url" not in config_after  # nothing of an invalid domain is applied
