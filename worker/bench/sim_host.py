"""What a fleet of simulated workers costs on this box: ``kvpool-worker host`` with N instances.

Why this module exists: the fleet benchmark (issue 14) runs 16 to 64 simulated instances on a
2-core box next to the routers under test; the sims' own start time, memory and idle CPU, and
the time each request and each token costs the worker (not the model), bound what that
benchmark can measure. Everything is real: kvpool-controller, one ``kvpool-worker host``
process serving N instances rendered like the operator renders them (LMCache config with the
controller, 10 s heartbeats, 1 GB of DDR; Llama-3.1-8B's KV shape on the H100 profile), all on
127.0.0.1, stopped at the end.

- start: spawn to every instance's ``/readyz`` 200 (all registered with the controller);
- RSS of the host process, and its CPU while idle (heartbeats and timers only);
- overhead: sequential non-streamed completions of a 600-token prompt with ``max_tokens`` 1 and
  64 at ``--speedup`` (run it with a large speedup, e.g. 1000, so the model's own time is
  negligible): the wall latency per request and per extra token is the worker's (and this
  client's) cost.

    python worker/bench/sim_host.py --instances 64 --idle-s 30 --out bench-results/sim-host.json
    python worker/bench/sim_host.py --instances 1 --speedup 1000 --requests 200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvpool.protocol.domain import DomainFacts, domain_fingerprint

BIN = Path(sys.executable).parent
MODEL = ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--block-size", "16",
         "--kv-dtype", "bfloat16", "--num-layers", "32", "--num-kv-heads", "8",
         "--head-dim", "128", "--max-model-len", "8704"]  # fmt: skip
SEED = "42"
FP = domain_fingerprint(
    DomainFacts(16, 256, "builtin", SEED, "bfloat16", "meta-llama/Llama-3.1-8B-Instruct")
)


_TAKEN: set[int] = set()


def free_port() -> int:
    """A free 127.0.0.1 port not handed out before in this run (hundreds are needed)."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout_s}s")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def latency_ms(url: str, ids: list[int], max_tokens: int, n: int) -> float:
    """Median wall milliseconds of ``n`` sequential non-streamed completions."""
    out = []
    with httpx.Client(timeout=60) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": max_tokens})
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--out", default="bench-results/sim-host.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sim-host-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVPOOL_"))}
    http, pull, reply, beat = (free_port() for _ in range(4))
    ports = json.dumps({"pull": pull, "reply": reply, "heartbeat": beat})
    ctl_argv = [str(BIN / "kvpool-controller"), "--host", "127.0.0.1", "--port", str(http),
                "--monitor-ports", ports, "--advertise-host", "127.0.0.1", "--fingerprint", FP,
                "--health-check-interval", "10", "--lmcache-worker-timeout", "60"]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        log = (tmp / "controller.log").open("wb")
        procs.append(subprocess.Popen(ctl_argv, stdout=log, stderr=subprocess.STDOUT, env=env))
        wait_http(f"http://127.0.0.1:{http}/readyz", procs[0])
        entries, urls = [], []
        for i in range(args.instances):
            config = tmp / f"sim-{i}.yaml"
            config.write_text(
                f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1.0\n"
                f"lmcache_instance_id: sim-{i}~{FP}\nenable_controller: true\n"
                f"controller_pull_url: 127.0.0.1:{pull}\ncontroller_reply_url: 127.0.0.1:{reply}\n"
                f"lmcache_worker_ports: [{free_port()}]\nlmcache_worker_heartbeat_time: 10\n"
                "pre_caching_hash_algorithm: builtin\n"
                "extra_config:\n  worker_socket_recv_timeout_ms: 3000\n"
            )
            port = free_port()
            argv = ["kvpool-worker", "serve", "--engine", "sim", "--sim-profile",
                    "h100-llama-3.1-8b-vllm", "--sim-speedup", str(args.speedup), *MODEL,
                    "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
            instance_env = {
                "PYTHONHASHSEED": SEED, "LMCACHE_TRACK_USAGE": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                "LMCACHE_CONFIG_FILE": str(config), "KVPOOL_DOMAIN_FINGERPRINT": FP,
                "POD_IP": "127.0.0.1",
            }  # fmt: skip
            entries.append({"argv": argv, "env": instance_env})
            urls.append(f"http://127.0.0.1:{port}")
        (tmp / "instances.json").write_text(json.dumps(entries))
        host_argv = [str(BIN / "kvpool-worker"), "host", "--instances",
                     str(tmp / "instances.json"), "--log-level", "warning"]  # fmt: skip
        t0 = time.monotonic()
        log = (tmp / "host.log").open("wb")
        host = subprocess.Popen(host_argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(host)
        for url in urls:
            wait_http(f"{url}/readyz", host)
        start_s = time.monotonic() - t0
        r = httpx.post(f"http://127.0.0.1:{http}/query_worker_info", json={"instance_id": "all"})
        registered = len(r.json()["worker_infos"])
        rss_ready = rss_mib(host.pid)
        time.sleep(min(5.0, args.idle_s))  # let the first heartbeats pass
        c0, w0 = cpu_seconds(host.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_cpu = (cpu_seconds(host.pid) - c0) / (time.monotonic() - w0)
        ids = httpx.post(f"{urls[0]}/tokenize", json={"prompt": "kv " * 700}).json()["tokens"][:600]
        one = latency_ms(urls[0], ids, 1, args.requests)
        many = latency_ms(urls[0], ids, 64, args.requests)
        metrics = {
            "instances": args.instances,
            "registered": registered,
            "start_s": round(start_s, 2),
            "rss_mib": round(rss_ready, 1),
            "rss_mib_per_instance": round(rss_ready / args.instances, 2),
            "idle_cpu_fraction_of_one_core": round(idle_cpu, 4),
            "speedup": args.speedup,
            "request_ms_max_tokens_1": round(one, 2),
            "request_ms_max_tokens_64": round(many, 2),
            "ms_per_extra_token": round((many - one) / 63, 3),
            "rss_mib_after_requests": round(rss_mib(host.pid), 1),
        }
        host.send_signal(signal.SIGTERM)
        host.wait(60)
        r = httpx.post(f"http://127.0.0.1:{http}/query_worker_info", json={"instance_id": "all"})
        metrics["registered_after_sigterm"] = len(r.json()["worker_infos"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"component": "worker-sim-host", "metrics": metrics}, indent=2))
    print("| metric | value |\n|---|---:|")
    for key, value in metrics.items():
        print(f"| {key} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
