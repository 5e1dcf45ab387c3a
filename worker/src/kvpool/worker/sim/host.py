"""``kvpool-worker host --instances FILE``: many simulated workers in one process.

Why this module exists: a fleet of 16 to 64 simulated instances must run on a 2-core box, and
one Python process per instance costs a whole interpreter, FastAPI and a tokenizer each. Here
every instance is still exactly what ``kvpool-worker serve`` would run with its argv and
environment (parsed by the same parser, checked by the same contract, built by the same
``cli.build_runtime``, each from its own ``env`` mapping: nothing leaks through ``os.environ``),
but all of them share one asyncio loop, one ZMQ context, one tokenizer per tokenizer file and
one uvicorn server listening on every instance's port; a request reaches its instance's app
by the port it arrived on. Only ``--engine sim`` instances can be hosted.

FILE is JSON: a list of ``{"argv": [...], "env": {...}}``, the argv as rendered for the pod
(``["kvpool-worker", "serve", "--engine", "sim", ...]``; the program name is optional) and its
environment. SIGTERM drains every instance (each with its own ``--drain-timeout``) and exits;
an instance that fails to start stops them all (exit 1), as ``serve`` would exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpool.protocol.chat import TextTokenizer
from kvpool.worker import cli
from kvpool.worker.server import WorkerRuntime, build_app
from kvpool.worker.settings import WorkerSettings
from kvpool.worker.shutdown import EXIT_OK, GracefulShutdown, ShutdownPolicy, hard_exit

logger = logging.getLogger(__name__)

#: Long prompts whose token ids the shared tokenizer remembers (a few MB at Mooncake sizes).
HOST_ENCODE_MEMO = 64


@dataclass(frozen=True)
class Entry:
    argv: list[str]
    env: dict[str, str]


@dataclass
class Hosted:
    """One instance: its settings, runtime and bound listening socket."""

    index: int
    settings: WorkerSettings
    runtime: WorkerRuntime
    sock: socket.socket | None = None


def load_entries(text: str, source: str) -> list[Entry]:
    """Parse the instances file; StartRefusedError names the bad entry."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise cli.StartRefusedError(f"{source}: not valid JSON ({exc})") from exc
    if not isinstance(raw, list) or not raw:
        raise cli.StartRefusedError(f"{source}: must be a non-empty JSON list of instances")
    out: list[Entry] = []
    for i, item in enumerate(raw):
        argv = item.get("argv") if isinstance(item, dict) else None
        env = item.get("env", {}) if isinstance(item, dict) else None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise cli.StartRefusedError(f"{source}: [{i}].argv must be a list of strings")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise cli.StartRefusedError(f"{source}: [{i}].env must map names to strings")
        out.append(Entry(list(argv), dict(env)))
    return out


def build_instance(
    index: int, entry: Entry, tokenizers: dict[tuple[str | None, str | None], TextTokenizer]
) -> Hosted:
    """What ``kvpool-worker serve`` would build from this argv and env."""
    argv = entry.argv
    if argv and Path(argv[0]).name == "kvpool-worker":
        argv = argv[1:]
    try:
        args = cli._parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage error
        raise cli.StartRefusedError(f"instance {index}: its argv does not parse") from exc
    if args.command != "serve":
        raise cli.StartRefusedError(f"instance {index}: argv must be a 'serve' command")
    settings = cli.settings_from(args, entry.env)
    if settings.engine != "sim":
        raise cli.StartRefusedError(
            f"instance {index}: --engine {settings.engine} cannot be hosted; only --engine sim "
            "instances share a process (run the others with kvpool-worker serve)"
        )
    key = (settings.tokenizer, settings.model_dir)
    tokenizer = tokenizers.get(key)
    if tokenizer is None:
        # one per file, shared, remembering recent long prompts: the hosted instances stand
        # for machines that would tokenize in parallel, and a router that renders every
        # prompt on every worker (vllm-router) would otherwise cost N tokenizations of it here
        tokenizer = tokenizers[key] = cli.tokenizer_for(settings, memo=HOST_ENCODE_MEMO)
    return Hosted(index, settings, cli.build_runtime(settings, entry.env, tokenizer))


