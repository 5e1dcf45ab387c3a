"""The routers users would pick instead of kvpool's gateway, installed and started here.

Why this module exists: the fleet benchmark's claim is a ratio against real peer routers on the
same fleet, trace window and load generator (/work/shared/reference/peer-routers.md says how each
runs on these machines). Each launcher is a context manager that yields the router's URL once
it answers, and stops every process it started whatever happens:

- sglang-router 0.3.2 ``cache_aware`` (PyPI ``sglang-router``, in the project's .venv): reused
  from the gateway benchmark (``gateway/bench/domain.py``);
- vllm-router 0.1.17 ``cache_aware`` and ``kv_aware`` (PyPI ``vllm-router``, its own venv under
  ``.kvpool/peers``): ``kv_aware`` subscribes to each sim worker's vLLM KV-event publisher,
  named on its command line (``--kv-event-source URL=tcp://...``);
- NVIDIA Dynamo 1.6.1 (PyPI ``ai-dynamo`` + ``ai-dynamo-runtime``, a Python 3.10 venv): its KV
  router serves only Dynamo workers, so it runs on its own mocker fleet, configured like ours
  (instances, device blocks, block size, batch limits, the same tokenizer), in a network
  namespace that has only loopback (its event plane binds every address), and the replay runs
  inside that namespace too.

Installs are idempotent (a stamp file per venv records what was installed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
PEERS = ROOT / ".kvpool" / "peers"
VLLM_ROUTER = ("vllm-router==0.1.17",)
DYNAMO = ("ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1")
PY310 = Path("/root/.pyenv/versions/3.10.13/bin/python")
REFERENCE_TOKENIZER = ROOT / "protocol/src/kvpool/protocol/assets/reference_tokenizer"


def log(msg: str) -> None:
    print(f"[fleet-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PeerUnavailableError(RuntimeError):
    """A peer router cannot be installed or started here; the message says why."""


def ensure_venv(name: str, python: Path, packages: Sequence[str]) -> Path:
    """A venv under .kvpool/peers/NAME with ``packages`` (installed once; a stamp says what)."""
    venv = PEERS / name
    stamp = venv / ".kvpool-installed"
    want = "\n".join(packages)
    if stamp.is_file() and stamp.read_text() == want:
        return venv
    if not python.is_file():
        raise PeerUnavailableError(f"{name}: needs {python} (pyenv), which is not installed")
    log(f"installing {', '.join(packages)} into {venv} (first time: a minute or more)")
    if not (venv / "bin" / "python").is_file():
        subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    done = subprocess.run([*pip, *packages], capture_output=True, text=True, check=False)
    if done.returncode:
        raise PeerUnavailableError(f"{name}: pip install failed:\n{done.stderr[-2000:]}")
    stamp.write_text(want)
    return venv


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 8.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _wait_http(url: str, proc: subprocess.Popen[bytes], logfile: Path, what: str,
               timeout_s: float = 90.0, ok: Sequence[int] = (200,)) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code in ok:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-15:])
            raise PeerUnavailableError(f"{what} did not answer {url}; log:\n{tail}")
        time.sleep(0.25)


# ---------------------------------------------------------------------- vllm-router
@dataclass(frozen=True)
class KvEventSource:
    """Where one sim worker publishes vLLM KV events (its PUB and replay ROUTER)."""

    worker_url: str
    endpoint: str
    replay_endpoint: str | None = None


def vllm_router_version() -> str:
    return VLLM_ROUTER[0].split("==")[1]


@contextlib.contextmanager
def vllm_router(
    worker_urls: Sequence[str],
    logdir: Path,
    policy: str,
    *,
    model: str,
    block_size: int,
    sources: Sequence[KvEventSource] = (),
) -> Iterator[str]:
    """vllm-router in front of ``worker_urls`` (``cache_aware`` or ``kv_aware``)."""
    venv = ensure_venv("vllm-router", Path(sys.executable), VLLM_ROUTER)
    port, metrics = free_port(), free_port()
    cmd = [
        str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    if policy == "kv_aware":
        if not sources:
            raise PeerUnavailableError("vllm-router kv_aware needs each worker's KV-event source")
        cmd += ["--kv-event-model", model, "--kv-event-block-size", str(block_size)]
        for s in sources:
            cmd += ["--kv-event-source", f"{s.worker_url}={s.endpoint}"]
            if s.replay_endpoint:
                cmd += ["--kv-event-replay-source", f"{s.worker_url}={s.replay_endpoint}"]
    logfile = logdir / f"vllm-router-{policy}-{port}.log"
    with logfile.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/health", proc, logfile, f"vllm-router {policy}")
        yield url
    finally:
        _stop(proc)


# ---------------------------------------------------------------------- Dynamo
@dataclass(frozen=True)
class DynamoFleet:
    """A running Dynamo mocker fleet and its frontend: the URL inside ``netns``."""

    url: str
    netns: str
    model: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the fleet's network namespace (where its URL is reachable)."""
        return ["ip", "netns", "exec", self.netns, *argv]


def dynamo_version() -> str:
    return DYNAMO[0].split("==")[1]


