"""The simulated engine's LMCache controller client against a scripted controller.

The controller side is a few ZMQ sockets in this test (PULL, ROUTER, heartbeat ROUTER, and a
DEALER to the worker's REP port) answering as a script says, so each behaviour of LMCache
0.5.6's worker can be provoked and its frames read: registration (accepted, refused, never
answered), heartbeats, batched admits with sequence numbers, a full sync with its freeze and a
resend of missing batches, a P2P lookup at arrival, the REP socket's answers and the final
deregistration. The real controller is in tests/integration/test_sim_process.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as w
from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer
from kvpool.protocol.hashing import HashConfig, chunk_hashes
from kvpool.worker.cli import await_lmcache_controller
from kvpool.worker.controller_wait import ControllerUnreachableError, wait_for_controller
from kvpool.worker.engine_api import GenerationRequest, SamplingParams
from kvpool.worker.server import WorkerRuntime, build_app
from kvpool.worker.settings import WorkerSettings
from kvpool.worker.sim.config import ControllerLink, FullSyncParams
from kvpool.worker.sim.engine import SimEngine
from kvpool.worker.sim.lmcache_client import ControllerClient

Make = Callable[..., SimEngine]
Answer = Callable[[Any], Any]
PROMPT = [(i * 53) % 8000 + 5 for i in range(70)]  # 4 full chunks of 16 + 6 tokens
KEYS = chunk_hashes(PROMPT, HashConfig(chunk_size=16))


class FakeController:
    """Scripted controller sockets on 127.0.0.1; ``answer(msg)`` returns a reply or None."""

    def __init__(self, answer: Answer, ports: dict[str, int] | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.hb = self.ctx.socket(zmq.ROUTER)
        socks = (("pull", self.pull), ("reply", self.router), ("hb", self.hb))
        if ports is not None:  # a controller that comes up at an address known beforehand
            for name, sock in socks:
                sock.bind(f"tcp://127.0.0.1:{ports[name]}")
            self.ports = dict(ports)
        else:
            self.ports = {name: sock.bind_to_random_port("tcp://127.0.0.1") for name, sock in socks}
        self.answer = answer
        self.pushed: list[Any] = []
        self.asked: list[Any] = []
        self.tasks = [
            asyncio.create_task(self._pull()),
            asyncio.create_task(self._serve(self.router)),
            asyncio.create_task(self._serve(self.hb)),
        ]

    async def _pull(self) -> None:
        while True:
            for frame in await self.pull.recv_multipart():
                self.pushed.append(codec.decode(frame))

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            ident, payload = codec.parse_router_frames(await sock.recv_multipart())
            msg = codec.decode(payload)
            self.asked.append(msg)
            reply = self.answer(msg)
            if reply is not None:
                await sock.send_multipart([ident, b"", codec.encode(reply)])

    def link(self, worker_port: int, **kw: Any) -> ControllerLink:
        args: dict[str, Any] = {
            "heartbeat_delay_s": 0.0,
            "heartbeat_s": 0.05,
            "recv_timeout_s": 1.0,
        }
        return ControllerLink(
            pull_url=f"127.0.0.1:{self.ports['pull']}",
            reply_url=f"127.0.0.1:{self.ports['reply']}",
            worker_port=worker_port,
            **{**args, **kw},
        )

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.pushed if isinstance(m, kind)]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)


def accept(fake: FakeController) -> Answer:
    def answer(msg: Any) -> Any:
        if isinstance(msg, w.RegisterMsg):
            return w.RegisterRetMsg({"heartbeat_url": f"127.0.0.1:{fake.ports['hb']}"})
        if isinstance(msg, w.HeartbeatMsg):
            return w.HeartbeatRetMsg()
        return None

    return answer


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def attach(
    eng: SimEngine, fake: FakeController | None, at: ControllerLink | None = None, **link: Any
) -> ControllerClient:
    """A client for ``eng`` to ``fake``'s sockets, or to the link ``at`` (no controller yet)."""
    if at is None:
        assert fake is not None
        at = fake.link(free_port(), **link)
    eng.client = ControllerClient(
        at,
        instance_id="sim-0~0123456789ab",
        ip="127.0.0.1",
        bind_host="127.0.0.1",
        peer_init_url="127.0.0.1:1" if eng.p2p else None,
        control=eng.memory,
        sync_keys=eng.ddr_keys,
        set_frozen=eng.set_frozen,
    )
    return eng.client


