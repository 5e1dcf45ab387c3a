"""The gateway's state, built once per process from its configuration.

Why this module exists: every route needs the same handful of long-lived objects — the
HTTP client pool, the instances and their breakers, the index client, the router, the load
tracker, admission control, the session memory, the PD coordinator and request path.
:func:`build_state` wires them from a :class:`GatewayConfig`; routes receive the result
through a FastAPI dependency (``deps.get_state``) instead of closing over locals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpool.gateway.admission import Admission
from kvpool.gateway.apikeys import KeyReloader
from kvpool.gateway.config import GatewayConfig, GatewayEnv
from kvpool.gateway.drain import Drain
from kvpool.gateway.explain import ExplainBook
from kvpool.gateway.filewatch import FileWatch, watch
from kvpool.gateway.index_client import IndexClient
from kvpool.gateway.instances import InstanceSet, health_loop, probe_all
from kvpool.gateway.live import Reconfigurer
from kvpool.gateway.load import LoadTracker
from kvpool.gateway.memory import SessionMemory
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.pd import PDCoordinator
from kvpool.gateway.pd_flow import PDFlow
from kvpool.gateway.pending import PendingPrefixes
from kvpool.gateway.prompts import Encoder, encoder_for
from kvpool.gateway.proxy import Proxy
from kvpool.gateway.reconfig import router_for
from kvpool.gateway.reliability import BreakerState, KeyedBuckets
from kvpool.gateway.selection import Selector
from kvpool.gateway.upstream import Upstream
from kvpool.protocol.hashing import chunk_hashes

logger = logging.getLogger(__name__)

Hasher = Callable[[Sequence[int]], list[int]]


@dataclass
class GatewayState:
    """Everything the routes share; :meth:`start` / :meth:`stop` run the background loops."""

    config: GatewayConfig
    env: GatewayEnv
    metrics: GatewayMetrics
    http: httpx.AsyncClient
    upstream: Upstream
    instances: InstanceSet
    load: LoadTracker
    index: IndexClient
    selector: Selector
    proxy: Proxy
    admission: Admission
    encoder: Encoder
    hasher: Hasher
    sessions: SessionMemory
    explain: ExplainBook
    pd: PDCoordinator
    pd_flow: PDFlow
    api_keys: frozenset[str]
    buckets: KeyedBuckets | None
    drain: Drain
    #: seconds between looks at the API key file (``KVPOOL_GATEWAY_AUTH_TOKEN_FILE``)
    key_poll_s: float = 2.0
    started_at: float = field(default_factory=time.monotonic)
    #: applies new configurations to this state (``live``); set by :func:`build_state`
    reconfig: Reconfigurer = field(init=False)
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    async def start(self) -> None:
        """Probe the instances once (so the first request is routed sensibly), then loop."""
        await probe_all(self.http, self.instances, self.metrics, 3.0)
        self._tasks.append(
            asyncio.create_task(
                health_loop(
                    self.http,
                    self.instances,
                    self.metrics,
                    self.config.limits.health_interval_seconds,
                ),
                name="health",
            )
        )
        self._tasks.append(asyncio.create_task(self.index.run(), name="index"))
        if self.reconfig.path is not None:  # the mounted gateway.yaml, applied when it changes
            self._tasks.append(asyncio.create_task(self.reconfig.watch(), name="config"))
        self._watch_keys()
        await self.pd.start()
        logger.info(
            "gateway started: %d instances (%d ready), policy %s, index %s",
            len(self.instances),
            sum(1 for i in self.instances if i.ready),
            self.config.routing.policy,
            "stream" if self.index.streaming else "http",
        )

    def _watch_keys(self) -> None:
        """Reload the API keys whenever their file changes (``apikeys``)."""
        path = self.env.auth_token_file
        if path is None:
            return
        watcher = FileWatch(path)  # before reading again: a change from now on is seen

        def apply(keys: frozenset[str]) -> None:
            self.api_keys = keys

        reloader = KeyReloader(
            path, self.api_keys, apply, lambda o: self.metrics.api_key_reloads.labels(o).inc()
        )
        reloader.reload()  # what changed since build_state read it
        task = watch(watcher, self.key_poll_s, reloader.reload)
        self._tasks.append(asyncio.create_task(task, name="api-keys"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.pd.stop()
        self.index.close()
        await self.http.aclose()
        await self.upstream.close()


def build_state(
    config: GatewayConfig,
    env: GatewayEnv | None = None,
    *,
    encoder: Encoder | None = None,
    pd_bind_host: str = "0.0.0.0",
    config_path: Path | None = None,
    processes: int = 1,
) -> GatewayState:
    """Wire every part from the configuration (no I/O until :meth:`GatewayState.start`);
    ``config_path``: the file it was read from, applied again whenever it changes (``live``);
    ``processes``: the gateway processes serving the port (``serve --workers``)."""
    env = env or GatewayEnv()
    limits = config.limits
    metrics = GatewayMetrics()
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(
            limits.upstream_timeout_seconds, connect=limits.connect_timeout_seconds
        ),
        limits=httpx.Limits(max_connections=limits.max_inflight * 2, max_keepalive_connections=64),
    )
    instances = InstanceSet.from_config(config)
    metrics.watch_breakers(
        lambda: ((i.name, i.breaker.state is BreakerState.CLOSED) for i in instances)
    )
    upstream = Upstream(
        limits.max_inflight * 2, limits.connect_timeout_seconds, limits.upstream_timeout_seconds
    )
    index = IndexClient(
        config.controller_url,
        config.controller_pub_url,
        config.controller_snapshot_url,
        http,
        metrics,
        limits.health_interval_seconds,
        limits.lookup_timeout_seconds,
    )
    router = router_for(config)
    load = LoadTracker()
    metrics.watch_inflight(lambda: ((i.name, float(load.load(i.name).inflight)) for i in instances))
    selector = Selector(
        instances,
        index,
        router,
        load,
        PendingPrefixes(config.guards.pending_ttl_seconds),
        metrics,
        config.chunk_size,
    )
    explain = ExplainBook(
        config.chunk_size,
        instances,
        max_requests=limits.explain_requests,
        prompt_bytes=limits.explain_prompt_bytes,
        evictions=limits.explain_evictions,
    )
    selector.observer = explain.observe
    index.on_batch = explain.on_batch
    proxy = Proxy(upstream, load, metrics, limits.retries, limits.upstream_timeout_seconds)
    hash_config = config.hash_config(env.hash_seed)

    def hasher(tokens: Sequence[int]) -> list[int]:
        return chunk_hashes(tokens, hash_config)

    rate = limits.rate_limit
    encoder = encoder or encoder_for(config, instances, upstream)
    pd = PDCoordinator(
        config.pd_pairs,
        instances,
        pd_bind_host,
        metrics,
        limits.pd_transfer_timeout_seconds,
        env.pod_ip,
    )
    state = GatewayState(
        config=config,
        env=env,
        metrics=metrics,
        http=http,
        upstream=upstream,
        instances=instances,
        load=load,
        index=index,
        selector=selector,
        proxy=proxy,
        admission=Admission(limits.max_inflight, limits.max_queue, limits.queue_timeout_seconds),
        encoder=encoder,
        hasher=hasher,
        sessions=SessionMemory(limits.sessions),
        explain=explain,
        pd=pd,
        pd_flow=PDFlow(selector, proxy, pd, encoder.chat_stop_token_ids),
        api_keys=env.api_keys(),
        buckets=KeyedBuckets(rate.requests_per_second, rate.burst) if rate else None,
        drain=Drain(limits.drain_timeout_seconds, limits.drain_min_seconds),
    )
    state.reconfig = Reconfigurer(state, config_path, processes=processes)
    return state
