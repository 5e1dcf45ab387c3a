"""PendingPrefixes (bitmasks per chunk hash, entries dropped eagerly) answers as the plain rule
says, checked with hypothesis against a list of recorded prompts read one at a time.

The rule: an instance's pending prefix of a prompt is the longest run of the prompt's leading
chunk hashes each covered by a live prompt recorded for that instance; a prompt recorded
without a ticket lives ``ttl`` from its recording, one with a ticket while its request
prefills, then ``ttl`` after its first byte, and not at all once it ended without one. The
entries of the oldest prompts go first past ``max_entries``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.gateway.load import LoadTracker, Ticket
from kvpool.gateway.pending import PendingPrefixes

TTL = 2.0
NAMES = ("a", "b", "c", "d")
KEYS = tuple(range(10, 16))


@dataclass
class Recorded:
    instance: str
    hashes: tuple[int, ...]
    at: float
    ticket: Ticket | None


def alive(r: Recorded, now: float) -> bool:
    if r.ticket is None:
        return r.at + TTL > now
    if r.ticket.first_byte_at is not None:
        return r.ticket.first_byte_at + TTL > now
    return not r.ticket.done


def reference(recorded: list[Recorded], hashes: tuple[int, ...], now: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in NAMES:
        live = [r for r in recorded if r.instance == name and alive(r, now)]
        n = 0
        for h in hashes:
            if not any(h in r.hashes for r in live):
                break
            n += 1
        if n:
            out[name] = n
    return out


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("record"),
            st.sampled_from(NAMES),
            st.lists(st.sampled_from(KEYS), min_size=1, max_size=6),
            st.booleans(),
        ),
        st.tuples(st.just("first_byte"), st.integers(0, 20)),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 1.0, 1.5, 2.5])),
        st.tuples(st.just("look"), st.lists(st.sampled_from(KEYS), max_size=6)),
    ),
    max_size=40,
)


@given(ops)
@settings(max_examples=300, deadline=None)
def test_pending_prefixes_follow_the_rule(steps: list[tuple[object, ...]]) -> None:
    pending = PendingPrefixes(ttl_s=TTL, max_entries=10_000)
    load = LoadTracker()
    recorded: list[Recorded] = []
    tickets: list[Ticket] = []
    now = 0.0
    for step in steps:
        kind = step[0]
        if kind == "record":
            _, name, keys, with_ticket = step
            assert isinstance(name, str) and isinstance(keys, list)
            ticket = load.start(name, 10, now) if with_ticket else None
            if ticket is not None:
                tickets.append(ticket)
            pending.record(name, tuple(keys), now, ticket)
            recorded.append(Recorded(name, tuple(keys), now, ticket))
        elif kind in ("first_byte", "finish") and tickets:
            k = step[1]
            assert isinstance(k, int)
            ticket = tickets[k % len(tickets)]
            if kind == "first_byte":
                load.first_byte(ticket, now)
            else:
                load.finish(ticket)
        elif kind == "wait":
            dt = step[1]
            assert isinstance(dt, float)
            now += dt
        elif kind == "look":
            keys = step[1]
            assert isinstance(keys, list)
            want = reference(recorded, tuple(keys), now)
            assert pending.hits(tuple(keys), now) == want
            for name in NAMES:
                assert pending.hit(name, tuple(keys), now) == want.get(name, 0)


def test_entries_past_the_bound_go_oldest_prompt_first() -> None:
    pending = PendingPrefixes(ttl_s=100, max_entries=10)
    pending.record("a", list(range(6)), 0.0)
    pending.record("b", list(range(6)), 0.0)  # 12 entries: a's prompt goes
    assert len(pending) == 6
    assert pending.hits(list(range(6)), 1.0) == {"b": 6}
    pending.record("c", list(range(50)), 1.0)  # alone past the bound: its leading chunks stay
    assert len(pending) == 10
    assert pending.hits(list(range(50)), 1.0) == {"c": 10}


def test_forget_drops_the_prompts_holding_an_evicted_chunk() -> None:
    pending = PendingPrefixes(ttl_s=100)
    pending.record("a", [1, 2, 3], 0.0)
    pending.record("b", [1, 2, 3], 0.0)
    pending.record("a", [7, 8], 0.0)
    assert pending.forget([2], ["a"]) == 1  # a's first prompt; b's stays
    assert pending.hits([1, 2, 3], 1.0) == {"b": 3}
    assert pending.hits([7, 8], 1.0) == {"a": 2}
    assert pending.forget([9], None) == 0
    assert pending.forget([3, 8], None) == 2
    assert pending.hits([1, 2, 3], 1.0) == {} and pending.hits([7, 8], 1.0) == {}
    assert len(pending) == 0
    assert pending.forget([1], ["nobody"]) == 0


def test_forget_of_a_prompt_still_prefilling() -> None:
    """Its ticket's later first byte or end must not touch what forget dropped."""
    load = LoadTracker()
    pending = PendingPrefixes(ttl_s=100)
    ticket = load.start("a", 10, 0.0)
    pending.record("a", [1, 2], 0.0, ticket)
    assert pending.forget([1], ["a"]) == 1
    load.first_byte(ticket, 1.0)
    load.finish(ticket)
    assert pending.hits([1, 2], 2.0) == {} and len(pending) == 0
