"""The Lease election state machine (``election.py``), pure: every branch of client-go's rules,
and a property: whatever the interleaving, latencies and lost answers, two replicas never both
believe they lead (a leader's belief lasts until ``renew_deadline`` after its last successful
write was sent).

The API server is an in-memory store with resourceVersions (``Store``), as small as the rules
need: the real Lease API is exercised against the emulator in ``tests/integration``.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.controller.election import (
    Action,
    ElectionConfig,
    Elector,
    LeaseRecord,
    micro_time,
)

CFG = ElectionConfig("a", lease_duration_s=3, renew_deadline_s=2.0, retry_period_s=0.5)


def rec(holder: str, rv: str = "1", transitions: int = 0, renew: str = "r0") -> LeaseRecord:
    return LeaseRecord(holder, 3, "t0", renew, transitions, rv)


def test_no_lease_is_created_holding_it() -> None:
    step = Elector(CFG).plan(None, 0.0, "w")
    assert step.action is Action.CREATE
    assert step.record == LeaseRecord("a", 3, "w", "w", 0, None)


def test_a_valid_lease_of_another_is_waited_on_by_the_candidates_own_clock() -> None:
    e = Elector(CFG)
    assert e.plan(rec("b"), 100.0, "w").action is Action.WAIT
    step = e.plan(rec("b"), 102.9, "w")  # unchanged for 2.9 s of *our* time: still valid
    assert step.action is Action.WAIT and step.wait_s == pytest.approx(0.1)
    # the holder renewed (new resourceVersion): the expiry clock starts again
    assert e.plan(rec("b", rv="2", renew="r1"), 103.5, "w").action is Action.WAIT
    assert e.plan(rec("b", rv="2", renew="r1"), 106.4, "w").action is Action.WAIT
    step = e.plan(rec("b", rv="2", renew="r1"), 106.5, "w")  # 3 s unchanged: expired
    assert step.action is Action.ACQUIRE
    assert step.record == LeaseRecord("a", 3, "w", "w", 1, "2")


def test_wall_clock_times_in_the_record_do_not_matter() -> None:
    """A renewTime far in the past (a skewed clock) is not "expired": only change is seen."""
    e = Elector(CFG)
    assert e.plan(rec("b", renew="1970-01-01T00:00:00.000000Z"), 0.0, "w").action is Action.WAIT


def test_a_released_lease_is_taken_at_once_and_counts_a_transition() -> None:
    step = Elector(CFG).plan(rec("", transitions=2), 0.0, "w")
    assert step.action is Action.ACQUIRE and step.record is not None
    assert (step.record.holder, step.record.transitions, step.record.acquire_time) == ("a", 3, "w")
    assert step.record.resource_version == "1"  # the write is conditional on what was read


def test_the_leader_renews_keeping_acquire_time_and_transitions() -> None:
    e = Elector(CFG)
    step = e.plan(rec("", transitions=2), 0.0, "w0")
    assert step.record is not None
    assert e.written(dataclasses.replace(step.record, resource_version="2"))  # started leading
    step = e.plan(e.observed, 0.5, "w1")
    assert step.action is Action.RENEW and step.record is not None
    assert (step.record.acquire_time, step.record.renew_time) == ("w0", "w1")
    assert step.record.transitions == 3 and step.record.resource_version == "2"
    assert not e.written(dataclasses.replace(step.record, resource_version="3"))  # not new


def test_a_leader_that_sees_another_holder_steps_down() -> None:
    e = Elector(CFG)
    step = e.plan(None, 0.0, "w")
    assert step.record is not None
    e.written(dataclasses.replace(step.record, resource_version="1"))
    assert e.plan(rec("b", rv="5"), 0.6, "w").action is Action.STEP_DOWN


def test_the_leader_stops_when_it_could_not_renew_for_the_deadline() -> None:
    e = Elector(CFG)
    step = e.plan(None, 10.0, "w")
    assert step.record is not None
    e.written(dataclasses.replace(step.record, resource_version="1"))
    assert not e.failed(11.0) and e.leading
    assert not e.failed(11.9)
    assert e.failed(12.0) and not e.leading
    assert not e.failed(20.0)  # a standby's failures end nothing


def test_release_gives_the_lease_up_and_only_when_leading() -> None:
    e = Elector(CFG)
    assert e.release("w") is None
    step = e.plan(None, 0.0, "w")
    assert step.record is not None
    e.written(dataclasses.replace(step.record, resource_version="7"))
    released = e.release("w2")
    assert released is not None and released.holder == "" and released.resource_version == "7"
    assert not e.leading


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (ElectionConfig("", 3, 2.0, 0.5), "identity is empty"),
        (ElectionConfig("a", 2, 2.0, 0.5), "shorter than the lease"),
        (ElectionConfig("a", 3, 2.0, 2.0), "shorter than the renew deadline"),
        (ElectionConfig("a", 0, 0.5, 0.1), "under 1s"),
    ],
)
def test_unsafe_timing_is_refused_naming_the_rule(config: ElectionConfig, fragment: str) -> None:
    assert any(fragment in p for p in config.problems())
    with pytest.raises(ValueError, match=fragment):
        Elector(config)


def test_micro_time_is_kubernetes_micro_time() -> None:
    assert micro_time(0.5) == "1970-01-01T00:00:00.500000Z"


# ---------------------------------------------------------------- property: one leader at a time


@dataclasses.dataclass
class Store:
    """The API server's Lease: create if absent, update only at the current resourceVersion."""

    record: LeaseRecord | None = None
    rv: int = 0

    def write(self, action: Action, record: LeaseRecord) -> LeaseRecord | None:
        if action is Action.CREATE and self.record is not None:
            return None
        if action is not Action.CREATE and (
            self.record is None or record.resource_version != self.record.resource_version
        ):
            return None
        self.rv += 1
        self.record = dataclasses.replace(record, resource_version=str(self.rv))
        return self.record


def _believes(e: Elector, now: float) -> bool:
    return e.leading and now < e.renewed_at + e.config.renew_deadline_s


@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 2),  # which replica acts
            st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.5, 2.9, 3.0]),  # time before it does
            st.sampled_from([0.0, 0.01, 0.2, 0.8]),  # latency of its read, then of its write
            st.sampled_from(["ok", "ok", "ok", "lost_request", "lost_answer"]),
        ),
        max_size=60,
    )
)
def test_two_replicas_never_both_believe_they_lead(
    ops: list[tuple[int, float, float, str]],
) -> None:
    electors = [Elector(dataclasses.replace(CFG, identity=f"r{i}")) for i in range(3)]
    store = Store()
    now = 0.0
    for who, pause, latency, fate in ops:
        e = electors[who]
        now += pause
        read = store.record  # the server answers the read...
        now += latency  # ...and the answer arrives later
        step = e.plan(read if not e.leading else (e.observed or read), now, f"w{now:.3f}")
        if step.action is Action.STEP_DOWN:
            e.stepped_down()
        elif step.record is not None:
            stored = None if fate == "lost_request" else store.write(step.action, step.record)
            now += latency
            if stored is not None and fate == "ok":
                e.written(stored)
            else:
                e.failed(now)
        believers = [x.config.identity for x in electors if _believes(x, now)]
        assert len(believers) <= 1, (believers, now)
