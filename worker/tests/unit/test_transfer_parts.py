"""The pure parts behind P2P and PD: the async lookup bookkeeping, the scheduler's wait for an
async lookup, the PD request parameters, the UCX device choice. No LMCache, no NIXL here: the
real transfers are in tests/integration/test_p2p_process.py and test_pd_process.py."""

from __future__ import annotations

import pytest

from kvpool.worker.engine.blocks import BlockManager
from kvpool.worker.engine.offload import pd
from kvpool.worker.engine.offload.async_lookup import AsyncLookups
from kvpool.worker.engine.scheduler import Scheduler, Sequence
from kvpool.worker.engine_api import GenerationRequest
from kvpool.worker.openai_models import OpenAIError
from kvpool.worker.pd_api import parse_kv_transfer
from kvpool.worker.ucx_env import device_for_ip, restrict_ucx


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def lookups(timeout_s: float = 3.0) -> tuple[AsyncLookups, list[str], Clock]:
    released: list[str] = []
    clock = Clock()
    return AsyncLookups(timeout_s, release=released.append, clock=clock), released, clock


def test_a_lookup_is_pending_until_answered_then_consumed() -> None:
    lk, released, _ = lookups()
    lk.begin("a")
    assert lk.result("a") is None
    lk.send_response_to_scheduler("a", 512)
    assert lk.result("a") == 512 and lk.wait("a") == 512
    lk.consumed("a")
    assert lk.pending == 0 and released == []


def test_a_cancelled_lookup_is_released_once_answered_and_never_twice() -> None:
    lk, released, _ = lookups()
    lk.begin("a")
    lk.cancel("a")  # still running in LMCache: nothing to free yet
    assert released == [] and lk.pending == 1
    lk.send_response_to_scheduler("a", 256)
    assert released == ["a"] and lk.pending == 0
    lk.cancel("a")
    lk.sweep()
    assert released == ["a"]


def test_an_answered_lookup_cancelled_is_released_at_once() -> None:
    lk, released, _ = lookups()
    lk.begin("b")
    lk.send_response_to_scheduler("b", 0)
    lk.cancel("b")
    assert released == ["b"] and lk.pending == 0


def test_an_unanswered_lookup_times_out_into_a_miss_and_is_freed_when_it_answers() -> None:
    lk, released, clock = lookups(timeout_s=3.0)
    lk.begin("c")
    clock.t = 2.9
    assert lk.result("c") is None
    clock.t = 3.1
    assert lk.result("c") == 0 and lk.timeouts == 1
    lk.send_response_to_scheduler("c", 768)  # LMCache finished after all
    assert released == ["c"] and lk.pending == 0


def test_a_lost_answer_is_forgotten_after_ten_timeouts() -> None:
    lk, released, clock = lookups(timeout_s=1.0)
    lk.begin("d")
    lk.cancel("d")
    clock.t = 10.5
    lk.sweep()
    assert lk.pending == 0 and released == []


def test_the_listener_is_woken_by_every_answer() -> None:
    lk, _, _ = lookups()
    woken: list[int] = []
    lk.set_listener(lambda: woken.append(1))
    lk.begin("e")
    lk.send_response_to_scheduler("e", 1)
    lk.send_response_to_scheduler("unknown", 1)
    assert woken == [1, 1]


def seq(rid: str, n: int) -> Sequence:
    return Sequence(GenerationRequest(rid, list(range(n))), list(range(n)), n, 0.0, None)


def test_the_scheduler_admits_a_sequence_only_once_its_async_lookup_answered() -> None:
    sched = Scheduler(BlockManager(64, 16), 4, 4096, async_prefix=True)
    first, second = seq("first", 40), seq("second", 40)
    sched.add(first)
    sched.add(second)
    second.lookup_id, second.lookup_hit = "second#1", 32  # answered; first still pending
    plan = sched.schedule()
    assert [i.seq.request_id for i in plan.items] == ["second"]
    assert list(sched.waiting) == [first]
    first.lookup_hit = 0
    assert [i.seq.request_id for i in sched.schedule().items] == ["second", "first"]


