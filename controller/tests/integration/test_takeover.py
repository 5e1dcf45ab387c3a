"""Two controller replicas in one process: the standby follows the leader and takes over warm.

Real ZMQ sockets on 127.0.0.1 and the real election code (``ha.py``) against the Lease API of
``kvpool-operator up``'s stand-in (``kvpool.operator.local.kubeapi``, served by aiohttp; the same
paths, verbs and 409s as the API server for Leases and pod labels: no real API server can run
here). A worker registers and admits chunks at the leader over LMCache's wire; the standby's
copy fills from the leader's delta stream, and while standby it is ready but answers lookups
503 naming the leader; the leader stops (a graceful stop releases the Lease; a hard death lets
it expire, here on short timings); the standby then leads the same epoch in term 1 with every
worker and chunk, answers the worker's heartbeat without asking it to re-register or full-sync,
and labels its pod ``leader``. No timed assertions: every wait is a bounded poll.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp.web
import httpx
import pytest
import zmq
import zmq.asyncio

from kvpool.controller.api import create_app
from kvpool.controller.ha import Ha
from kvpool.controller.kube import KubeClient, KubeConfig
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.operator.local import kubeapi
from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as p
from kvpool.protocol.domain import CONTROLLER_ROLE_LABEL
from kvpool.protocol.http_api import PREFIX_LOOKUP_PATH

NS, LEASE = "default", "demo-controller"
CPU = "LocalCPUBackend"
IID = "demo-p2p-0~0123456789ab"
KEYS = list(range(100, 140))


@pytest.fixture
async def api() -> AsyncIterator[tuple[str, kubeapi.Store]]:
    store = kubeapi.Store()
    runner = aiohttp.web.AppRunner(kubeapi.app(store), access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", store
    finally:
        await runner.cleanup()


async def until(what: str, probe: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        value = probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not seen within {timeout_s:.0f}s")


def replica(
    api_url: str, store: kubeapi.Store, pod: str, leader: ControllerServer | None, **timing: Any
) -> ControllerServer:
    """A replica on its own random ports, following ``leader``'s PUB and snapshot sockets (the
    controller Service's, on a cluster)."""
    follow = leader.ports if leader is not None else {"pub": 1, "snapshot": 1}
    settings = ControllerSettings(
        host="127.0.0.1",
        monitor_ports={"pull": 0, "reply": 0, "heartbeat": 0},
        pub_port=0,
        snapshot_port=0,
        persistence="full-sync",
        lease_name=LEASE,
        leader_pub_url=f"tcp://127.0.0.1:{follow['pub']}",
        leader_snapshot_url=f"tcp://127.0.0.1:{follow['snapshot']}",
        pod_name=pod,
        pod_namespace=NS,
        **timing,
    )
    server = ControllerServer(settings)
    server.bind()
    store.add_pod(NS, pod, {"app": "controller"})
    kube = KubeClient(KubeConfig(server=api_url), NS, timeout_s=1.0)
    server.ha = Ha(server, kube)
    return server


async def request(ctx: zmq.asyncio.Context, server: ControllerServer, msg: Any) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{server.ports['reply']}")
        await sock.send_multipart([b"", codec.encode(msg)])
        frames = await asyncio.wait_for(sock.recv_multipart(), 10)
        return codec.decode(frames[-1])
    finally:
        sock.close(linger=0)


def run(server: ControllerServer) -> asyncio.Task[None]:
    ha: Ha = server.ha
    lead: Callable[[bool, asyncio.Event], Awaitable[None]] = server.lead
    return asyncio.create_task(ha.run(lambda cold, serving: lead(cold, serving)))


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


@pytest.mark.parametrize("death", ["graceful", "hard"])
async def test_the_standby_takes_over_with_the_index_and_the_workers(
    api: tuple[str, kubeapi.Store], death: str
) -> None:
    url, store = api
    timing = {"lease_duration_s": 2, "renew_deadline_s": 1.0, "retry_period_s": 0.2}
    a = replica(url, store, "ctl-a", None, **timing)
    b = replica(url, store, "ctl-b", a, **timing)
    ctx = zmq.asyncio.Context()
    tasks = [run(a)]
    try:
        await until("a leading", lambda: a.ha.leading and a.ready)
        tasks.append(run(b))
        reply = await request(ctx, a, p.RegisterMsg(IID, 0, "127.0.0.1", 7000, None))
        assert isinstance(reply, p.RegisterRetMsg)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{a.ports['pull']}")
        ops = [p.KVOpEvent(p.OpType.ADMIT, k, i) for i, k in enumerate(KEYS)]
        await push.send(codec.encode(p.BatchedKVOperationMsg(IID, 0, CPU, ops)))
        # closed only once delivered (linger 0 would drop a frame still waiting to connect)
        await until("the admits at the leader", lambda: len(a.service.index) == len(KEYS))
        push.close(linger=0)
        await until(
            "b's warm copy",
            lambda: b.ha.follower.warm and len(b.ha.follower.replica.index) == len(KEYS),
        )
        await until("b ready", lambda: b.ready)  # ready (rollouts proceed)...
        assert not b.ha.leading  # ...but not serving: the Service selects the leader
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(b)), base_url="http://b"
        ) as http:
            assert (await http.get("/readyz")).status_code == 200
            refused = await http.post(PREFIX_LOOKUP_PATH, json={"hashes": KEYS})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert a.ha.identity in refused.json()["detail"]
        assert store.labels(NS, "ctl-a")[CONTROLLER_ROLE_LABEL] == "leader"
        assert store.labels(NS, "ctl-b")[CONTROLLER_ROLE_LABEL] == "standby"
        epoch = a.service.epoch

        if death == "hard":  # dies without a word: b waits for the Lease to expire
            a.ha.release = _nothing  # type: ignore[method-assign]
        await stop(tasks.pop(0))
        await a.close()
        await until("b leading", lambda: b.ha.leading and b.ready, 30)
        await until("b labelled leader", lambda: b.ha.labelled == "leader")

        svc = b.service
        assert (svc.epoch, svc.term) == (epoch, 1)
        assert sorted(svc.index.worker_keys(IID, 0, CPU)) == KEYS
        assert store.labels(NS, "ctl-b")[CONTROLLER_ROLE_LABEL] == "leader"
        # the worker's next heartbeat reaches b (the Service's port): known, nothing asked
        beat = await request(ctx, b, p.HeartbeatMsg(IID, 0, "127.0.0.1", 7000, None))
        assert beat == p.HeartbeatRetMsg()
        lease = store.get_lease(NS, LEASE)["spec"]
        assert lease["holderIdentity"] == b.ha.identity and lease["leaseTransitions"] == 1
    finally:
        for task in tasks:
            await stop(task)
        for server in (a, b):
            await server.ha.kube.close()
            await server.close()
        ctx.destroy(linger=0)


async def _nothing() -> None:
    return None


def test_election_flags_need_the_leaders_addresses() -> None:
    """--lease-name without the addresses a standby follows is refused, naming the fix."""
    with pytest.raises(ValueError, match="--leader-pub-url"):
        ControllerSettings(lease_name=LEASE)
    with pytest.raises(ValueError, match="renew deadline"):
        ControllerSettings(
            lease_name=LEASE,
            leader_pub_url="tcp://x:1",
            leader_snapshot_url="tcp://x:2",
            lease_duration_s=1,
            renew_deadline_s=2.0,
        )
