"""The live-figures poller: every --figures-interval, each domain's controller and gateway are
read and the figures written into the pool's and the members' ``status.live``.

Why a task of its own, beside the reconciles: a reconcile pass must never wait on a domain's
processes (a dead controller would stall every change of the domain), so the poller does the
HTTP and keeps what it read; a pass only reads the kept health (condition FiguresCurrent)
without I/O. Bounds: one round at a time, every pool at most once per interval, at most
``CONCURRENCY`` domains read at once, every GET limited to --figures-timeout seconds and
``MAX_BODY`` bytes; a failure is a reason in the condition and a counted error, never a crash.
Writes: ``status.live`` only when the figures changed (a merge patch of that subtree alone,
which no pass writes), and a pass requested only when FiguresCurrent flips, so an idle domain
costs three GETs per interval and nothing on the API server. Everything decided about what
was read is pure (``kvpool.operator.figures``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from kvpool.operator import figures as fig
from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.runtime import kube, plan
from kvpool.operator.runtime.metrics import Metrics
from kvpool.operator.runtime.reconcile import DomainSource, utcnow
from kvpool.operator.runtime.settings import OperatorSettings
from kvpool.protocol.http_api import STATS_PATH

Obj = dict[str, Any]
Key = tuple[str, str]
log = logging.getLogger(__name__)
#: Domains read at once.
CONCURRENCY = 8
#: Largest answer read (a gateway of a thousand instances exposes a few MiB of metrics).
MAX_BODY = 32 * 2**20


class PoolSource(DomainSource, Protocol):
    """The CRs the poller reads (kopf's indexes, as the reconcile reads them)."""

    def pool_keys(self) -> list[Key]: ...


@dataclass
class _Domain:
    """What the poller keeps of one domain between rounds."""

    window: fig.HitWindow
    health: fig.Health | None = None
    last_read: dict[str, str] = field(default_factory=dict)  # side -> when it last answered


class FiguresPoller:
    """Reads every domain's figures on an interval and writes them into status."""

    def __init__(
        self,
        settings: OperatorSettings,
        client: kube.KubeClient,
        source: PoolSource,
        reconcile: Callable[[str, str], Awaitable[Any]],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], str] = utcnow,
    ) -> None:
        self.settings = settings
        self.client = client
        self.source = source
        self.reconcile = reconcile
        self.metrics = metrics
        self.clock = clock
        self.now = now
        self.domains: dict[Key, _Domain] = {}
        self._http: aiohttp.ClientSession | None = None

    def health(self, namespace: str, pool: str) -> fig.Health | None:
        """FiguresCurrent of a domain as of its last poll (None before the first)."""
        domain = self.domains.get((namespace, pool))
        return None if domain is None else domain.health

    async def run(self) -> None:
        """Until cancelled: a round, then wait for the rest of the interval."""
        interval = self.settings.figures_interval
        while True:
            started = self.clock()
            try:
                await self.poll_all()
            except Exception:  # never let one bad round end the figures for good
                log.exception("live figures round failed")
            await asyncio.sleep(max(0.0, interval - (self.clock() - started)))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def poll_all(self) -> None:
        """One round: every known domain read (``CONCURRENCY`` at once), then a pass for each
        domain whose FiguresCurrent changed."""
        keys = self.source.pool_keys()
        for gone in set(self.domains) - set(keys):
            del self.domains[gone]
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(key: Key) -> bool:
            async with gate:
                try:
                    return await self.poll(*key)
                except Exception:
                    log.exception("live figures of %s/%s failed", *key)
                    return False

        flipped = await asyncio.gather(*(one(k) for k in keys))
        passes = [self.reconcile(*k) for k, f in zip(keys, flipped, strict=True) if f]
        for result in await asyncio.gather(*passes, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("reconcile after a FiguresCurrent change failed: %s", result)

    async def poll(self, namespace: str, name: str) -> bool:
        """Read one domain and write its figures; True when its FiguresCurrent changed."""
        body = self.source.pool(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return False
        pool = plan.parse_body(body, plan.stored_seed(body, []))
        if not isinstance(pool, KVCachePool):
            return False  # an invalid spec: its status says so, there is nothing to read
        bodies = [m for m in self.source.members(namespace, name) if _live(m)]
        parsed = [(b, plan.parse_body(b, None)) for b in bodies]
        members = [(b, m) for b, m in parsed if isinstance(m, P2PGroup | PDPair)]
        domain = self.domains.setdefault(
            (namespace, name), _Domain(fig.HitWindow(self.settings.figures_window))
        )
        reading = await self.read(pool, domain)
        models = [m for _, m in members]
        await self._write(body, fig.dump(fig.pool_figures(pool, models, reading)))
        for member_body, member in members:
            live = fig.dump(fig.member_figures(pool, member, reading))
            await self._write(member_body, live)
        new = fig.health(reading, domain.last_read)
        old, domain.health = domain.health, new
        return old is None or (old.ok, old.reason) != (new.ok, new.reason)

    async def read(self, pool: KVCachePool, domain: _Domain) -> fig.Reading:
        """The three GETs of one domain, at once; each side's figures or its error."""
        s, ns = self.settings, pool.metadata.namespace
        controller = s.controller_url.format(
            service=names.controller_name(pool), namespace=ns, port=pool.spec.controller.ports.http
        ).rstrip("/")
        gateway = s.gateway_url.format(
            service=names.gateway_name(pool), namespace=ns, port=pool.spec.gateway.port
        ).rstrip("/")
        stats, metrics, readyz = await asyncio.gather(
            self._get(controller + STATS_PATH),
            self._get(gateway + "/metrics"),
            self._get(gateway + "/readyz", ok=(200, 503)),  # 503: no instance ready, still JSON
            return_exceptions=True,
        )
        out: dict[str, Any] = {}
        try:
            out["controller"] = fig.read_controller(_json(_text(stats)))
        except (fig.ReadError, _GetError) as exc:
            out["controller_error"] = f"{controller}{STATS_PATH}: {exc}"
        try:
            hit, prompt = fig.read_gateway_counters(_text(metrics))
            frozen = fig.read_gateway_frozen(_json(_text(readyz)))
            out["gateway"] = fig.GatewayReading(hit, prompt, frozen)
        except (fig.ReadError, _GetError) as exc:
            out["gateway_error"] = f"{gateway}: {exc}"
        now = self.now()
        for side in ("controller", "gateway"):
            if side in out:
                domain.last_read[side] = now
            else:
                self.metrics.failed("KVCachePool", f"figures-{side}")
        gw = out.get("gateway")
        if gw is not None:
            domain.window.add(self.clock(), gw.hit_tokens, gw.prompt_tokens)
            out["window"] = domain.window.current()
        return fig.Reading(**out)

    async def _get(self, url: str, ok: tuple[int, ...] = (200,)) -> str:
        if self._http is None:
            # trust_env: a proxy in the pod's environment is used, as for the finalizer's calls
            self._http = aiohttp.ClientSession(trust_env=True)
        timeout = aiohttp.ClientTimeout(total=self.settings.figures_timeout)
        try:
            async with self._http.get(url, timeout=timeout) as resp:
                data = await resp.content.read(MAX_BODY + 1)
                if len(data) > MAX_BODY:
                    raise _GetError(f"answer larger than {MAX_BODY} bytes")
                if resp.status not in ok:
                    raise _GetError(f"HTTP {resp.status}")
                return data.decode("utf-8", errors="replace")
        except TimeoutError:
            raise _GetError(f"no answer within {self.settings.figures_timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _GetError(f"{type(exc).__name__}: {exc}") from None

    async def _write(self, body: Obj, live: Obj) -> None:
        """Merge-patch ``status.live`` to ``live`` when it differs from what the body holds."""
        current = (body.get("status") or {}).get("live")
        if current == live:
            return
        meta = body["metadata"]
        patch = {"status": {"live": fig.merge_replace(current, live)}}
        try:
            await self.client.patch(
                body["kind"], meta["namespace"], meta["name"], patch, status=True
            )
        except kube.ApiError as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to report on
                self.metrics.failed(str(body["kind"]), "figures-status")
                log.warning("could not write %s's live figures: %s", plan.ref(body), exc)


class _GetError(Exception):
    """A GET without a usable answer; the message says why."""


def _live(body: Obj) -> bool:
    return not body["metadata"].get("deletionTimestamp")


def _text(result: str | BaseException) -> str:
    if isinstance(result, _GetError):
        raise result
    if isinstance(result, BaseException):
        raise _GetError(f"{type(result).__name__} {result}")
    return result


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise fig.ReadError("the answer is not JSON") from None