async def complete(eng: SimEngine, rid: str, n: int = 2) -> list[Any]:
    req = GenerationRequest(rid, PROMPT, SamplingParams(max_tokens=n))
    return [e async for e in eng.generate(req)]


async def until(pred: Callable[[], Any], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


def test_register_heartbeat_admits_in_order_and_deregister(make_sim_engine: Make) -> None:
    async def run() -> tuple[FakeController, dict[str, float]]:
        fake = FakeController(lambda m: None)
        fake.answer = accept(fake)
        eng = make_sim_engine()
        attach(eng, fake)
        await eng.start()
        await complete(eng, "a")
        await until(lambda: fake.of(w.BatchedKVOperationMsg))
        await until(lambda: sum(isinstance(m, w.HeartbeatMsg) for m in fake.asked) >= 2)
        # the client counts a heartbeat once its answer is back, after the fake has read it
        await until(lambda: eng.metrics()["lmcache_heartbeats_total"] >= 2)
        m = eng.metrics()
        await eng.shutdown(1.0)
        await until(lambda: fake.of(w.DeRegisterMsg))
        await fake.close()
        return fake, m

    fake, m = asyncio.run(run())
    reg = fake.asked[0]
    assert reg == w.RegisterMsg("sim-0~0123456789ab", 0, "127.0.0.1", reg.port, None)
    ops = [op for b in fake.of(w.BatchedKVOperationMsg) for op in b.operations]
    assert [(op.op_type, op.key, op.seq_num) for op in ops] == [
        (w.OpType.ADMIT, k, i) for i, k in enumerate(KEYS)
    ]
    assert all(b.location == "LocalCPUBackend" for b in fake.of(w.BatchedKVOperationMsg))
    dereg = w.DeRegisterMsg("sim-0~0123456789ab", 0, "127.0.0.1", reg.port)
    assert fake.of(w.DeRegisterMsg) == [dereg]
    assert m["lmcache_controller_registered"] == 1 and m["lmcache_heartbeats_total"] >= 2


def test_a_refusal_is_the_engines_refusal_and_silence_makes_it_mute(make_sim_engine: Make) -> None:
    async def run() -> tuple[str | None, bool, list[Any]]:
        refused = FakeController(lambda m: w.ErrorMsg("registration refused: fingerprint mismatch"))
        eng = make_sim_engine()
        attach(eng, refused)
        await eng.start()
        reason = eng.controller_refusal
        await eng.shutdown(0.5)
        await refused.close()
        silent = FakeController(lambda m: None)
        mute = make_sim_engine()
        attach(mute, silent, recv_timeout_s=0.2)
        await mute.start()
        await complete(mute, "a")
        await asyncio.sleep(0.1)
        assert mute.client is not None
        is_mute = mute.client.mute
        await mute.shutdown(0.5)
        await silent.close()
        return reason, is_mute, silent.pushed

    reason, is_mute, pushed = asyncio.run(run())
    assert reason == "fingerprint mismatch"
    assert is_mute and pushed == []  # LMCache's worker goes mute without a registration


@pytest.mark.parametrize("wait_s", [0.0, 10.0])
def test_a_controller_that_answers_only_after_the_worker_started(
    make_sim_engine: Make, wait_s: float
) -> None:
    """A domain's roll: the worker starts while no controller answers (its replicas elect);
    one comes up 1.2 s later. Without the wait (0, LMCache's behaviour) the RegisterMsg times
    out and the worker is mute for good; with it the engine asks (a P2P lookup of no chunk,
    each attempt on a fresh socket), is not ready while it waits, registers once answered, and
    its admits reach the controller."""
    ports = {name: free_port() for name in ("pull", "reply", "hb")}
    hb_url = f"127.0.0.1:{ports['hb']}"

    def answer(msg: Any) -> Any:
        if isinstance(msg, w.BatchedP2PLookupMsg):
            return w.BatchedP2PLookupRetMsg([("", "", 0, "")])
        if isinstance(msg, w.RegisterMsg):
            return w.RegisterRetMsg({"heartbeat_url": hb_url})
        return w.HeartbeatRetMsg() if isinstance(msg, w.HeartbeatMsg) else None

    async def run() -> tuple[bool, str | None, bool, list[Any], list[Any]]:
        eng = make_sim_engine(controller_wait_s=wait_s)
        at = ControllerLink(
            pull_url=f"127.0.0.1:{ports['pull']}",
            reply_url=f"127.0.0.1:{ports['reply']}",
            worker_port=free_port(),
            heartbeat_delay_s=0.0,
            heartbeat_s=0.05,
            recv_timeout_s=0.3,
        )
        attach(eng, None, at)
        runtime = WorkerRuntime(eng, load_tokenizer(REFERENCE_TOKENIZER_DIR))
        app = httpx.ASGITransport(app=build_app(runtime, start_engine=False))
        start = asyncio.create_task(runtime.start_engine())
        await asyncio.sleep(0.6)
        waiting = eng.waiting_for_controller
        async with httpx.AsyncClient(transport=app, base_url="http://w") as http:
            readyz = (await http.get("/readyz")).json() if waiting else None
        await asyncio.sleep(0.6)
        started_before = start.done()  # before any controller was there
        fake = FakeController(answer, ports)
        await start
        await complete(eng, "a")
        if wait_s:
            await until(lambda: fake.of(w.BatchedKVOperationMsg))
        else:
            await asyncio.sleep(0.3)
        assert eng.client is not None
        mute = eng.client.mute
        await eng.shutdown(0.5)
        await fake.close()
        return mute, waiting, readyz, started_before, fake.asked, fake.pushed

    mute, waiting, readyz, started_before, asked, pushed = asyncio.run(run())
    if not wait_s:  # the bug: LMCache's one RegisterMsg met no controller
        assert mute and started_before and waiting is None and pushed == []
        return
    assert not mute and not started_before and waiting == f"127.0.0.1:{ports['reply']}"
    assert readyz == {"status": "starting", "reason": f"waiting for the KV controller at {waiting}"}
    assert asked[0] == w.BatchedP2PLookupMsg([], "sim-0~0123456789ab", 0)
    kinds = [type(m) for m in asked if not isinstance(m, w.HeartbeatMsg)]
    # the probe (twice when an attempt's answer came as that attempt gave up), then one
    # registration: LMCache's, answered
    assert set(kinds[:-1]) == {w.BatchedP2PLookupMsg} and kinds[-1] is w.RegisterMsg


def test_the_wait_for_a_controller_is_bounded_and_names_the_fix() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ControllerUnreachableError) as err:
        wait_for_controller(f"127.0.0.1:{port}", "i", timeout_s=0.5, attempt_s=0.2)
    assert 0.5 <= time.monotonic() - t0 < 3.0
    assert f"127.0.0.1:{port}" in str(err.value) and "KVPOOL_WORKER_CONTROLLER_WAIT_S" in str(
        err.value
    )
    assert wait_for_controller(f"127.0.0.1:{port}", "i", timeout_s=0) == 0.0  # 0: no wait
    # what the reference engine and vLLM run before LMCache's engine: the config decides
    config = {"enable_controller": True, "controller_reply_url": f"127.0.0.1:{port}"}
    with pytest.raises(ControllerUnreachableError):
        await_lmcache_controller(config, WorkerSettings(controller_wait_s=0.3))
    t0 = time.monotonic()
    await_lmcache_controller({**config, "enable_controller": False}, WorkerSettings())
    assert time.monotonic() - t0 < 0.1  # no controller configured: no wait


