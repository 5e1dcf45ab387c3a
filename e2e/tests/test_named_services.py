"""End to end: ``kvpool-operator up`` also runs what the pool names — its Redis and the
Mooncake master, metadata server and store the operator renders for a Mooncake tier.

Why: the cpu-demo domain uses neither, so these paths of ``up`` (a ``redis-server`` on a local
port with every URL that names it rewritten; the Mooncake parts started from their rendered
command lines, ``--port=N`` and ``$(POD_IP)`` included) need their own run. The pool has no
members, so only the pool's own processes start (not its gateway: with no instance it is
rightly never Ready). Real Redis, real Mooncake (``mooncake-transfer-engine-non-cuda``), the
real controller.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from upstack import EXAMPLE, poll, processes_of

from kvpool.operator.local.up import UpProcess

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    if shutil.which("redis-server") is None or not (BIN / "mooncake_master").exists():
        pytest.fail(
            "redis-server and mooncake-transfer-engine-non-cuda are installed by make install"
        )
    root = tmp_path_factory.mktemp("named")
    pool = next(yaml.safe_load_all(EXAMPLE.read_text()))
    pool["spec"]["tiers"]["remote"] = {"mooncake": {"segmentSize": "256Mi"}}
    pool["spec"]["controller"] = {
        "persistence": {"mode": "redis", "redisUrl": "redis://kv-redis.default.svc:6379/3"}
    }
    (root / "pool.yaml").write_text(yaml.safe_dump(pool))
    # No member: a gateway with no instance is rightly never Ready, so it is left out.
    proc = UpProcess([str(root / "pool.yaml")], root / "state", skip=("demo-gateway",))
    try:
        proc.start(300)
        yield proc
    finally:
        assert proc.stop() == 0, proc.output.read_text()[-3000:]


def test_the_controller_persists_to_the_local_redis_the_pool_names(up: UpProcess) -> None:
    state = up.state()
    ((host, port, local),) = state["cluster"]["external"]
    assert (host, port) == ("kv-redis.default.svc", 6379)
    replicas = processes_of(state, "demo-controller")  # two by default
    for pod in replicas:
        argv = state["processes"][pod]["argv"]
        assert argv[argv.index("--redis-url") + 1] == f"redis://127.0.0.1:{local}/3"
    logs = [Path(state["processes"][pod]["log"]) for pod in replicas]
    poll(  # the leader reloaded (nothing) from there
        "a reload from the local Redis",
        lambda: any(f"from redis://127.0.0.1:{local}/3" in log.read_text() for log in logs),
        60,
    )
    assert redis.Redis(port=local, db=3).ping()


def test_the_mooncake_parts_run_as_rendered_and_the_store_mounts_its_segment(
    up: UpProcess,
) -> None:
    procs = up.state()["processes"]
    master = procs["demo-mooncake-master"]
    assert master["argv"][1] == f"--port={master['ports']['rpc']}"
    store_log = Path(procs["demo-mooncake-store"]["log"])
    poll("the store's segment", lambda: "Mounting segment" in store_log.read_text(), 60)
    poll("the store up", lambda: "started successfully" in store_log.read_text(), 60)
    assert "$(POD_IP)" not in store_log.read_text()
    # The store's HTTP API listens on the rendered port, which ``up`` mapped to a free local one
    store = procs["demo-mooncake-store"]
    assert store["argv"][-1] == f"--port={store['ports']['http']}"
    exist = httpx.get(f"http://127.0.0.1:{store['ports']['http']}/api/exist/kvpool-none", timeout=5)
    assert exist.status_code < 500, exist.text
