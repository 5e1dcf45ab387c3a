"""The simulated engine as real processes against a real ``kvpool-controller``.

``kvpool-worker serve --engine sim`` processes (and one ``kvpool-worker host`` process serving
three instances) with operator-shaped LMCache configs and environments, all on 127.0.0.1. The
controller must not be able to tell them from real workers: it registers them, its index holds
exactly the chunks in their DDR tier under the LMCache chunk hashes of the prompt ids they
return from ``/tokenize`` (computed here with kvpool.protocol.hashing), evictions under a small
DDR reach it, a repeated prompt reports cached tokens, its P2P lookup serves one sim's prefix to
another, a restarted controller gets every key back by full sync, a worker of another domain is
refused (and not ready), and SIGTERM deregisters. A ``kvpool-gateway`` process in front of two
sims routes on its index replica exactly as in front of real workers. The sims run 20x faster
than the profile's hardware (``--sim-speedup 20``) so the test stays short.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from transfer_stack import BIN, FINGERPRINT, Stack, cached, fingerprint, free_port, worker_env

from kvpool.protocol.hashing import HashConfig, chunk_hashes

pytestmark = pytest.mark.timeout(300)  # each test; a loaded 2-core box needs about a minute

HASHING = HashConfig(chunk_size=256)  # the reference engine's regime: LMCache without vLLM
# The pool's model (1 KiB of KV per token: a chunk is 256 KiB), timed by the H100 profile.
SIM_FLAGS = [
    "--engine", "sim", "--sim-profile", "h100-llama-3.1-8b-vllm", "--sim-speedup", "20",
    "--model", "kvpool/reference-tiny", "--block-size", "16", "--kv-dtype", "float32",
    "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64", "--max-model-len", "4096",
]  # fmt: skip
FOUR_CHUNKS_GB = 0.001  # int(0.001 GiB) // 256 KiB = 4 chunks of DDR


def plain_env() -> dict[str, str]:
    """This process's environment without any LMCache or kvpool variable."""
    drop = ("LMCACHE_", "KVPOOL_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def controller(stack: Stack, ports: dict[str, int] | None = None) -> dict[str, Any]:
    """kvpool-controller (full-sync recovery, 4 s heartbeat TTL); the same ports on restart."""
    roles = ("http", "pull", "reply", "heartbeat", "pub", "snapshot")
    ports = ports or {role: free_port() for role in roles}
    zmq_ports = {k: ports[k] for k in ("pull", "reply", "heartbeat")}
    argv = [
        str(BIN / "kvpool-controller"), "--host", "127.0.0.1", "--port", str(ports["http"]),
        "--monitor-ports", json.dumps(zmq_ports), "--advertise-host", "127.0.0.1",
        "--fingerprint", FINGERPRINT, "--lmcache-worker-timeout", "4",
        "--health-check-interval", "1", "--pub-port", str(ports["pub"]),
        "--snapshot-port", str(ports["snapshot"]), "--chunk-size", "256",
    ]  # fmt: skip
    proc = stack._spawn("controller", argv, {**plain_env(), "PYTHONHASHSEED": "42"})
    url = f"http://127.0.0.1:{ports['http']}"
    stack._wait_http(proc, f"{url}/readyz", "controller")
    return {"ports": ports, "http": url}


def sim_config(name: str, ctl: dict[str, Any], seed: str = "42", **over: Any) -> dict[str, Any]:
    ports = ctl["ports"]
    config = {
        "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.5,
        "lmcache_instance_id": f"{name}~{fingerprint(seed)}", "enable_controller": True,
        "controller_pull_url": f"127.0.0.1:{ports['pull']}",
        "controller_reply_url": f"127.0.0.1:{ports['reply']}",
        "lmcache_worker_ports": [free_port()], "lmcache_worker_heartbeat_time": 0.5,
        "lmcache_worker_heartbeat_delay_time": 0.5, "pre_caching_hash_algorithm": "builtin",
        "extra_config": {"worker_socket_recv_timeout_ms": 3000, "full_sync_startup_delay_s": 0,
                         "full_sync_status_poll_interval_s": 0.2},
    }  # fmt: skip
    return {**config, **over}


def p2p(**over: Any) -> dict[str, Any]:
    return {"enable_p2p": True, "enable_async_loading": True, "p2p_host": "127.0.0.1",
            "p2p_init_ports": [free_port()], "p2p_lookup_ports": [free_port()], **over}  # fmt: skip


def write_config(stack: Stack, name: str, config: dict[str, Any]) -> Path:
    path = stack.tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def sim(
    stack: Stack, name: str, config: dict[str, Any], seed: str = "42", wait: bool = True
) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "kvpool.worker.cli", "serve", *SIM_FLAGS,
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc = stack._spawn(name, argv, worker_env(write_config(stack, name, config), seed))
    url = f"http://127.0.0.1:{port}"
    if wait:
        stack._wait_http(proc, f"{url}/readyz", name)
    return url


def wait_for(what: str, fn: Any, timeout_s: float = 20.0) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout_s}s (last: {value!r})")
        time.sleep(0.1)