def test_full_sync_freezes_sends_cpu_keys_lru_first_and_resends_missing(
    make_sim_engine: Make,
) -> None:
    polls: list[int] = []

    def script(fake: FakeController) -> Answer:
        beats: list[int] = []

        def answer(msg: Any) -> Any:
            if isinstance(msg, w.HeartbeatMsg):
                beats.append(1)
                command = [w.FullSyncCommand(reason="worker_re_registered")]
                return w.HeartbeatRetMsg(command if len(beats) == 3 else [])
            if isinstance(msg, w.FullSyncStartMsg):
                return w.FullSyncStartRetMsg(msg.sync_id, accepted=True)
            if isinstance(msg, w.FullSyncStatusMsg):
                polls.append(1)
                done = len(polls) >= 2
                return w.FullSyncStatusRetMsg(msg.sync_id, done, 1.0, done, [] if done else [0])
            return accept(fake)(msg)

        return answer

    async def run() -> tuple[FakeController, float, dict[str, float], list[int]]:
        fake = FakeController(lambda m: None)
        fake.answer = script(fake)
        eng = make_sim_engine()
        sync = FullSyncParams(batch_size=3, startup_delay_s=0.0, poll_interval_s=0.15)
        attach(eng, fake, full_sync=sync)
        await eng.start()
        await complete(eng, "a")
        lru = eng.ddr_keys()
        await until(lambda: eng.instance.frozen)
        frozen_gauge = eng.metrics()["lmcache_frozen"]
        other = [t + 1 for t in PROMPT]  # a new prompt during the freeze: its store is dropped
        req = GenerationRequest("b", other, SamplingParams(max_tokens=1))
        assert len([e async for e in eng.generate(req)]) == 1
        await until(lambda: not eng.instance.frozen)
        m = eng.metrics()
        await eng.shutdown(0.5)
        await fake.close()
        return fake, frozen_gauge, m, lru

    fake, frozen_gauge, m, lru = asyncio.run(run())
    assert frozen_gauge == 1 and m["lmcache_frozen"] == 0
    assert m["store_skipped_frozen_tokens"] == 64  # 4 chunks (the partial one is not hashed)
    assert m["stored_chunks_total.local_cpu"] == 4  # only the first prompt's
    start = next(a for a in fake.asked if isinstance(a, w.FullSyncStartMsg))
    assert (start.total_keys, start.batch_count, start.location) == (4, 2, "LocalCPUBackend")
    batches = fake.of(w.FullSyncBatchMsg)
    assert [(b.batch_id, b.keys) for b in batches] == [(0, lru[:3]), (1, lru[3:]), (0, lru[:3])]
    assert len(fake.of(w.FullSyncEndMsg)) == 2 and m["lmcache_full_syncs_completed_total"] == 1


