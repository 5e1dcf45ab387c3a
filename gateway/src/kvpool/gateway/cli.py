"""``kvpool-gateway``: serve the gateway, or print a prompt's tokens and chunk hashes.

Why this module exists: the operator renders exactly ``kvpool-gateway serve --host H --port P
--config /etc/kvpool/gateway/gateway.yaml`` (operator/src/kvpool/operator/render/pool_objects.py)
with ``KVPOOL_GATEWAY_AUTH_TOKEN_FILE`` (the mounted key Secret), ``POD_IP`` and the domain's
``PYTHONHASHSEED`` in the environment; this parser accepts exactly that, refuses a bad config
with a message naming the key (exit 2, no traceback), and runs uvicorn with uvloop and
httptools, draining on SIGTERM (``drain``) — in one process, or with ``--workers N`` in N
processes sharing the port (``processes``).

    kvpool-gateway serve --config gateway.yaml [--host 127.0.0.1] [--port 8000] [--workers N]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from kvpool.gateway.app import build_app
from kvpool.gateway.config import ConfigError, GatewayConfig, GatewayEnv, load_config
from kvpool.gateway.drain import DrainingServer
from kvpool.gateway.processes import supervise, workers_for
from kvpool.gateway.state import build_state

EXIT_REFUSED = 2


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    log_level: str
    workers: int = 1
    config_path: Path | None = None  # followed: a change is applied live (kvpool.gateway.live)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool-gateway", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible KV-affinity gateway")
    serve.add_argument("--config", required=True, help="the rendered gateway.yaml")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes sharing the port (SO_REUSEPORT), each with its own index "
        "replica; 0: one per CPU core (default 1)",
    )
    _add_extra_commands(sub)
    return parser


def _add_extra_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Other subcommands (``hashes``, ``replay``, ``simulate``, ``plan``) registered by their
    modules when present."""
    for name in (
        "kvpool.gateway.hashes_cli",
        "kvpool.gateway.explain_cli",
        "kvpool.gateway.replay_cli",
        "kvpool.gateway.fleetsim.cli",
    ):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        module.add_parser(sub)


def settings_from_args(argv: Sequence[str]) -> tuple[GatewayConfig, ServeOptions]:
    """Parse ``serve`` arguments (without the program name) and load the config."""
    args = build_parser().parse_args(list(argv))
    if args.command != "serve":
        raise ConfigError(f"settings_from_args takes 'serve' arguments, got {args.command!r}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port: {args.port} is not a TCP port (1..65535)")
    try:
        workers = workers_for(args.workers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config = load_config(args.config)
    if workers > 1 and config.pd_pairs:
        raise ConfigError(
            f"--workers {workers}: this gateway is the PD proxy of "
            f"{', '.join(p.name for p in config.pd_pairs)}, whose senders notify one proxy "
            "port; run one process (--workers 1)"
        )
    options = ServeOptions(args.host, args.port, args.log_level, workers, Path(args.config))
    return config, options


def serve(config: GatewayConfig, options: ServeOptions) -> int:
    if options.workers > 1:
        run = functools.partial(_serve_socket, config, options)
        return supervise(run, options.host, options.port, options.workers)
    _serve_socket(config, options, None)
    return 0


def _serve_socket(config: GatewayConfig, options: ServeOptions, sock: socket.socket | None) -> None:
    """One gateway process: on ``sock`` (bound by the caller), else binding host:port."""
    if sock is not None:  # a --workers process: its own logging, as main() sets it up
        _logging(options.log_level)
    env = GatewayEnv()
    state = build_state(
        config,
        env,
        pd_bind_host=options.host,
        config_path=options.config_path,
        processes=options.workers,
    )
    app = build_app(state)
    logging.getLogger(__name__).info(
        "kvpool-gateway serving %s on %s:%d (%s)",
        config.model,
        options.host,
        options.port,
        "API keys required" if state.api_keys else "no auth",
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            loop="uvloop",
            http="httptools",
            log_level=options.log_level,
            access_log=False,
            # SIGTERM drains first (limits.drainTimeoutSeconds); what is left after the drain
            # (or after a second signal) gets this long, then is cut
            timeout_graceful_shutdown=2,
        ),
        state.drain,
    )
    server.run(sockets=[sock] if sock is not None else None)


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call: noise


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _logging(str(getattr(args, "log_level", "info")))
    if args.command != "serve":
        handler = getattr(args, "handler", None)
        return int(handler(args)) if handler is not None else EXIT_REFUSED
    try:
        config, options = settings_from_args(argv)
    except ConfigError as exc:
        print(f"kvpool-gateway: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        return serve(config, options)
    except (OSError, ConfigError) as exc:
        print(f"kvpool-gateway: {exc}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