def tokens_of(url: str, text: str, n: int = 600) -> list[int]:
    """The worker's own token ids of ``text`` (``/tokenize``), its first ``n``: 2 full chunks."""
    r = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=10)
    ids: list[int] = r.json()["tokens"]
    assert len(ids) >= n
    return ids[:n]


def prompt_text(seed: int, n_words: int = 400) -> str:
    words = ["alpha", "river", "stone", "quiet", "amber", "north", "glass", "ember", "lunar"]
    return " ".join(f"{words[(seed * 7 + i * 3) % len(words)]}{(seed * 31 + i) % 97}"
                    for i in range(n_words))  # fmt: skip


def complete(url: str, ids: list[int], n: int = 4) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": n, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert out["usage"]["completion_tokens"] == n and out["choices"][0]["finish_reason"] == "length"
    return out


def hits(ctl: dict[str, Any], hashes: list[int]) -> dict[str, int]:
    body = httpx.post(f"{ctl['http']}/v1/prefix_lookup", json={"hashes": hashes}, timeout=5).json()
    return {inst.split("~")[0]: v["hit_chunks"] for inst, v in body["instances"].items()}


def workers(ctl: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(f"{ctl['http']}/query_worker_info", json={"instance_id": "all"}, timeout=5)
    infos: list[dict[str, Any]] = r.json()["worker_infos"]
    return infos


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        head = line.split(" ")[0]
        if head == name or head.startswith(name + "{"):
            total += float(line.split()[-1])
    return total


def test_the_index_holds_exactly_the_sims_ddr_chunks_and_evictions_reach_it(stack: Stack) -> None:
    ctl = controller(stack)
    other = sim(stack, "other", sim_config("other", ctl, seed="7"), seed="7", wait=False)
    config = sim_config("a", ctl, max_local_cpu_size=FOUR_CHUNKS_GB)
    a = sim(stack, "a", config)
    (info,) = workers(ctl)
    assert (info["instance_id"], info["worker_id"]) == (f"a~{FINGERPRINT}", 0)
    assert (info["ip"], info["port"]) == ("127.0.0.1", config["lmcache_worker_ports"][0])

    prompts = [tokens_of(a, prompt_text(i)) for i in range(3)]
    keys = [chunk_hashes(ids, HASHING) for ids in prompts]
    assert all(len(k) == 2 for k in keys), [len(p) for p in prompts]  # 2 full chunks each
    assert cached(complete(a, prompts[0])) == 0
    wait_for("the first prompt indexed", lambda: hits(ctl, keys[0]) == {"a": 2})
    assert cached(complete(a, prompts[0])) == 512  # a repeat hits (the device prefix cache)
    for ids in prompts[1:]:
        assert cached(complete(a, ids)) == 0
    # DDR holds 4 chunks: the first prompt's two were evicted, and the controller knows it.
    wait_for("evictions indexed", lambda: [hits(ctl, k) for k in keys] == [{}, {"a": 2}, {"a": 2}])
    stats = httpx.get(f"{a}/memory/stats", timeout=5).json()["engine"]["tiers"]["local_cpu"]
    assert (stats["chunks"], stats["capacity_chunks"]) == (4, 4)
    lookup = httpx.post(f"{ctl['http']}/v1/prefix_lookup", json={"hashes": keys[2]}).json()
    assert lookup["instances"][f"a~{FINGERPRINT}"]["per_location"] == {"LocalCPUBackend": 2}
    assert metric(a, "kvpool_engine_evicted_chunks_total") == 2
    assert metric(a, "kvpool_engine_lmcache_kv_ops_sent_total") == 8  # 6 admits, 2 evicts

    # A worker of another cache domain is refused by the controller, and says so.
    ready = wait_for(
        "the refusal", lambda: (r := httpx.get(f"{other}/readyz", timeout=5)).status_code == 503
        and r.json().get("status") == "refused" and r.json()
    )  # fmt: skip
    assert "fingerprint" in ready["reason"]
    assert httpx.post(f"{other}/v1/completions", json={"prompt": "x"}).json()["error"][
        "code"
    ] == "refused"  # fmt: skip

    # SIGTERM: drained, deregistered (the controller drops its chunks at once).
    stack.procs["a"].send_signal(signal.SIGTERM)
    assert stack.procs["a"].wait(15) == 0
    wait_for("deregistration", lambda: not workers(ctl) and hits(ctl, keys[2]) == {})


def test_p2p_lookup_and_full_sync_after_a_controller_restart(stack: Stack) -> None:
    ctl = controller(stack)
    b1 = sim(stack, "b1", sim_config("b1", ctl, **p2p()))
    b2 = sim(stack, "b2", sim_config("b2", ctl, **p2p()))
    ids = tokens_of(b1, prompt_text(11))
    keys = chunk_hashes(ids, HASHING)
    assert cached(complete(b1, ids)) == 0
    wait_for("b1 indexed", lambda: hits(ctl, keys) == {"b1": 2})
    # b2 never saw the prompt: the controller's P2P lookup offers b1's two chunks.
    assert cached(complete(b2, ids)) == 512
    assert metric(b2, "kvpool_engine_cached_tokens_total") == 512
    assert metric(b2, 'kvpool_engine_cached_tokens_total{tier="p2p"}') == 512
    assert metric(b2, "kvpool_engine_lmcache_p2p_hit_chunks_total") == 2

    # The controller dies and comes back empty on the same ports: the heartbeats re-register
    # both workers and their full syncs restore the index.
    stack.kill("controller")
    controller(stack, ctl["ports"])
    wait_for("the index restored by full sync", lambda: hits(ctl, keys) == {"b1": 2})
    synced = 'kvpool_controller_full_syncs_total{outcome="completed"}'
    wait_for("both syncs completed", lambda: metric(ctl["http"], synced) == 2)
    wait_for(
        "b1's sync completed",
        lambda: metric(b1, "kvpool_engine_lmcache_full_syncs_completed_total") >= 1,
    )
    assert metric(b1, "kvpool_engine_lmcache_frozen") == 0
    assert len(workers(ctl)) == 2


def test_a_host_process_serves_several_sim_instances(stack: Stack) -> None:
    ctl = controller(stack)
    entries, urls = [], []
    for i in range(3):
        name = f"h{i}"
        port = free_port()
        path = write_config(stack, name, sim_config(name, ctl))
        argv = ["kvpool-worker", "serve", *SIM_FLAGS, "--host", "127.0.0.1", "--port", str(port)]
        entries.append({"argv": argv, "env": worker_env(path)})
        urls.append(f"http://127.0.0.1:{port}")
    file = stack.tmp / "instances.json"
    file.write_text(json.dumps(entries))
    argv = [sys.executable, "-m", "kvpool.worker.cli", "host", "--instances", str(file)]
    host = stack._spawn("host", argv, plain_env())  # each instance has its own env in the file
    for i, url in enumerate(urls):
        stack._wait_http(host, f"{url}/readyz", f"host instance {i}")
    assert sorted(w["instance_id"].split("~")[0] for w in workers(ctl)) == ["h0", "h1", "h2"]
    for i, url in enumerate(urls):
        ids = tokens_of(url, prompt_text(20 + i))
        complete(url, ids)
        keys = chunk_hashes(ids, HASHING)
        wait_for(f"h{i} indexed", lambda k=keys, n=f"h{i}": hits(ctl, k) == {n: 2})
        assert httpx.get(f"{url}/get_server_info").json()["instance_id"] == f"h{i}"
    host.send_signal(signal.SIGTERM)
    assert host.wait(20) == 0
    wait_for("every hosted instance deregistered", lambda: not workers(ctl))


def test_the_gateway_routes_on_sims_as_on_real_workers(stack: Stack) -> None:
    """The gateway's index replica follows the controller's delta stream of the sims' admits:
    a prompt one sim computed is routed to that sim (kv-hit, its chunks predicted)."""
    ctl = controller(stack)
    urls = {name: sim(stack, name, sim_config(name, ctl)) for name in ("s0", "s1")}
    ports = ctl["ports"]
    gateway_yaml = {
        "model": "kvpool/reference-tiny", "chunkSize": 256, "controllerUrl": ctl["http"],
        "controllerPubUrl": f"tcp://127.0.0.1:{ports['pub']}",
        "controllerSnapshotUrl": f"tcp://127.0.0.1:{ports['snapshot']}",
        "p2pGroups": [{"name": "g", "instances": [{"name": n, "url": u} for n, u in urls.items()]}],
        "limits": {"healthIntervalSeconds": 0.5}, "tokenizer": "reference",
    }  # fmt: skip
    path = stack.tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(gateway_yaml))
    port = free_port()
    argv = [str(BIN / "kvpool-gateway"), "serve", "--config", str(path), "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    gw = f"http://127.0.0.1:{port}"
    stack._wait_http(stack._spawn("gateway", argv, {**plain_env(), "PYTHONHASHSEED": "42"}),
                     f"{gw}/readyz", "gateway")  # fmt: skip
    wait_for("the replica in sync", lambda: httpx.get(f"{gw}/readyz").json()["status"] == "ready")
    ids = tokens_of(urls["s1"], prompt_text(30))
    keys = chunk_hashes(ids, HASHING)
    complete(urls["s1"], ids)  # s1 computes it, not the gateway's first choice
    wait_for("s1 indexed", lambda: hits(ctl, keys) == {"s1": 2})
    time.sleep(0.5)  # the delta reaches the replica
    r = httpx.post(f"{gw}/v1/completions", json={"prompt": ids, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvpool-instance"] == "s1"
    assert r.headers["x-kvpool-route-reason"] == "kv-hit"
    assert r.headers["x-kvpool-predicted-hit-tokens"] == "512"
    assert cached(r.json()) == 512
