"""What ``kvpool-operator up`` provides besides processes: Service proxies and the pods' API.

Why: a Deployment of several replicas (the controller's two, by default) runs one process per
replica, each on its own local ports; a client addresses the Service, not a replica. Like
kube-proxy, each :class:`~kvpool.operator.local.balance.Balanced` Service port here is a TCP
listener that sends every new connection to a replica that is ready (its rendered readiness
probe, polled every :data:`PROBE_S`) and whose pod's labels match the Service's selector (the
controller replica holding the Lease labels its pod ``leader`` through :mod:`.kubeapi`); when
no replica qualifies the connection is closed at once and the client retries (ZMQ reconnects
on its own). Established connections stay where they are, as with kube-proxy: a replica that
stops leading exits, which closes them. Everything runs on one asyncio loop in a thread of the
``up`` process, on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import aiohttp.web

from kvpool.operator.local import kubeapi
from kvpool.operator.local.balance import Balanced
from kvpool.operator.local.plan import LOOPBACK, StackError

logger = logging.getLogger(__name__)

PROBE_S = 0.25
CONNECT_TIMEOUT_S = 1.0
CHUNK = 1 << 16


@dataclass
class Backend:
    """One replica behind a Service: its pod, local ports and readiness probe."""

    pod: str
    namespace: str
    workload: str
    ports: Mapping[int, int]  # container port -> local port
    readiness: tuple[str, int] | None  # path, local port
    ready: bool = False


class LocalServices:
    """The API stand-in and the Service proxies of one ``up``, on a loop in a thread."""

    def __init__(self, root: Path, namespace: str, balanced: Sequence[Balanced] = ()) -> None:
        self.store = kubeapi.Store()
        self.root = root
        self.namespace = namespace
        self.balanced = {port: b for b in balanced for port in b.listen}
        self.backends: dict[str, list[Backend]] = {}
        self.api_url = ""
        self.kubeconfig = root / "kube" / "kubeconfig"
        self._rr = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ control (up's thread)

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve the API and listen on every proxy port; returns once they are bound."""
        self._thread = threading.Thread(target=self._run, name="kvpool-up-services", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s) or self._error is not None:
            raise StackError(f"the local Service proxies did not start: {self._error}")
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        self.kubeconfig.write_text(kubeapi.kubeconfig(self.api_url, self.namespace))

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def add(self, backend: Backend) -> None:
        """A replica's process was started: route to it once it is ready."""
        replicas = [b for b in self.backends.get(backend.workload, []) if b.pod != backend.pod]
        self.backends[backend.workload] = sorted([*replicas, backend], key=lambda b: b.pod)

    def env(self) -> dict[str, str]:
        """What every process gets from the cluster here: its API credentials."""
        return {"KUBECONFIG": str(self.kubeconfig)}

    def eligible(self, service: Balanced) -> list[Backend]:
        """The replicas ``service`` sends new connections to now."""
        want = service.selector.items()
        return [
            b
            for b in self.backends.get(service.workload, [])
            if b.ready and want <= self.store.labels(b.namespace, b.pod).items()
        ]

    def selected(self) -> dict[str, list[str]]:
        """Per balanced Service, the replicas it routes to now (for the state file)."""
        out: dict[str, list[str]] = {}
        for service in self.balanced.values():
            out[service.service] = [b.pod for b in self.eligible(service)]
        return out

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(); a bug must not go unseen
            self._error = exc
            self._started.set()
            logger.exception("local services stopped")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = aiohttp.web.AppRunner(kubeapi.app(self.store), access_log=None)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.api_url = f"http://{LOOPBACK}:{port}"
        servers = [
            await asyncio.start_server(
                functools.partial(self._connection, listen), LOOPBACK, listen
            )
            for listen in self.balanced
        ]
        self._started.set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as http:
            probe = asyncio.create_task(self._probe_loop(http))
            await self._stop.wait()
            probe.cancel()
        for server in servers:
            server.close()
        await runner.cleanup()

    async def _probe_loop(self, http: aiohttp.ClientSession) -> None:
        while True:
            for backend in [b for bs in list(self.backends.values()) for b in bs]:
                backend.ready = await _probe(http, backend)
            await asyncio.sleep(PROBE_S)

    async def _connection(
        self, listen: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        service = self.balanced[listen]
        targets = [b.ports[service.listen[listen]] for b in self.eligible(service)]
        await forward(client_r, client_w, targets, next(self._rr))


async def forward(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    targets: Sequence[int],
    turn: int,
) -> None:
    """One accepted connection of a Service's proxy, sent to the local port ``targets[turn]``
    (round robin over the endpoints eligible now) and copied both ways until either side
    ends; with no endpoint, or one that does not accept, it is closed at once and the client
    retries. Also the proxy of ``kvpool-operator cluster``'s kubelet."""
    if not targets:
        client_w.close()  # no ready endpoint: the client retries
        return
    target = targets[turn % len(targets)]
    try:
        server_r, server_w = await asyncio.wait_for(
            asyncio.open_connection(LOOPBACK, target), CONNECT_TIMEOUT_S
        )
    except (OSError, TimeoutError):
        client_w.close()
        return
    await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))


async def _probe(http: aiohttp.ClientSession, backend: Backend) -> bool:
    if backend.readiness is None:
        return True
    path, port = backend.readiness
    try:
        async with http.get(f"http://{LOOPBACK}:{port}{path}") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until either side ends, then close ``dst`` (the other pipe then ends too)."""
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            dst.close()
