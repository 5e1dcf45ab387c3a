"""``kvpool-controller``: parse LMCache-compatible flags, then run sockets and HTTP on one loop.

Why these flags: an existing LMCache deployment starts its controller with ``--host --port
--monitor-ports '{"pull":..,"reply":..}' --lmcache-worker-timeout --health-check-interval``;
the same command line works here. kvpool's additions (Redis, fingerprint, delta stream) are
extra flags with environment equivalents (``KVPOOL_CONTROLLER_*``, ``KVPOOL_DOMAIN_FINGERPRINT``).
SIGTERM and SIGINT stop the HTTP server and every loop, close the sockets and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Generator, Sequence
from typing import Any

import uvicorn
import zmq
from pydantic import ValidationError

from kvpool.controller.allowlist import AllowlistError
from kvpool.controller.api import create_app
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpool-controller",
        description="LMCache-wire-compatible KV controller (kvpool)",
    )
    ap.add_argument("--host", help="bind address (default 0.0.0.0)")
    ap.add_argument("--port", type=int, help="HTTP API port (default 9000)")
    ap.add_argument(
        "--monitor-ports",
        help='JSON of ZMQ ports, e.g. \'{"pull": 8300, "reply": 8400, "heartbeat": 8500}\'',
    )
    ap.add_argument("--monitor-port", type=int, help="legacy: the PULL port alone")
    ap.add_argument("--lmcache-worker-timeout", type=float, help="heartbeat TTL in seconds")
    ap.add_argument(
        "--health-check-interval", type=float, help="seconds between TTL sweeps (-1: off)"
    )
    ap.add_argument("--advertise-host", help="host workers use for the heartbeat socket")
    ap.add_argument("--redis-url", help="redis://host:port/db: write-behind and reload")
    ap.add_argument("--redis-namespace", help="prefix of every Redis key (default kvpool)")
    ap.add_argument("--fingerprint", help="expected cache-domain fingerprint (12 hex)")
    ap.add_argument(
        "--require-fingerprint",
        action="store_true",
        default=None,
        help="refuse instance ids without a '~<fingerprint>' suffix",
    )
    ap.add_argument("--pub-port", type=int, help="ZMQ PUB port of index deltas")
    ap.add_argument("--snapshot-port", type=int, help="ZMQ ROUTER port answering snapshots")
    ap.add_argument("--control-timeout", type=float, dest="control_timeout_s")
    ap.add_argument("--chunk-size", type=int, help="tokens per chunk for token lookups")
    ap.add_argument(
        "--hash-algorithm",
        help="the domain's pre_caching_hash_algorithm: builtin or sha256_cbor",
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        default=None,
        help="the domain's engines import vLLM: token lookups seed the hash chain from "
        "PYTHONHASHSEED as LMCache does under vLLM",
    )
    ap.add_argument(
        "--lease-name",
        help="run as one of several replicas: lead while holding this coordination.k8s.io/v1 "
        "Lease, follow the leader as a warm standby otherwise (credentials: $KUBECONFIG or the "
        "pod's service account; pod name/namespace: env POD_NAME, POD_NAMESPACE)",
    )
    ap.add_argument("--leader-pub-url", help="tcp://SERVICE:PORT of the leader's delta stream")
    ap.add_argument("--leader-snapshot-url", help="tcp://SERVICE:PORT of the leader's snapshots")
    ap.add_argument("--lease-duration", type=int, dest="lease_duration_s", help="seconds (3)")
    ap.add_argument("--renew-deadline", type=float, dest="renew_deadline_s", help="seconds (2)")
    ap.add_argument("--retry-period", type=float, dest="retry_period_s", help="seconds (0.5)")
    ap.add_argument(
        "--heartbeat-url",
        help="host:port workers heartbeat to (the Service's heartbeat port; default: "
        "--advertise-host and the bound heartbeat port)",
    )
    ap.add_argument(
        "--persistence",
        choices=["auto", "redis", "full-sync", "none"],
        help="index recovery after a restart (default auto: redis if --redis-url, else "
        "full-sync; none: no recovery)",
    )
    ap.add_argument(
        "--instances-file",
        help="JSON or YAML {instance_ids: [...]}: only these instance ids may register (the "
        "operator renders it; re-read when it changes); the API token comes from the env "
        "KVPOOL_CONTROLLER_API_TOKEN only",
    )
    ap.add_argument("--log-level", help="DEBUG, INFO, WARNING...")
    return ap


def settings_from_args(argv: Sequence[str] | None = None) -> ControllerSettings:
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {
        k: v
        for k, v in vars(args).items()
        if v is not None and k not in ("monitor_ports", "monitor_port")
    }
    if args.monitor_ports is not None:
        try:
            values["monitor_ports"] = json.loads(args.monitor_ports)
        except json.JSONDecodeError as exc:
            raise SystemExit(
                f"--monitor-ports is not JSON ({exc}); e.g. '{{\"pull\": 8300}}'"
            ) from None
    elif args.monitor_port is not None:
        values["monitor_ports"] = {"pull": args.monitor_port}
    return ControllerSettings(**values)


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal capture: SIGTERM is handled by ``run`` (clean exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def run(settings: ControllerSettings) -> None:
    server = ControllerServer(settings)
    server.bind()
    http = _HttpServer(
        uvicorn.Config(
            create_app(server),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            access_log=False,
            lifespan="off",
        )
    )
    loop = asyncio.get_running_loop()

    def stop(signame: str) -> None:
        logger.info("%s received; shutting down", signame)
        http.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig.name)
    loops = asyncio.create_task(server.serve())
    loops.add_done_callback(lambda _t: setattr(http, "should_exit", True))
    try:
        await http.serve()
    finally:
        loops.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await loops
        failed = loops.done() and not loops.cancelled() and loops.exception() is not None
        if failed:
            logger.error("controller loops failed: %s", loops.exception())
        await server.close()
        logger.info("controller stopped")
    if failed:  # a lost Lease among them: exit non-zero, the kubelet (or up) restarts a standby
        raise SystemExit(1)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = settings_from_args(argv)
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(x) for x in err["loc"]) or "settings"
            print(f"kvpool-controller: invalid {field}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Lease reads and renewals (ha.py) are two requests a second: httpx logs each at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        asyncio.run(run(settings))
    except AllowlistError as exc:
        print(f"kvpool-controller: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except zmq.ZMQError as exc:
        print(
            f"kvpool-controller: cannot bind the ZMQ sockets on {settings.host} ({exc}); "
            "choose free ports with --monitor-ports / --pub-port / --snapshot-port",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