def test_a_preempted_sequence_needs_a_new_lookup() -> None:
    sched = Scheduler(BlockManager(4, 16), 4, 4096, async_prefix=True)
    s = seq("s", 40)
    s.lookup_id, s.lookup_hit = "s#1", 0
    sched.add(s)
    sched.schedule()
    sched._preempt(s)
    assert s.lookup_id is None and s.lookup_hit is None and sched.lookup_pending(s)


SENDER = {"enabled": True, "role": "sender"}
SPEC = {"req_id": "r1", "receiver_host": "10.0.0.2", "receiver_init_port": [7001, 7002],
        "receiver_alloc_port": [7101, 7102]}  # fmt: skip


def test_kv_transfer_params_become_the_hand_over() -> None:
    params = parse_kv_transfer({"ret_first_tok": True, "disagg_spec": SPEC}, SENDER)
    assert params is not None
    assert (params.req_id, params.receiver_host) == ("r1", "10.0.0.2")
    assert params.receiver_init_port == (7001, 7002)
    assert parse_kv_transfer(None, SENDER) is None
    single = parse_kv_transfer({"disagg_spec": {**SPEC, "receiver_init_port": 7001,
                                                "receiver_alloc_port": 7101}}, SENDER)  # fmt: skip
    assert single is not None and single.receiver_alloc_port == (7101,)


def test_a_pd_store_goes_in_groups_of_whole_chunks_with_one_last_spec() -> None:
    mib = 2**20
    assert pd.store_groups(2000, 256, 2 * mib) == [(0, 1024), (1024, 2000)]  # 4 of 2 MiB
    assert pd.store_groups(512, 256, 19 * mib) == [(0, 256), (256, 512)]  # a chunk at least
    assert pd.store_groups(90, 256, mib) == [(0, 90)]
    assert pd.store_groups(0, 256, mib) == []
    params = parse_kv_transfer({"disagg_spec": SPEC}, SENDER)
    assert params is not None
    first, last = pd.transfer_spec(params, 8, last=False), pd.transfer_spec(params, 8)
    assert (first.is_last_prefill, last.is_last_prefill) == (False, True)
    assert first.total_chunks == last.total_chunks == 8 and first.req_id == "r1"


@pytest.mark.parametrize(
    ("raw", "pd", "param"),
    [
        ({"disagg_spec": SPEC}, {"enabled": False}, "kv_transfer_params"),
        ({"disagg_spec": SPEC}, {"enabled": True, "role": "receiver"}, "kv_transfer_params"),
        ({}, SENDER, "kv_transfer_params.disagg_spec"),
        ({"disagg_spec": {**SPEC, "req_id": ""}}, SENDER, "kv_transfer_params.disagg_spec.req_id"),
        ({"disagg_spec": {**SPEC, "receiver_init_port": []}}, SENDER,
         "kv_transfer_params.disagg_spec.receiver_init_port"),
        ({"disagg_spec": {**SPEC, "receiver_alloc_port": [70000, 1]}}, SENDER,
         "kv_transfer_params.disagg_spec.receiver_alloc_port"),
        ({"disagg_spec": {**SPEC, "receiver_alloc_port": [7101]}}, SENDER,
         "kv_transfer_params.disagg_spec.receiver_alloc_port"),
    ],
)  # fmt: skip
def test_bad_kv_transfer_params_name_the_field(raw: dict, pd: dict, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(OpenAIError) as err:
        parse_kv_transfer(raw, pd)
    assert err.value.param == param


def test_ucx_is_restricted_to_the_device_holding_the_pod_ip() -> None:
    addrs = {"lo": "127.0.0.1", "eth0": "10.1.2.3", "net1": "192.168.0.9"}
    assert device_for_ip("127.0.0.1", addrs) == "lo"
    assert device_for_ip("10.1.2.3", addrs) == "eth0"
    assert device_for_ip("10.9.9.9", addrs) is None
    assert device_for_ip("not-an-ip", addrs) is None
    env = {"POD_IP": "127.0.0.1"}
    assert restrict_ucx(env) == "lo" and env["UCX_NET_DEVICES"] == "lo"
    explicit = {"POD_IP": "127.0.0.1", "UCX_NET_DEVICES": "mlx5_0:1"}
    assert restrict_ucx(explicit) == "mlx5_0:1"
    assert restrict_ucx({}) is None
