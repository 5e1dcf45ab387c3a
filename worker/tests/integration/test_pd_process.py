"""PD between a prefill and a decode ``kvpool-worker`` process through LMCache 0.5.6's PD
backend over NIXL (push: the sender writes into buffers the receiver allocated).

All real: two reference workers with the real LMCache engine and NIXL over UCX on 127.0.0.1.
The test plays the gateway's PD proxy exactly as the worker's HTTP contract says (README,
"PD"): it binds the ZMQ PULL that LMCache's sender notifies, sends the prefill with
``kv_transfer_params.disagg_spec``, waits for ``ProxyNotif(req_id)`` and only then sends the
decode (the prompt plus ``first_tok``). The decoded tokens equal one instance's, also for a
prompt shorter than one chunk. On SIGTERM both exit promptly.
"""

from __future__ import annotations

import signal
import uuid
from typing import Any

import httpx
import msgspec
import zmq
from transfer_stack import cached, complete, disagg_spec, free_port, pd_config, tokens


def test_decode_after_the_transfer_equals_a_single_instance(stack: Any) -> None:
    proxy_port, init, alloc = free_port(), free_port(), free_port()
    ctx = zmq.Context()
    notifications = ctx.socket(zmq.PULL)
    notifications.bind(f"tcp://127.0.0.1:{proxy_port}")
    notifications.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        decode = stack.worker(
            "pd-decode", pd_config("pd-decode", "receiver", 0, init, alloc), wait=False
        )
        prefill = stack.worker(
            "pd-prefill", pd_config("pd-prefill", "sender", proxy_port, 0, 0), wait=False
        )
        stack.wait_ready("pd-decode", decode)
        stack.wait_ready("pd-prefill", prefill)
        assert httpx.get(f"{decode}/health").status_code == 200  # what sglang-router probes
        info = httpx.get(f"{decode}/pd/info").json()
        assert info == {
            "enabled": True, "role": "receiver", "tp_size": 1, "receiver_host": "127.0.0.1",
            "receiver_init_port": [init], "receiver_alloc_port": [alloc],
        }  # fmt: skip
        assert httpx.get(f"{prefill}/pd/info").json()["proxy_port"] == proxy_port
        # A single instance, for reference: the decoder without a transfer prefills itself.
        # two full chunks + a partial one; shorter than one chunk; 7 full chunks + a partial
        # one, which the sender stores in 2 groups (pd.store_groups) with one ProxyNotif
        for n in (600, 90, 2000):
            prompt = tokens(n, seed=n)
            single = complete(decode, prompt, 10)
            req_id = uuid.uuid4().hex
            spec = disagg_spec(info, req_id)
            first = complete(
                prefill,
                prompt,
                1,
                kv_transfer_params={"ret_first_tok": True, "disagg_spec": spec},
                return_token_ids=True,
            )
            params = first["kv_transfer_params"]
            assert params["req_id"] == req_id and params["num_tokens"] == n
            assert params["first_tok"] == first["choices"][0]["token_ids"][0]
            notif = msgspec.msgpack.decode(notifications.recv())
            assert notif == {"type": "ProxyNotif", "req_id": req_id}
            rest = complete(decode, [*prompt, params["first_tok"]], 9, return_token_ids=True)
            assert cached(rest) == n, "the decoder must use the transferred KV of the prompt"
            text = first["choices"][0]["text"] + rest["choices"][0]["text"]
            assert text == single["choices"][0]["text"]
        # A prefill request without kv_transfer_params transfers nothing and still answers;
        # kv_transfer_params sent to the decoder is refused with the field named.
        assert complete(prefill, tokens(50, seed=7), 2)["choices"][0]["text"]
        bad = httpx.post(
            f"{decode}/v1/completions",
            json={"prompt": [5, 6], "max_tokens": 1, "kv_transfer_params": {"disagg_spec": spec}},
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "pd_not_sender"
        # SIGTERM: both exit promptly with 0 (LMCache's close no longer hangs in a zmq context
        # term: the receiver's NIXL init socket, the sender's proxy socket; README).
        for name in ("pd-decode", "pd-prefill"):
            stack.procs[name].send_signal(signal.SIGTERM)
        for name in ("pd-decode", "pd-prefill"):
            assert stack.procs[name].wait(timeout=15) == 0, stack.log(name)[-3000:]
            assert "did not close within" not in stack.log(name)
    finally:
        notifications.close(linger=0)
        ctx.term()