def build_all(entries: list[Entry]) -> list[Hosted]:
    tokenizers: dict[tuple[str | None, str | None], TextTokenizer] = {}
    hosted: list[Hosted] = []
    ports: dict[int, int] = {}
    for i, entry in enumerate(entries):
        try:
            h = build_instance(i, entry, tokenizers)
        except cli.StartRefusedError as exc:
            text = str(exc)
            raise cli.StartRefusedError(
                text if text.startswith(f"instance {i}") else f"instance {i}: {text}"
            ) from exc
        port = h.settings.port
        if port in ports and port != 0:
            raise cli.StartRefusedError(
                f"instance {i}: --port {port} is also instance {ports[port]}'s; give each "
                "hosted instance its own port"
            )
        ports[port] = i
        hosted.append(h)
    return hosted


class PortDispatch:
    """One ASGI app over many: a request goes to the app of the port it arrived on."""

    def __init__(self, apps: Mapping[int, ASGIApp]) -> None:
        self.apps = dict(apps)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        app = self.apps.get(server[1]) if server else None
        if app is None:
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b"no instance on this port"})
            return
        await app(scope, receive, send)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only then
    # (without it every small response waits out the client's delayed ACK, ~40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise cli.StartRefusedError(f"--port {port}: cannot bind {host}:{port} ({exc})") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_all(hosted: list[Hosted], log_level: str) -> int:
    """Serve every instance until SIGTERM (each drained and shut down) or a start failure."""
    apps: dict[int, ASGIApp] = {}
    for h in hosted:
        h.sock = h.sock or _listen(h.settings.host, h.settings.port)
        apps[int(h.sock.getsockname()[1])] = build_app(h.runtime, start_engine=False)
    config = uvicorn.Config(
        PortDispatch(apps), log_level=log_level, timeout_graceful_shutdown=2, lifespan="off"
    )
    server = cli._Server(config)
    pending = len(hosted)

    def one_stopped() -> None:
        nonlocal pending
        pending -= 1
        if pending <= 0:
            server.should_exit = True

    shutdowns = [
        GracefulShutdown(
            h.runtime,
            ShutdownPolicy(
                unready_delay_s=h.settings.unready_delay_s,
                drain_timeout_s=h.settings.drain_timeout_s,
                shutdown_deadline_s=h.settings.shutdown_deadline_s,
            ),
            one_stopped,
        )
        for h in hosted
    ]
    loop = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        for s in shutdowns:
            s.on_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    code = EXIT_OK

    async def start() -> None:
        nonlocal code
        results = await asyncio.gather(
            *(h.runtime.start_engine() for h in hosted), return_exceptions=True
        )
        failed = [h.index for h, r in zip(hosted, results, strict=True) if r is not None]
        if failed:
            logger.error("instance(s) %s failed to start: stopping every instance", failed)
            code = cli.EXIT_FAILED
            for s in shutdowns:
                s.begin()
        else:
            logger.info("all %d hosted instances are ready", len(hosted))

    start_task = asyncio.create_task(start(), name="kvpool-host-start")
    await server.serve(sockets=[h.sock for h in hosted if h.sock is not None])
    if not start_task.done():
        start_task.cancel()
    with contextlib.suppress(Exception):
        await asyncio.gather(*(s.done.wait() for s in shutdowns if s.started))
    return code


def run_host(path: str, log_level: str = "info") -> int:
    """``kvpool-worker host``: build every instance (refusing the process on any problem),
    then serve them all."""
    cli.configure_logging(log_level)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        return cli.refuse(cli.StartRefusedError(f"--instances {path}: {exc.strerror or exc}"))
    try:
        hosted = build_all(load_entries(text, path))
        for h in hosted:
            h.sock = _listen(h.settings.host, h.settings.port)
    except cli.StartRefusedError as exc:
        return cli.refuse(exc)
    logger.info("hosting %d simulated instances in one process", len(hosted))
    try:
        code = asyncio.run(serve_all(hosted, log_level))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else cli.EXIT_FAILED
    hard_exit(code)
    return code  # not reached
