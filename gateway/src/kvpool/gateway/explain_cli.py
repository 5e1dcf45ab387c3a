"""``kvpool-gateway explain``: why a request was routed where it was and why it missed.

    kvpool-gateway explain REQUEST_ID --url http://gateway:8000 [--api-key KEY] [--json]
    kvpool-gateway explain --chat FILE --url http://gateway:8000   (a dry run of a chat body)

Why this module exists: the explanation lives in the gateway process that routed the request
(``GET /v1/requests/{id}/explain``); this asks it and prints the report for a person (or the
JSON with ``--json``). ``--chat FILE`` (a chat body, or a bare messages list; ``-`` = stdin)
and ``--prompt TEXT`` ask what the gateway would do with that request now, sending nothing.
Exit 0 with the report; 2 with one line naming the problem (the gateway unreachable, the id
unknown, a bad file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import httpx

from kvpool.gateway.explain_view import render_text

EXIT_OK = 0
EXIT_REFUSED = 2
TIMEOUT_S = 30.0


class ExplainError(Exception):
    """A problem the command reports in one line."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``explain`` on ``kvpool-gateway``'s subcommands (called by ``cli.main``)."""
    p = sub.add_parser(
        "explain",
        help="why a request was routed where it was and why its chunks missed",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("request_id", nargs="?", help="the x-request-id of a recent answer")
    what.add_argument("--chat", metavar="FILE", help="dry run of a chat body JSON; - = stdin")
    what.add_argument("--prompt", help="dry run of a completion prompt (text)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument(
        "--api-key",
        help="API key, or @FILE (default: $KVPOOL_GATEWAY_API_KEY)",
        default=os.environ.get("KVPOOL_GATEWAY_API_KEY"),
    )
    p.add_argument("--session", help="x-session-id of the dry run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=run)


def _key(value: str | None) -> str | None:
    if value and value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise ExplainError(f"--api-key: cannot read {value[1:]}: {exc.strerror}") from None
    return value


def chat_body(text: str) -> dict[str, Any]:
    """A chat body from ``--chat``'s JSON: an object with ``messages``, or a messages list."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ExplainError(f"--chat: not JSON ({exc})") from None
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ExplainError("--chat: give a chat body ({'messages': [...]}) or a messages list")
    return data


def fetch(args: argparse.Namespace, read_stdin: Callable[[], str]) -> dict[str, Any]:
    """The report from the gateway for the parsed arguments."""
    headers = {}
    key = _key(args.api_key)
    if key:
        headers["authorization"] = f"Bearer {key}"
    if args.session:
        headers["x-session-id"] = args.session
    base = args.url.rstrip("/")
    try:
        with httpx.Client(timeout=TIMEOUT_S, headers=headers) as client:
            if args.request_id is not None:
                resp = client.get(f"{base}/v1/requests/{args.request_id}/explain")
            else:
                if args.chat is not None:
                    text = read_stdin() if args.chat == "-" else _read(args.chat)
                    body = chat_body(text)
                else:
                    body = {"prompt": args.prompt}
                resp = client.post(f"{base}/v1/requests/explain", json=body)
    except httpx.HTTPError as exc:
        raise ExplainError(f"--url: cannot reach the gateway at {base} ({exc})") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:300]
        raise ExplainError(f"{resp.status_code}: {message}")
    report: dict[str, Any] = resp.json()
    return report


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ExplainError(f"--chat: cannot read {path}: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    """The ``explain`` handler."""
    try:
        report = fetch(args, sys.stdin.read)
    except ExplainError as exc:
        print(f"kvpool-gateway explain: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(report))
    return EXIT_OK
