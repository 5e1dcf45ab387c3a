"""The full-sync timing kvpool renders shortens LMCache's freeze, in lmcache 0.5.6's own code.

Why: the timing goes to LMCache under ``extra_config``, which LMCache reads key by key with a
default and never checks, so a misspelt or renamed key would silently leave every worker frozen
5 s or more after a controller restart; the loader test (test_rendered_lmcache_config.py)
cannot see it. Here LMCache's ``FullSyncSender`` is built from the config kvpool renders for a
cpu-demo worker and runs a whole sync: with the default ``spec.controller.fullSync`` its engine
is frozen about 0.5 s; with a spec that names LMCache's own timing (read from the sender built
without the keys: 5 s and 5 s) at least 5 s. The random startup delay comes before the freeze.

The controller end is a stand-in that accepts the sync and answers the first status poll
"complete" (what kvpool's controller answers is tested in controller/tests; the subject here
is the worker side's timing). The engine stand-in records ``freeze`` calls (a real engine needs
a model's KV layout, which the timing does not touch). The real domain, with the real
controller and gateway, is measured by the freeze bench (``python -m chaos.freeze``).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import yaml
from lmcache.v1.cache_controller.full_sync_sender import FullSyncSender
from lmcache.v1.cache_controller.message import (
    FullSyncStartMsg,
    FullSyncStartRetMsg,
    FullSyncStatusRetMsg,
)
from lmcache.v1.config import LMCacheEngineConfig

from kvpool.operator.api import P2PGroup
from kvpool.operator.loader import load_text
from kvpool.operator.render import lmcache_configs

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo.yaml"


class _Controller:
    """Stand-in for the worker's link to a controller that has every key at once."""

    worker_id = 0

    async def async_put_and_wait_msg(self, msg: Any) -> Any:
        if isinstance(msg, FullSyncStartMsg):
            return FullSyncStartRetMsg(sync_id=msg.sync_id, accepted=True)
        return FullSyncStatusRetMsg(
            sync_id=msg.sync_id, is_complete=True, global_progress=1.0, can_exit_freeze=True
        )

    def put_msg(self, msg: Any) -> None:
        pass


class _Engine:
    def __init__(self) -> None:
        self.freezes: list[tuple[bool, float]] = []

    def freeze(self, on: bool) -> None:
        self.freezes.append((on, time.monotonic()))


class _Backend:
    def get_keys(self) -> list[Any]:
        return []


def _sender(config: dict[str, Any]) -> tuple[FullSyncSender, _Engine]:
    engine = _Engine()
    cfg = LMCacheEngineConfig.from_dict(config)
    return FullSyncSender(cfg, _Controller(), engine, _Backend()), engine  # type: ignore[arg-type]


def _rendered(full_sync: dict[str, float] | None) -> dict[str, Any]:
    """The LMCache config kvpool renders for cpu-demo's first P2P worker, the pool's
    ``spec.controller.fullSync`` set to ``full_sync`` (None: the file as it is)."""
    docs = list(yaml.safe_load_all(DEMO.read_text(encoding="utf-8")))
    for doc in docs:
        if doc["kind"] == "KVCachePool" and full_sync is not None:
            doc["spec"].setdefault("controller", {})["fullSync"] = full_sync
    loaded = load_text(yaml.safe_dump_all(docs), DEMO.name)
    assert not loaded.errors, loaded.errors
    (domain,) = loaded.domains()
    group = next(m for m in domain.members if isinstance(m, P2PGroup))
    return next(iter(lmcache_configs(domain.pool, group).values()))


def _sync(config: dict[str, Any]) -> tuple[float, float]:
    """(seconds before the freeze, seconds frozen) of one whole full sync."""
    sender, engine = _sender(config)
    random.seed(0)  # LMCache's startup delay is random.uniform(0, delay)
    t0 = time.monotonic()
    assert asyncio.run(sender.start_full_sync("controller_restart")) is True
    (on, t_on), (off, t_off) = engine.freezes
    assert on is True and off is False
    return t_on - t0, t_off - t_on


def test_rendered_timing_shortens_the_freeze_against_lmcache_s_defaults() -> None:
    ours = _rendered(None)
    stock, _ = _sender({k: v for k, v in ours.items() if k != "extra_config"})
    lmcache = {
        "startupDelaySeconds": stock.startup_delay_range_s,
        "statusPollIntervalSeconds": stock.status_poll_interval_s,
    }
    assert lmcache == {"startupDelaySeconds": 5.0, "statusPollIntervalSeconds": 5.0}

    delay, frozen = _sync(ours)
    assert delay <= 0.5 + 0.3
    assert 0.5 <= frozen < 1.5, frozen  # one 0.5 s poll and the messages

    delay_lm, frozen_lm = _sync(_rendered(lmcache))
    assert delay_lm <= 5.0 + 0.3
    assert frozen_lm >= 5.0, frozen_lm
    assert frozen_lm > 4 * frozen
