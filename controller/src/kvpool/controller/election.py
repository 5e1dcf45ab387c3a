"""Leader election on a ``coordination.k8s.io/v1`` Lease: the pure state machine.

Why pure: who leads decides which controller replica the workers and gateways reach, and the
rules that keep two replicas from leading at once are the ones that go wrong quietly. Kept free
of sockets and clocks (every ``now`` is passed in), every branch is pinned by unit tests; the
I/O (``ha.py``) only reads the Lease, asks :meth:`Elector.plan` what to write, writes it with
the resourceVersion it read, and reports back.

The rules are client-go's ``leaderelection`` (kube-controller-manager, kube-scheduler):

- A Lease names its ``holderIdentity``, ``leaseDurationSeconds``, ``acquireTime``,
  ``renewTime`` and ``leaseTransitions``. A candidate may take it when nobody holds it, or when
  the holder has not changed it for ``leaseDurationSeconds`` **as measured on the candidate's own
  monotonic clock since it last saw the record change** (never by comparing ``renewTime`` with
  its own wall clock: the replicas' clocks may disagree).
- Every write is an update with the ``resourceVersion`` last read (optimistic concurrency): two
  candidates that both see an expired lease both try, the API server accepts one and answers
  409 Conflict to the other.
- The leader renews every ``retry_period_s``; when it has not renewed for ``renew_deadline_s``
  (shorter than the lease) it stops leading, before any other replica may take the lease. Seeing
  another holder in the record stops it at once.
- Taking over from another holder increments ``leaseTransitions`` and sets ``acquireTime``.
- A graceful stop releases the lease (empty holder, as client-go's ``ReleaseOnCancel``), so a
  standby takes it on its next try instead of waiting for it to expire.

Identities are unique per process (``<pod>_<random>``, as kube-controller-manager does): a
restarted leader process must not mistake its pod's old lease for its own and lead with an
empty index while a warm standby waits.
"""

from __future__ import annotations

import datetime
import enum
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LeaseRecord:
    """The fields of a Lease that election reads and writes."""

    holder: str  # spec.holderIdentity; "" when released
    duration_s: int  # spec.leaseDurationSeconds (an int32 in the API)
    acquire_time: str | None  # spec.acquireTime (RFC 3339 MicroTime)
    renew_time: str | None  # spec.renewTime
    transitions: int  # spec.leaseTransitions
    resource_version: str | None = None  # metadata.resourceVersion; None: not stored yet

    def same_state(self, other: LeaseRecord | None) -> bool:
        """Whether ``other`` is the same stored version (what "the record changed" means)."""
        return other is not None and (
            self.holder,
            self.renew_time,
            self.transitions,
            self.resource_version,
        ) == (other.holder, other.renew_time, other.transitions, other.resource_version)


@dataclass(frozen=True)
class ElectionConfig:
    """Timing of one candidate; ``lease_duration_s > renew_deadline_s > retry_period_s``."""

    identity: str
    lease_duration_s: int = 3
    renew_deadline_s: float = 2.0
    retry_period_s: float = 0.5

    def problems(self) -> list[str]:
        """Why this timing cannot elect safely (empty when it can)."""
        out = []
        if not self.identity:
            out.append("the identity is empty")
        if self.lease_duration_s < 1:
            out.append(f"lease duration {self.lease_duration_s}s is under 1s")
        if not 0 < self.retry_period_s < self.renew_deadline_s:
            out.append(
                f"retry period {self.retry_period_s:g}s must be positive and shorter than the "
                f"renew deadline {self.renew_deadline_s:g}s"
            )
        if not self.renew_deadline_s < self.lease_duration_s:
            out.append(
                f"renew deadline {self.renew_deadline_s:g}s must be shorter than the lease "
                f"duration {self.lease_duration_s}s (a leader must stop before another may start)"
            )
        return out


class Action(enum.Enum):
    CREATE = "create"  # no Lease yet: create it, holding it
    ACQUIRE = "acquire"  # update it, taking it over (expired or released)
    RENEW = "renew"  # update it, still holding it
    WAIT = "wait"  # another holder's lease is valid: try again later
    STEP_DOWN = "step_down"  # leading, but another holder has it: stop leading now


@dataclass(frozen=True)
class Step:
    """What to do after reading the Lease: the action and, for a write, the record to write."""

    action: Action
    record: LeaseRecord | None = None
    wait_s: float = 0.0  # for WAIT: when the current holder's lease would expire, at the soonest


class Elector:
    """One candidate's view: the last record seen, when it changed, and whether it leads."""

    def __init__(self, config: ElectionConfig) -> None:
        problems = config.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.observed: LeaseRecord | None = None
        self.observed_at = -math.inf  # monotonic time the observed record last changed
        self.leading = False
        #: When the last successful write was *sent* (the API server stored it after that, so
        #: a standby's expiry clock, started when it saw the record, starts later still).
        self.renewed_at = -math.inf
        self._planned_at = -math.inf

    def observe(self, current: LeaseRecord | None, now: float) -> None:
        """Remember what a read returned; the expiry clock restarts only when it changed."""
        if current is None or not current.same_state(self.observed):
            self.observed = current
            self.observed_at = now

    def plan(self, current: LeaseRecord | None, now: float, wall: str) -> Step:
        """What to do given the Lease as just read (``None``: it does not exist); ``now`` is
        monotonic seconds, ``wall`` the RFC 3339 MicroTime written into the record."""
        self.observe(current, now)
        self._planned_at = now
        me = self.config.identity
        if current is None:
            return Step(
                Action.CREATE,
                LeaseRecord(me, self.config.lease_duration_s, wall, wall, 0, None),
            )
        if current.holder not in ("", me):
            if self.leading:
                return Step(Action.STEP_DOWN)
            expires = self.observed_at + current.duration_s
            if expires > now:
                return Step(Action.WAIT, wait_s=expires - now)
        mine = current.holder == me
        record = LeaseRecord(
            holder=me,
            duration_s=self.config.lease_duration_s,
            acquire_time=current.acquire_time if mine else wall,
            renew_time=wall,
            transitions=current.transitions if mine else current.transitions + 1,
            resource_version=current.resource_version,
        )
        return Step(Action.RENEW if mine else Action.ACQUIRE, record)

    def written(self, stored: LeaseRecord) -> bool:
        """The write of the record last planned succeeded (``stored``: as the server returned
        it). Returns True when this write started the leadership. The leadership counts from
        when the write was planned, not from the answer: a slow answer cannot stretch it past
        what a standby measures."""
        started = not self.leading
        self.observe(stored, self._planned_at)
        self.leading = True
        self.renewed_at = self._planned_at
        return started

    def failed(self, now: float) -> bool:
        """A read or write failed (conflict, timeout, refusal). Returns True when that ends the
        leadership: nothing was renewed for ``renew_deadline_s``."""
        if self.leading and now - self.renewed_at >= self.config.renew_deadline_s:
            self.leading = False
            return True
        return False

    def stepped_down(self) -> None:
        """The leadership ended (another holder seen, or the renew deadline passed)."""
        self.leading = False

    def release(self, wall: str) -> LeaseRecord | None:
        """The record that gives the lease up (empty holder), or None when not leading."""
        if not self.leading or self.observed is None:
            return None
        self.leading = False
        return replace(self.observed, holder="", duration_s=1, renew_time=wall)


def micro_time(epoch_s: float) -> str:
    """Kubernetes MicroTime (RFC 3339, microseconds, UTC) of a Unix time."""
    moment = datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
