"""Fixtures: the emulated API server, a kubectl-like client, and the operator in a thread."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
from apiserver import ApiServer
from harness import Client, OperatorThread, test_settings


@pytest.fixture
async def apiserver() -> AsyncIterator[ApiServer]:
    async with ApiServer() as server, kmock.Server(server):
        yield server


@pytest.fixture
async def client(apiserver: ApiServer) -> AsyncIterator[Client]:
    c = Client(str(apiserver.url))
    yield c
    await c.close()


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {}


@pytest.fixture
async def operator(
    apiserver: ApiServer, client: Client, settings_overrides: dict[str, Any]
) -> AsyncIterator[OperatorThread]:
    op = OperatorThread(str(apiserver.url), test_settings(**settings_overrides)).start()
    await op.wait_ready()
    yield op
    await op.stop()
