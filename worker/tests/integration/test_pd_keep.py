"""A PD decoder with a CPU tier keeps what it decoded, the controller learns it, and a plain
request to the decoder hits it (what the gateway's PD bypass sends).

All real: a kvpool-controller, a prefill (sender) and a decode (receiver) ``kvpool-worker``
with the real LMCache 0.5.6 engine, KV moved over NIXL (UCX on 127.0.0.1). The decoder is
configured as the operator renders it when the pool's gateway enables the bypass:
``local_cpu: true`` with a CPU size, registered with the controller. Turn 1 goes through PD;
the decoder then holds turn 1's prompt and answer (whole chunks) in its CPU tier, the
controller's index lists them under the decoder, and turn 2 (turn 1 + answer + a new message)
sent to the decoder as a plain request loads them and answers exactly as a cold run does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
from transfer_stack import (
    Stack,
    cached,
    complete,
    disagg_spec,
    engine_metric,
    free_port,
    pd_config,
    proxy_notifications,
    tokens,
)


def wait_for(check: Callable[[], bool], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, f"not true within {timeout_s}s"
        time.sleep(0.2)


def keeping_decoder(init: int, alloc: int, ctl: dict[str, str]) -> dict[str, Any]:
    cfg = pd_config("pd-decode", "receiver", 0, init, alloc)
    cfg.update(
        {
            "local_cpu": True, "max_local_cpu_size": 0.25, "enable_controller": True,
            "controller_pull_url": ctl["controller_pull_url"],
            "controller_reply_url": ctl["controller_reply_url"],
            "lmcache_worker_ports": [free_port()], "lmcache_worker_heartbeat_time": 1,
            "lmcache_worker_heartbeat_delay_time": 1,
        }
    )  # fmt: skip
    return cfg


def test_decoder_keeps_a_decoded_turn_and_a_plain_request_hits_it(stack: Stack) -> None:
    ctl = stack.controller(ttl_s=10.0)
    proxy_port, init, alloc = free_port(), free_port(), free_port()
    with proxy_notifications(proxy_port) as notifications:
        decode = stack.worker("pd-decode", keeping_decoder(init, alloc, ctl), wait=False)
        prefill = stack.worker(
            "pd-prefill", pd_config("pd-prefill", "sender", proxy_port, 0, 0), wait=False
        )
        stack.wait_ready("pd-decode", decode)
        stack.wait_ready("pd-prefill", prefill)
        info = httpx.get(f"{decode}/pd/info").json()

        # Turn 1 through PD: 600 prompt tokens, the prefill's first token, 9 decoded.
        turn1 = tokens(600, seed=11)
        req_id = uuid.uuid4().hex
        first = complete(
            prefill,
            turn1,
            1,
            kv_transfer_params={"ret_first_tok": True, "disagg_spec": disagg_spec(info, req_id)},
            return_token_ids=True,
        )
        first_tok = int(first["kv_transfer_params"]["first_tok"])
        assert msgspec.msgpack.decode(notifications.recv())["req_id"] == req_id
        rest = complete(decode, [*turn1, first_tok], 9, return_token_ids=True)
        assert cached(rest) == 600, "the decoder must use the transferred prompt"
        answer = [first_tok, *(int(t) for t in rest["choices"][0]["token_ids"])]

        # The decoder kept the whole chunks of prompt + answer (its finished request: 609
        # tokens computed, 2 whole chunks) and the controller indexes them under it.
        assert engine_metric(decode, "pd_kept_tokens") == 512
        http = httpx.Client(base_url=ctl["http"], timeout=5)

        def indexed() -> bool:
            layout = http.post("/lookup", json={"tokens": turn1}).json().get("layout_info", {})
            return any(k.startswith("pd-decode") and v[1] == 512 for k, v in layout.items())

        wait_for(indexed, 15)

        # Turn 2: turn 1, its answer and a new message. The cold reference is the prefill
        # instance (a sender stores nothing without a transfer: every request there is cold).
        turn2 = [*turn1, *answer, *tokens(150, seed=12)]
        cold = complete(prefill, turn2, 8)
        assert cached(cold) == 0
        plain = complete(decode, turn2, 8)
        assert cached(plain) == 512, "a plain request to the decoder hits what it kept"
        assert plain["choices"][0]["text"] == cold["choices"][0]["text"]
        # A PD transfer to the same decoder still works beside the kept chunks.
        req_id = uuid.uuid4().hex
        spec = disagg_spec(info, req_id)
        prompt3 = tokens(300, seed=13)
        first = complete(
            prefill, prompt3, 1, kv_transfer_params={"ret_first_tok": True, "disagg_spec": spec}
        )
        assert msgspec.msgpack.decode(notifications.recv())["req_id"] == req_id
        tok = int(first["kv_transfer_params"]["first_tok"])
        assert cached(complete(decode, [*prompt3, tok], 3)) == 300
