"""The gateway app in process in front of the fakes (``fakes``): one harness for the app
tests that start it from a config dict, on a free 127.0.0.1 port, bounded in time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fakes import ControllerScript, Script, bound_socket, fake_controller, fake_worker, serving

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.state import build_state

CHUNK = 4


def closed_url() -> str:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def gateway(
    scripts: list[Script],
    controller: ControllerScript | None = None,
    *,
    extra: dict[str, Any] | None = None,
    env: dict[str, Any] | None = None,
    dead: list[str] | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(fake_worker(s))) for s in scripts]
        insts = [{"name": s.name, "url": u} for s, u in zip(scripts, urls, strict=True)]
        insts += [{"name": n, "url": closed_url()} for n in dead or []]
        ctl = closed_url()
        if controller is not None:
            ctl = await stack.enter_async_context(serving(fake_controller(controller)))
        raw = {
            "model": "m",
            "chunkSize": CHUNK,
            "controllerUrl": ctl,
            "p2pGroups": [{"name": "g", "instances": insts}],
            **(extra or {}),
        }
        limits = {"healthIntervalSeconds": 0.2, "retries": 2, "lookupTimeoutSeconds": 5}
        raw["limits"] = {**limits, **(extra or {}).get("limits", {})}
        state = build_state(parse_config(raw), GatewayEnv(**(env or {})), pd_bind_host="127.0.0.1")
        url = await stack.enter_async_context(serving(build_app(state)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=20))
        for _ in range(100):  # the first controller poll
            if controller is None or state.index.controller_up:
                break
            await asyncio.sleep(0.02)
        yield client, state


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


PROMPT = {"prompt": "abcdefghijklmnop", "max_tokens": 3}  # 16 byte-tokens = 4 chunks