def _tokenizer_dir(root: Path, kv_layers: tuple[int, int, int], max_len: int) -> Path:
    """The reference tokenizer as a model directory for the mocker (its config names the
    pool's model shape; the mocker reads the tokenizer and the context length from it)."""
    out = root / "dynamo-model"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(REFERENCE_TOKENIZER / "tokenizer.json", out / "tokenizer.json")
    cfg = json.loads((REFERENCE_TOKENIZER / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = max_len
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    layers, kv_heads, head_dim = kv_layers
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": 8192,
                "hidden_size": head_dim * 32,
                "num_hidden_layers": layers,
                "num_attention_heads": 32,
                "num_key_value_heads": kv_heads,
                "max_position_embeddings": max_len,
                "torch_dtype": "bfloat16",
                "bos_token_id": 1,
                "eos_token_id": 2,
            }
        )
    )
    return out


@contextlib.contextmanager
def dynamo_fleet(
    logdir: Path,
    *,
    instances: int,
    blocks: int,
    block_size: int,
    speedup: float,
    mode: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_len: int,
    kv_shape: tuple[int, int, int] = (32, 8, 128),
) -> Iterator[DynamoFleet]:
    """``instances`` Dynamo mockers (one process) and a frontend with ``--router-mode mode``
    (``kv`` or ``round-robin``), in a private network namespace with only loopback."""
    if shutil.which("ip") is None:
        raise PeerUnavailableError("Dynamo: needs iproute2's `ip` for a loopback-only netns")
    venv = ensure_venv("dynamo", PY310, DYNAMO)
    run = logdir / f"dynamo-{mode}"
    shutil.rmtree(run, ignore_errors=True)
    (run / "kv").mkdir(parents=True)
    model_dir = _tokenizer_dir(run, kv_shape, max_len)
    netns = f"kvpool-dyn-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"], check=True)
    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        "DYN_FILE_KV": str(run / "kv"),
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        **{
            f"DYN_{k}_HOST": "127.0.0.1"
            for k in ("TCP_RPC", "TCP_RESPONSE_STREAM", "EVENT_PLANE", "SYSTEM", "HTTP_RPC")
        },
    }
    common = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    py = str(venv / "bin" / "python")
    port = 18100
    mocker = [
        "ip", "netns", "exec", netns, py, "-m", "dynamo.mocker",
        "--model-path", str(model_dir), "--model-name", "kvpool-sim",
        "--block-size", str(block_size), "--num-gpu-blocks-override", str(blocks),
        "--num-workers", str(instances), "--speedup-ratio", f"{speedup:.6g}",
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_num_batched_tokens), *common,
    ]  # fmt: skip
    frontend = [
        "ip", "netns", "exec", netns, py, "-m", "dynamo.frontend",
        "--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", mode, *common,
    ]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, cmd in (("mocker", mocker), ("frontend", frontend)):
            with (run / f"{name}.log").open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
        fleet = DynamoFleet(f"http://127.0.0.1:{port}", netns, "kvpool-sim")
        deadline = time.monotonic() + 120
        while True:
            found = subprocess.run(
                fleet.command(["curl", "-s", "-m", "2", f"{fleet.url}/v1/models"]),
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            instances_up = sum(1 for p in (run / "kv").rglob("*") if "%2Fgenerate%2F" in p.name)
            if "kvpool-sim" in found.stdout and instances_up >= instances:
                break
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                tail = (run / "mocker.log").read_text(errors="replace")[-1500:]
                raise PeerUnavailableError(f"Dynamo fleet did not come up; mocker log:\n{tail}")
            time.sleep(0.5)
        log(f"Dynamo {mode}: {instances} mockers and the frontend are up")
        yield fleet
    finally:
        for p in procs:
            _stop(p)
        subprocess.run(["ip", "netns", "delete", netns], check=False)


# ---------------------------------------------------------------------- one address, two gateways
def ensure_nginx() -> str:
    """nginx from Debian's package (installed once, its own service kept from starting)."""
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else "")
    if exe:
        return exe
    log("installing Debian's nginx (the load balancer in front of two gateway replicas)")
    policy = Path("/usr/sbin/policy-rc.d")
    had_policy = policy.exists()
    if not had_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")  # no service start during the install
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "nginx"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise PeerUnavailableError(f"{' '.join(cmd)} failed:\n{done.stderr[-1500:]}")
    finally:
        if not had_policy:
            policy.unlink(missing_ok=True)
    return "/usr/sbin/nginx"


@contextlib.contextmanager
def balancer(upstreams: Sequence[str], logdir: Path) -> Iterator[str]:
    """nginx on 127.0.0.1 spreading requests over ``upstreams`` in turn (what a Service in
    front of two gateway replicas does), keep-alive both ways, SSE not buffered."""
    exe = ensure_nginx()
    port = free_port()
    run = logdir / f"nginx-{port}"
    run.mkdir(parents=True, exist_ok=True)
    servers = "".join(f"    server {u.removeprefix('http://')};\n" for u in upstreams)
    (run / "nginx.conf").write_text(
        f"""worker_processes 1;
daemon off;
pid {run}/nginx.pid;
error_log {run}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {run}/body;
  proxy_temp_path {run}/proxy;
  fastcgi_temp_path {run}/fastcgi;
  uwsgi_temp_path {run}/uwsgi;
  scgi_temp_path {run}/scgi;
  client_max_body_size 64m;
  upstream gateways {{
{servers}    keepalive 128;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://gateways;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 900s;
    }}
  }}
}}
"""
    )
    logfile = run / "stdout.log"
    with logfile.open("wb") as out:
        proc = subprocess.Popen(
            [exe, "-p", str(run), "-c", str(run / "nginx.conf")],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/healthz", proc, run / "error.log", "nginx")
        yield url
    finally:
        _stop(proc)