def test_p2p_lookup_at_arrival_extends_the_prefix(make_sim_engine: Make) -> None:
    def answer(msg: Any) -> Any:
        if isinstance(msg, w.BatchedP2PLookupMsg):
            return w.BatchedP2PLookupRetMsg([("peer~0123456789ab", "LocalCPUBackend", 3, "p:1")])
        if isinstance(msg, w.RegisterMsg):
            return w.RegisterRetMsg({})
        return None

    async def run() -> tuple[FakeController, list[Any], dict[str, float]]:
        fake = FakeController(answer)
        eng = make_sim_engine(p2p=True)
        attach(eng, fake)
        await eng.start()
        events = await complete(eng, "a")
        m = eng.metrics()
        await eng.shutdown(0.5)
        await fake.close()
        return fake, events, m

    fake, events, m = asyncio.run(run())
    lookup = next(a for a in fake.asked if isinstance(a, w.BatchedP2PLookupMsg))
    assert lookup == w.BatchedP2PLookupMsg(KEYS, "sim-0~0123456789ab", 0)
    assert events[0].num_cached_tokens == 48
    assert m["cached_tokens_total.p2p"] == 48 and m["lmcache_p2p_hit_chunks_total"] == 3
    assert fake.asked[0].peer_init_url == "127.0.0.1:1"
    assert not any(isinstance(a, w.HeartbeatMsg) for a in fake.asked)  # no heartbeat_url


@pytest.mark.parametrize("garbage", [False, True])
def test_the_rep_socket_answers_the_controllers_commands(
    make_sim_engine: Make, garbage: bool
) -> None:
    async def run() -> tuple[FakeController, list[Any]]:
        fake = FakeController(lambda m: None)
        fake.answer = accept(fake)
        eng = make_sim_engine()
        client = attach(eng, fake)
        await eng.start()
        await complete(eng, "a")
        dealer = fake.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{client.port}")
        replies = []
        clear = codec.encode(w.ClearWorkerMsg("e", "LocalCPUBackend"))
        requests = [
            codec.encode(w.CheckFinishWorkerMsg("c1")),
            b"\x01garbage" if garbage else clear,
        ]
        for payload in requests:
            await dealer.send_multipart([b"", payload])
            replies.append(codec.decode((await dealer.recv_multipart())[-1]))
        batches = fake.of
        await until(
            lambda: garbage or sum(len(b.operations) for b in batches(w.BatchedKVOperationMsg)) >= 8
        )
        dealer.close(linger=0)
        await eng.shutdown(0.5)
        await fake.close()
        return fake, replies

    fake, replies = asyncio.run(run())
    assert replies[0] == w.ErrorMsg("Unknown message: CheckFinishWorkerMsg(worker_event_id='c1')")
    if garbage:
        assert isinstance(replies[1], w.ErrorMsg) and replies[1].error.startswith("Worker error: ")
        return
    assert replies[1] == w.ClearWorkerRetMsg(num_tokens=64)
    ops = [op for b in fake.of(w.BatchedKVOperationMsg) for op in b.operations]
    assert [op.op_type for op in ops] == [w.OpType.ADMIT] * 4 + [w.OpType.EVICT] * 4
    assert [op.seq_num for op in ops] == list(range(8))
