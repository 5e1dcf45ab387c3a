"""The fleet-scale benchmark's controller part (gateway/bench/fleet/scale.py), on a tiny fleet.

A real ``kvpool-controller`` process receives, from sender processes over its PULL socket, the
LMCache admit/evict batches 20 simulated instances sent while serving the first 100 requests of
the Mooncake trace, while a lookup process asks it P2P and prefix lookups and a replica process
(the gateway's IndexClient) follows its delta stream. No event may be lost: the controller's
index and the replica must equal, key for key, the union of the instances' DDR and disk tiers.

The recorder's batching is checked on its own: LMCache sends a location's queued events 10 ms
after the first, or at once when 50 are queued, numbered per (worker, location).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvpool.protocol.simcore.kvcache import KvEvent

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fleet" / "scale.py"
TRACE = Path(__file__).resolve().parents[4] / "shared/traces/mooncake_conversation_trace.jsonl"

pytestmark = pytest.mark.timeout(120)


def load_scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvpool_bench_fleet_scale", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


scale = load_scale()


def test_recorder_batches_as_lmcache_does() -> None:
    rec = scale.Recorder(batch=3, timeout_s=0.01)
    cpu, disk = "LocalCPUBackend", "LocalDiskBackend"
    rec.indexed(0.0, "a", [KvEvent("admit", cpu, 1), KvEvent("admit", disk, 1)])
    rec.indexed(0.005, "a", [KvEvent("admit", cpu, 2)])  # joins the open batch
    rec.indexed(0.02, "a", [KvEvent("evict", cpu, 1)])  # the 10 ms timer fired before
    rec.indexed(0.021, "a", [KvEvent("admit", cpu, k) for k in (3, 4)])  # 3 queued: at once
    rec.indexed(0.021, "b", [KvEvent("admit", cpu, 9)])
    got = [(round(b.t, 6), b.instance, b.location, [e.key for e in b.events]) for b in rec.finish()]
    assert got == [
        (0.01, "a", cpu, [1, 2]),
        (0.01, "a", disk, [1]),
        (0.021, "a", cpu, [1, 3, 4]),
        (0.031, "b", cpu, [9]),
    ]


@pytest.mark.skipif(not TRACE.is_file(), reason="the shared Mooncake trace is not checked out")
def test_no_event_is_lost_by_the_controller(tmp_path: Path) -> None:
    params = scale.ScaleParams(
        instances=20,
        requests=100,
        senders=2,
        p2p_rate=50.0,
        prefix_rate=20.0,
        lookup_prompts=50,
        replay_speedup=20.0,
        modes=("paced",),
        replay_budget_s=60.0,
    )
    logs, work = tmp_path / "logs", tmp_path / "work"
    logs.mkdir()
    work.mkdir()
    m, rec, _ = scale.measure_controller(params, TRACE, logs, work)
    assert rec.events > 1000 and len(rec.expected) > 20  # evictions and two tiers took part
    assert m["controller_events_sent"] == rec.events
    assert m["controller_events_applied"] == rec.events
    assert m["controller_events_lost"] == 0  # applied == sent, index and replica == the tiers
    assert m["controller_bad_input"] == 0
    assert m["controller_chunk_locations"] == sum(map(len, rec.expected.values()))
    assert m["controller_lookup_errors"] == 0
    assert m["controller_lookup_p99_ms"] > 0
