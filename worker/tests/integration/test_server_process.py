"""``kvpool-worker`` as a real process: serve, stream, drain on SIGTERM, exit within the
deadline even when shutdown hangs, and refuse to start on a broken contract.

Everything runs for real (the CLI, uvicorn, the reference engine, signals) except in
``test_exits_within_deadline_when_shutdown_hangs``: there the engine's shutdown is replaced
by one that blocks the event loop and leaves a non-daemon thread behind, which is what
LMCache 0.5.6's close can do with a Redis tier and cannot be provoked on demand here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.protocol.domain import DomainFacts, domain_fingerprint

CLI = [sys.executable, "-m", "kvpool.worker.cli"]
READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVPOOL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_ready(proc: subprocess.Popen[str], url: str) -> None:
    end = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"worker exited with {proc.returncode} before ready:\n{out}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail("worker not ready in time")


@pytest.fixture
def launch() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def start(
    procs: list[subprocess.Popen[str]], argv: list[str], env: dict[str, str]
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    procs.append(proc)
    return proc


def serve_args(port: int, *extra: str) -> list[str]:
    return [
        "serve",
        "--engine",
        "reference",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "256",
        *extra,
    ]


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def data_lines(lines: list[str]) -> list[str]:
    return [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]


def lmcache_domain(tmp_path: Path) -> dict[str, str]:
    """A consistent cache domain for the default reference model: config, env, fingerprint."""
    facts = DomainFacts(16, 256, "builtin", "42", "float32", "kvpool/reference-tiny")
    fp = domain_fingerprint(facts)
    config = tmp_path / "lmcache.yaml"
    config.write_text(
        f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.5\n"
        f"lmcache_instance_id: ref-0~{fp}\n"
    )
    return contract_env(tmp_path, LMCACHE_CONFIG_FILE=str(config), KVPOOL_DOMAIN_FINGERPRINT=fp)


def test_streams_chat_and_drains_on_sigterm(
    launch: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    """The whole worker: contract checked, LMCache (local CPU) built from the rendered config,
    KV reused over HTTP, a streamed chat, an abandoned stream aborted, SIGTERM drained."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(
        launch,
        [*CLI, *serve_args(port, "--drain-timeout", "60", "--shutdown-deadline", "90")],
        lmcache_domain(tmp_path),
    )
    wait_ready(proc, url)
    with httpx.Client(base_url=url, timeout=60) as client:
        # The same ~300-token prompt twice: the second prefill loads a chunk from LMCache.
        prompt = {
            "prompt": "The old river keeps its stones. " * 45,
            "max_tokens": 3,
            "temperature": 0,
        }
        miss, hit = (client.post("/v1/completions", json=prompt).json() for _ in range(2))
        assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        assert hit["choices"][0]["text"] == miss["choices"][0]["text"]

        # A streamed chat completion end to end over HTTP.
        chat = {
            "messages": [{"role": "user", "content": "Hello, who keeps the old river?"}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
        }
        with client.stream("POST", "/v1/chat/completions", json=chat) as resp:
            assert resp.status_code == 200
            payloads = data_lines(list(resp.iter_lines()))
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")

        # A client that goes away mid-stream: the engine aborts its request (frees its KV).
        long = {"prompt": "An endless tale", "max_tokens": 500, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=long) as resp:
            next(ln for ln in resp.iter_lines() if ln.startswith("data: "))
        end = time.monotonic() + 30
        while metric(client, "kvpool_engine_requests_aborted_total") < 1:
            assert time.monotonic() < end, "the abandoned request was never aborted"
            time.sleep(0.2)
        assert metric(client, "kvpool_engine_requests_running") == 0

        # SIGTERM while a request streams: it completes, newcomers are turned away.
        # 150 tokens (EOS ignored) keep it in flight well past the checks below.
        req = {
            "prompt": "The long story",
            "max_tokens": 150,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        with client.stream("POST", "/v1/completions", json=req) as resp:
            lines = resp.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            with httpx.Client(base_url=url, timeout=10) as other:
                while other.get("/readyz").json() != {"status": "draining"}:
                    assert time.monotonic() - signalled < 10, "readiness never turned false"
                    time.sleep(0.02)
                refused = other.post("/v1/completions", json={"prompt": "x"})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "draining"
            rest = data_lines(list(lines))
    assert rest[-1] == "[DONE]"
    events = [json.loads(p) for p in [first[len("data: ") :], *rest[:-1]]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # drained to the end
    assert proc.wait(timeout=60) == 0
    assert time.monotonic() - signalled < 90
    out = proc.stdout.read() if proc.stdout else ""
    assert "drained: no request in flight" in out
    assert "Traceback" not in out


HANGING = textwrap.dedent(
    """
    import sys, threading, time
    from kvpool.worker import cli
    from kvpool.worker.engine import ReferenceEngine

    async def hang(self, deadline_s):
        # Like LMCache's close with a Redis tier: a non-daemon thread and a blocked loop.
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
        time.sleep(3600)

    ReferenceEngine.shutdown = hang
    sys.exit(cli.main(sys.argv[1:]))
    """
)


def test_exits_within_deadline_when_shutdown_hangs(
    launch: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    script = tmp_path / "hanging_worker.py"
    script.write_text(HANGING)
    port = free_port()
    argv = [
        sys.executable,
        str(script),
        *serve_args(port, "--drain-timeout", "1", "--shutdown-deadline", "3"),
    ]
    proc = start(launch, argv, base_env())
    wait_ready(proc, f"http://127.0.0.1:{port}")
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code = proc.wait(timeout=30)
    elapsed = time.monotonic() - signalled
    assert code == 3  # the watchdog's exit code
    assert elapsed < 3 + 2.0, elapsed
    out = proc.stdout.read() if proc.stdout else ""
    assert "shutdown deadline of 3.0s passed" in out


def contract_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    env = base_env()
    env.update(
        LMCACHE_TRACK_USAGE="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
        PYTHONHASHSEED="42",
    )
    env.update(overrides)
    return env


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_refuses_a_broken_contract_naming_each_problem(tmp_path: Path) -> None:
    env = contract_env(
        tmp_path,
        LMCACHE_TRACK_USAGE="False",
        LMCACHE_CONFIG_FILE=str(tmp_path / "missing.yaml"),
    )
    env.pop("VLLM_WORKER_MULTIPROC_METHOD")
    result = run_cli(serve_args(free_port()), env)
    assert result.returncode == 2
    for name in ["LMCACHE_TRACK_USAGE", "VLLM_WORKER_MULTIPROC_METHOD", "LMCACHE_CONFIG_FILE"]:
        assert name in result.stderr
    assert "Fix:" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_vllm_command_for_a_consistent_domain_and_refusal_otherwise(tmp_path: Path) -> None:
    facts = ["--model", "Qwen/Qwen3-8B", "--block-size", "128", "--kv-dtype", "bfloat16"]
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\n")
    env = contract_env(tmp_path, LMCACHE_CONFIG_FILE=str(config))
    fp = run_cli(["fingerprint", *facts, "--config", str(config)], env).stdout.strip()
    assert len(fp) == 12
    config.write_text(f"chunk_size: 256\nlmcache_instance_id: qwen-0~{fp}\n")
    env["KVPOOL_DOMAIN_FINGERPRINT"] = fp
    serve = ["serve", "--engine", "vllm", "--platform", "ascend", "--print-command", *facts]
    result = run_cli(serve, env)
    assert result.returncode == 0, result.stderr
    assert "LMCacheAscendConnectorV1Dynamic" in result.stdout
    assert "--block-size 128" in result.stdout
    # The same worker with another block size belongs to another domain: refused.
    other = run_cli(
        [*serve[:-6], "--model", "Qwen/Qwen3-8B", "--block-size", "16", "--kv-dtype", "bfloat16"],
        env,
    )
    assert other.returncode == 2
    assert "KVPOOL_DOMAIN_FINGERPRINT" in other.stderr and "lmcache_instance_id" in other.stderr
    assert "Traceback" not in other.stderr
    # TP 2 on a pod that was given one NPU: refused before vLLM could hang on it.
    few = run_cli(
        [*serve, "--tensor-parallel-size", "2"], {**env, "ASCEND_RT_VISIBLE_DEVICES": "0"}
    )
    assert few.returncode == 2 and "ASCEND_RT_VISIBLE_DEVICES" in few.stderr


def test_invalid_flag_value_is_refused(tmp_path: Path) -> None:
    result = run_cli(serve_args(70000), base_env())
    assert result.returncode == 2
    assert "port" in result.stderr and "Traceback" not in result.stderr


def test_vllm_on_the_cpu_platform_is_refused_with_the_fix(tmp_path: Path) -> None:
    """The operator renders --platform cpu for reference-engine pods; vLLM cannot run there."""
    args = ["serve", "--engine", "vllm", "--platform", "cpu", "--print-command"]
    result = run_cli(args, contract_env(tmp_path))
    assert result.returncode == 2
    assert "--engine reference" in result.stderr
    assert "Traceback" not in result.stderr
