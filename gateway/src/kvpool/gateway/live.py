"""Live reconfiguration: a new ``gateway.yaml`` applied to the running gateway, from the mounted
file (watched) or the admin endpoint (``api_admin``), without a restart.

Why this module exists: routing weights, the policy, the guards, the P2P groups' instances and
the PD pairs change while requests stream. A restart for each (what the operator's config hash
did) cuts every stream in flight and empties the gateway's load counts, pending prefixes,
breakers and index replica. Here a new document is parsed and validated like the one read at
start, compared with the one in force (``reconfig.diff``), and applied in one step of the event
loop (no request sees half of it):

- instances that keep their facts keep their objects (readiness, breaker) and, by name, their
  load and pending prefixes; new or moved ones are probed *before* the swap (so they take
  requests at once when ready); removed ones are retired: requests in flight keep their
  instance and load ticket and finish, no new one goes there;
- a new router for changed routing or guards; the PD coordinator binds a new pair's proxy port
  before the swap (a port it cannot bind refuses the document, naming it) and closes the port
  of a removed pair only after the transfer timeout (transfers in flight land);
- a document that is invalid, or changes what only a restart applies
  (``kvpool.protocol.gateway_config``), is not applied: the gateway keeps the configuration in
  force, logs the error naming the key, and shows it (``describe``: ``/readyz``'s ``config``,
  the admin endpoint, ``kvpool_gateway_config_rejected``) until a document applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvpool.gateway.config import ConfigError, GatewayConfig, parse_document
from kvpool.gateway.filewatch import FileWatch
from kvpool.gateway.instances import Instance, probe
from kvpool.gateway.reconfig import Change, diff, instance_facts, router_for

if TYPE_CHECKING:
    from kvpool.gateway.state import GatewayState

logger = logging.getLogger(__name__)

#: How often the mounted file is checked (one ``stat``), seconds; the kubelet itself takes
#: up to a minute or so to update a mounted ConfigMap.
WATCH_INTERVAL_S = 2.0
#: The readiness probe of a new instance before the swap, seconds at most.
PROBE_TIMEOUT_S = 3.0

Status = Literal["applied", "unchanged", "checked", "invalid", "restart_required"]


@dataclass(frozen=True)
class Outcome:
    """What became of one new document; ``message`` names the key at fault when refused."""

    status: Status
    generation: int
    message: str
    changes: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return self.status in ("invalid", "restart_required")

    def body(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "generation": self.generation,
            "message": self.message,
            "changes": list(self.changes),
        }


def digest(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()[:16]


class Reconfigurer:
    """Applies new configurations to ``state``; watches ``path`` when given.

    ``processes``: gateway processes serving the port (``serve --workers``). With more than one,
    each follows the file itself, an admin POST would reach one of them (refused), and PD pairs
    are refused (their senders notify one proxy port, as at start).
    """

    def __init__(
        self,
        state: GatewayState,
        path: Path | None = None,
        *,
        processes: int = 1,
        interval_s: float = WATCH_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.state = state
        self.path = path
        self.processes = processes
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.generation = 1
        self.source = "start"
        self.applied_at = time.time()
        self.error: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self._watch = FileWatch(path) if path is not None else None
        self._seen: str | None = None
        if path is not None:
            with contextlib.suppress(OSError):
                self._seen = digest(path.read_bytes())
        self.state.metrics.config_generation.set(self.generation)

    # -- status ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The configuration in force and the last refusal since (None once one applied)."""
        return {
            "generation": self.generation,
            "source": self.source,
            "applied_at": self.applied_at,
            "file": str(self.path) if self.path is not None else None,
            "rejected": self.error,
        }

    def _record(self, outcome: Outcome, source: str) -> Outcome:
        metrics = self.state.metrics
        metrics.config_reloads.labels(source, outcome.status).inc()
        if outcome.refused:
            self.error = {"source": source, "status": outcome.status, "at": time.time(),
                          "message": outcome.message}  # fmt: skip
            metrics.config_rejected.set(1)
            logger.error(
                "configuration from %s not applied (%s): %s; still serving generation %d",
                source,
                outcome.status,
                outcome.message,
                self.generation,
            )
        elif outcome.status == "applied":
            self.error = None
            metrics.config_rejected.set(0)
            metrics.config_generation.set(self.generation)
        return outcome

    # -- applying ----------------------------------------------------------------------------
    async def load(self, text: bytes | str, source: str, *, dry_run: bool = False) -> Outcome:
        """Parse ``text`` (``source``: "file" or "admin") and :meth:`apply` it."""
        try:
            config = parse_document(text, source)
        except ConfigError as exc:
            refused = Outcome("invalid", self.generation, str(exc))
            return refused if dry_run else self._record(refused, source)
        return await self.apply(config, source, dry_run=dry_run)

    async def apply(self, new: GatewayConfig, source: str, *, dry_run: bool = False) -> Outcome:
        """Apply ``new`` over the configuration in force (``dry_run``: only say what it would
        change). One at a time."""
        async with self._lock:
            change = diff(self.state.config, new)
            refused = self._refusal(new, change)
            if refused is not None:
                return refused if dry_run else self._record(refused, source)
            lines = tuple(change.summary())
            if dry_run:
                return Outcome("checked", self.generation, "; ".join(lines) or "no change", lines)
            if change.empty:
                return self._record(Outcome("unchanged", self.generation, "no change"), source)
            fresh = await self._fresh_instances(new)
            try:
                self.state.pd.bind_ports(new.pd_pairs)
            except OSError as exc:
                failed = Outcome("invalid", self.generation, f"pdPairs: {exc}")
                return self._record(failed, source)
            self._swap(new, change, fresh)
            self.generation += 1
            self.source = source
            self.applied_at = time.time()
            logger.info(
                "configuration from %s applied (generation %d): %s",
                source,
                self.generation,
                "; ".join(lines),
            )
            return self._record(Outcome("applied", self.generation, "applied", lines), source)

    def _refusal(self, new: GatewayConfig, change: Change) -> Outcome | None:
        if change.needs_restart:
            keys = "; ".join(change.restart)
            return Outcome(
                "restart_required",
                self.generation,
                f"{keys}: only a restart applies these keys (the operator's config hash "
                "restarts the pod for them); the running gateway keeps its configuration",
                tuple(change.summary()),
            )
        if new.pd_pairs and self.processes > 1:
            return Outcome(
                "invalid",
                self.generation,
                f"pdPairs: this gateway runs {self.processes} processes (--workers), and a PD "
                "pair's senders notify one proxy port; run one process to proxy PD pairs",
            )
        return None

    async def _fresh_instances(self, new: GatewayConfig) -> dict[str, Instance]:
        """New objects for the instances of ``new`` that are not current (new or moved),
        probed once so that a ready one takes requests from the swap on."""
        current = self.state.instances.by_name
        fresh = {
            facts.name: Instance.of(facts)
            for facts in instance_facts(new)
            if facts.name not in current or current[facts.name].facts != facts
        }
        if fresh:
            results = await asyncio.gather(
                *(probe(self.state.http, i, self.probe_timeout_s) for i in fresh.values())
            )
            for inst, ok in zip(fresh.values(), results, strict=True):
                inst.ready = ok
        return fresh

    def _swap(self, new: GatewayConfig, change: Change, fresh: Mapping[str, Instance]) -> None:
        """Everything at once, without an ``await``: no request sees half of it."""
        state = self.state
        current = state.instances.by_name
        members = [fresh.get(f.name) or current[f.name] for f in instance_facts(new)]
        retired = state.instances.replace(members)
        for inst in members:
            if inst.name in fresh:
                state.metrics.instance_ready.labels(inst.name).set(1 if inst.ready else 0)
        for inst in retired:
            if inst.name not in state.instances.by_name:
                state.metrics.forget_instance(inst.name)
        if change.routing:
            state.selector.router = router_for(new)
        state.selector.pending.ttl_s = new.guards.pending_ttl_seconds
        state.pd.use_pairs(new.pd_pairs)
        state.config = new

    # -- the mounted file --------------------------------------------------------------------
    async def check_file(self) -> Outcome | None:
        """Read the file again if it changed since last seen; None when it did not (or its
        content is what was seen last: the kubelet's symlink swap of equal data)."""
        if self._watch is None or self.path is None or not self._watch.changed():
            return None
        try:
            text = self.path.read_bytes()
        except OSError as exc:
            refused = Outcome("invalid", self.generation, f"{self.path}: {exc.strerror}")
            return self._record(refused, "file")
        seen = digest(text)
        if seen == self._seen:
            return None
        self._seen = seen
        return await self.load(text, "file")

    async def watch(self) -> None:
        """Forever: every ``interval_s``, apply the file if it changed."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_file()
            except Exception:  # a bug must not stop the watch: the next change is tried again
                logger.exception("reading the configuration file %s failed", self.path)
