"""Controller high availability: run as a standby until this replica wins the Lease, then lead.

Why this shape: every replica runs the same command. With ``--lease-name`` a replica first
labels its pod ``kvpool.io/controller-role=standby`` and follows the leader's index through the
controller Service (``standby.Follower``); it is ready once that copy is warm. It campaigns for
the Lease every retry period (``election.Elector``, client-go's rules). On winning it adopts the
copy (``standby.adopt``: same epoch and delta numbering, next term), binds the worker-facing
sockets, starts the loops (``ControllerServer.lead``) and labels its pod ``leader``: the
Service selects that label, so workers, gateways and the other replicas reach it from then on.

Readiness does not mean leadership: a warm standby is ready, so a Deployment rolls its pods one
by one (a pod that can never become ready would stall every rollout); the Service's label
selector is what sends traffic to the leader alone (as Patroni and Vault do it).

A leader that cannot renew for the renew deadline, or sees another holder, raises
:class:`LeadershipLostError`: the process exits, its sockets close, every client reconnects through
the Service to the new leader, and the kubelet restarts it as a standby. On SIGTERM the leader
flushes its last deltas to the stream and releases the Lease, so a standby takes over within a
retry period instead of waiting for the lease to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kvpool.controller.election import Action, ElectionConfig, Elector, LeaseRecord, micro_time
from kvpool.controller.kube import ConflictError, KubeClient, KubeError, load_config
from kvpool.controller.standby import Follower, adopt
from kvpool.protocol.domain import CONTROLLER_LEADER, CONTROLLER_ROLE_LABEL, CONTROLLER_STANDBY

if TYPE_CHECKING:
    from kvpool.controller.server import ControllerServer

logger = logging.getLogger(__name__)

#: How long a stopping leader gives its last deltas to reach the standby before it releases.
HANDOFF_S = 0.2


class LeadershipLostError(RuntimeError):
    """This replica no longer holds the Lease: it must stop serving (the process exits)."""


class Ha:
    """One replica's election: its identity, role, the follower and the Lease I/O."""

    def __init__(
        self,
        server: ControllerServer,
        kube: KubeClient,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        s = server.settings
        assert s.lease_name is not None and s.leader_pub_url and s.leader_snapshot_url
        self.server = server
        self.kube = kube
        self.lease = s.lease_name
        self.pod = s.pod_name
        self.identity = f"{s.pod_name or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        self.elector = Elector(
            ElectionConfig(self.identity, s.lease_duration_s, s.renew_deadline_s, s.retry_period_s)
        )
        self.follower = Follower(server.ctx, s.leader_pub_url, s.leader_snapshot_url)
        self.role = CONTROLLER_STANDBY
        self.labelled: str | None = None if self.pod else "(no pod)"
        self.transitions = 0
        self.last_error: str | None = None
        self._clock, self._wall = clock, wall
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ state

    @property
    def leading(self) -> bool:
        return self.elector.leading

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": self.role,
            "identity": self.identity,
            "lease": self.lease,
            "holder": self.elector.observed.holder if self.elector.observed else None,
            "term": self.server.service.term,
            "last_error": self.last_error,
        }
        if self.role == CONTROLLER_STANDBY:
            out["standby"] = self.follower.describe()
        return out

    def _error(self, kind: str, message: str) -> None:
        self.last_error = message
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("%s (further %s errors are not logged)", message, kind)

    # ------------------------------------------------------------------ Lease I/O

    async def _write(self, action: Action, record: LeaseRecord) -> LeaseRecord:
        if action is Action.CREATE:
            return await self.kube.create_lease(self.lease, record)
        return await self.kube.update_lease(self.lease, record)

    async def try_acquire(self) -> bool:
        """One campaign step: read the Lease, take it when free or expired. True: leading."""
        try:
            current = await self.kube.get_lease(self.lease)
            step = self.elector.plan(current, self._clock(), micro_time(self._wall()))
            if step.action is Action.WAIT or step.record is None:
                return False
            stored = await self._write(step.action, step.record)
        except ConflictError:
            return False  # another candidate wrote first
        except KubeError as exc:
            self._error("lease", f"Lease {self.lease}: {exc}")
            return False
        self.elector.written(stored)
        self.transitions = stored.transitions
        logger.info(
            "won the Lease %s as %s (transition %d)", self.lease, self.identity, stored.transitions
        )
        return True

    async def renew(self, reread: bool) -> bool:
        """One renewal (from the record last written, or read again after a conflict); False
        when the leadership is over."""
        try:
            current = await self.kube.get_lease(self.lease) if reread else self.elector.observed
            step = self.elector.plan(current, self._clock(), micro_time(self._wall()))
            if step.action is Action.STEP_DOWN or step.record is None:
                self.elector.stepped_down()
                holder = current.holder if current else "nobody"
                logger.error("the Lease %s is now held by %s", self.lease, holder)
                return False
            stored = await self._write(step.action, step.record)
        except KubeError as exc:
            self._error("renew", f"renewing the Lease {self.lease}: {exc}")
            if self.elector.failed(self._clock()):
                logger.error(
                    "could not renew the Lease %s for %.1fs (%s)",
                    self.lease,
                    self.elector.config.renew_deadline_s,
                    exc,
                )
                return False
            raise
        self.elector.written(stored)
        return True

    async def release(self) -> None:
        """Give the Lease up (a graceful stop), so a standby need not wait for it to expire."""
        record = self.elector.release(micro_time(self._wall()))
        if record is None:
            return
        try:
            await self.kube.update_lease(self.lease, record)
            logger.info("released the Lease %s", self.lease)
        except KubeError as exc:
            logger.warning("could not release the Lease %s: %s", self.lease, exc)

    async def label(self, role: str) -> None:
        """Label this replica's pod with its role, retrying until the API accepts it."""
        if not self.pod:
            return
        while True:
            try:
                await self.kube.label_pod(self.pod, {CONTROLLER_ROLE_LABEL: role})
            except KubeError as exc:
                self._error("label", f"labelling pod {self.pod} {role}: {exc}")
                await asyncio.sleep(self.elector.config.retry_period_s)
                continue
            self.labelled = role
            logger.info("pod %s labelled %s=%s", self.pod, CONTROLLER_ROLE_LABEL, role)
            return

    # ------------------------------------------------------------------ loops

    async def _campaign(self) -> None:
        """Standby: ready while the copy is warm and the pod is labelled standby; try for the
        Lease every retry period until it is won."""
        retry = self.elector.config.retry_period_s
        while True:
            self.server.ready = self.follower.warm and self.labelled is not None
            if await self.try_acquire():
                return
            await asyncio.sleep(retry)

    async def _keep(self) -> None:
        """Leader: renew every retry period; raise :class:`LeadershipLostError` when it is over."""
        reread = False
        while True:
            await asyncio.sleep(self.elector.config.retry_period_s)
            try:
                if not await self.renew(reread):
                    raise LeadershipLostError(
                        f"{self.identity} lost the Lease {self.lease}: exiting, so every client "
                        "reconnects to the new leader"
                    )
                reread = False
            except ConflictError:
                reread = True
            except KubeError:
                pass

    async def run(self, lead: Callable[[bool, asyncio.Event], Coroutine[Any, Any, None]]) -> None:
        """Standby until the Lease is won, then ``lead(cold, serving)`` with renewals beside it
        (``cold``: nothing to adopt, start as a fresh controller)."""
        try:
            await self._standby()
            self.follower.drain()
            self.follower.close()
            cold = self.follower.replica.epoch is None
            service = self.server.service
            term = adopt(service, self.follower.replica, service.clock())
            self.role = CONTROLLER_LEADER
            logger.info(
                "leading: %s epoch %s, term %d, from delta %d",
                "cold start," if cold else "adopted the standby copy,",
                self.server.service.epoch,
                term,
                self.server.service.term_start,
            )
            serving = asyncio.Event()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._keep())
                tg.create_task(lead(cold, serving))
                await serving.wait()
                await self.label(CONTROLLER_LEADER)
        finally:
            self.follower.close()
            if self.elector.leading:
                with contextlib.suppress(Exception):
                    self.server.flush()
                await asyncio.sleep(HANDOFF_S)  # the last deltas reach the standby first
                await self.release()

    async def _standby(self) -> None:
        await self.label(CONTROLLER_STANDBY)
        async with asyncio.TaskGroup() as tg:
            follow = tg.create_task(self.follower.run())
            await self._campaign()
            follow.cancel()


async def run_elected(server: ControllerServer) -> None:
    """``ControllerServer.serve`` with ``--lease-name``: the module docstring."""
    config = load_config()
    namespace = server.settings.pod_namespace or config.namespace or "default"
    kube = KubeClient(config, namespace, timeout_s=server.settings.renew_deadline_s / 2)
    ha = Ha(server, kube)
    server.ha = ha
    try:
        await ha.run(server.lead)
    finally:
        await kube.close()
