"""A PD pair survives its decoder's death and restart (LMCache 0.5.6's PD backend, NIXL/UCX).

Why: in the chaos suite the prefill worker's sender kept the dead decoder's NIXL agent after the
decoder was killed and restarted (``NIXL_ERR_REMOTE_DISCONNECT`` on every later transfer, no
``ProxyNotif``, every PD request waited the proxy's whole transfer timeout), or blocked its
engine step for good on a decoder that never answered, while its ``/readyz`` stayed 200.

All real, as in test_pd_process.py: two reference workers with LMCache's PD backend; the test
plays the gateway's proxy (the ZMQ PULL the sender notifies). With the decoder killed
(SIGKILL: no goodbye), a PD prefill is answered, and with a retryable 503
``pd_transfer_failed`` carrying ``Retry-After`` instead of a 200 whose KV never lands; the
prefill stays ready and its engine serves a plain request. Restarted on the same ports, the
decoder gets the next transfer: the sender handshakes again with the new process (its new
NIXL agent), the proxy is notified, and the decode uses the transferred KV.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from transfer_stack import cached, complete, disagg_spec, free_port, pd_config, tokens

pytestmark = pytest.mark.timeout(600)


def _prefill(url: str, prompt: list[int], info: dict[str, Any]) -> tuple[str, httpx.Response]:
    req_id = uuid.uuid4().hex
    body = {
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"ret_first_tok": True, "disagg_spec": disagg_spec(info, req_id)},
    }  # fmt: skip
    # bounded: before the fix the answer came at once (and its KV never landed) or never
    return req_id, httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _transfer_and_decode(
    prefill: str, decode: str, info: dict[str, Any], notifications: Any, n: int
) -> None:
    prompt = tokens(n, seed=n)
    req_id, resp = _prefill(prefill, prompt, info)
    assert resp.status_code == 200, resp.text
    notif = msgspec.msgpack.decode(notifications.recv())
    assert notif == {"type": "ProxyNotif", "req_id": req_id}
    first = resp.json()["kv_transfer_params"]["first_tok"]
    rest = complete(decode, [*prompt, first], 4)
    assert cached(rest) == n, "the decoder must use the transferred KV"


def test_prefill_fails_fast_while_the_decoder_is_dead_and_reconnects_after_its_restart(
    stack: Any,
) -> None:
    proxy_port, init, alloc = free_port(), free_port(), free_port()
    ctx = zmq.Context()
    notifications = ctx.socket(zmq.PULL)
    notifications.bind(f"tcp://127.0.0.1:{proxy_port}")
    notifications.setsockopt(zmq.RCVTIMEO, 30_000)
    decoder = pd_config("pd-decode", "receiver", 0, init, alloc)
    try:
        decode = stack.worker("pd-decode", decoder, wait=False)
        prefill = stack.worker(
            "pd-prefill", pd_config("pd-prefill", "sender", proxy_port, 0, 0), wait=False
        )
        stack.wait_ready("pd-decode", decode)
        stack.wait_ready("pd-prefill", prefill)
        info = httpx.get(f"{decode}/pd/info").json()
        _transfer_and_decode(prefill, decode, info, notifications, 600)

        stack.kill("pd-decode")
        for n in (520, 530):  # the first finds the connection dropped, the second retries it
            _, resp = _prefill(prefill, tokens(n, seed=n), info)
            assert resp.status_code == 503, resp.text
            assert resp.headers.get("retry-after") == "1"
            assert resp.json()["error"]["code"] == "pd_transfer_failed", resp.text
        assert httpx.get(f"{prefill}/readyz").status_code == 200
        assert complete(prefill, tokens(40, seed=3), 2)["choices"][0]["text"]  # not stuck

        decode = stack.worker("pd-decode-2", decoder)  # the same PD ports, a new process
        for n in (700, 610):
            _transfer_and_decode(prefill, decode, info, notifications, n)
        log = stack.log("pd-prefill")
        assert "reconnected to decoder" in log, log[-3000:]
        assert "NIXL_ERR_REMOTE_DISCONNECT" not in log.split("reconnected to decoder")[-1]
    finally:
        notifications.close(linger=0)
        ctx.term()
