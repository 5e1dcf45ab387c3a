"""``kvpool-operator up --sim-host``: the plan of one ``kvpool-worker host`` process per domain.

Why: the host process must run each simulated instance exactly as it would run alone, so the
instances file it reads is each instance's local argv and env from the same ``prepare`` (the
rewrite checked against the render), and nothing of the shell's environment. No process runs
here: the stack is built and prepared, and ``start`` is never called.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

from kvpool.operator.local import plan as ls
from kvpool.operator.local import rewrite as lr
from kvpool.operator.local.stack import LocalStack, Running
from kvpool.operator.local.up import render_files, start_order

ROOT = Path(__file__).resolve().parents[3]
FLEET = ROOT / "examples" / "sim-fleet.yaml"
DEMO = ROOT / "examples" / "cpu-demo.yaml"


def test_sim_workers_are_marked_and_grouped_per_domain() -> None:
    objects = render_files([FLEET, DEMO]).objects
    loads = ls.workloads(objects)
    assert loads["fleet-sim-0"].simulated and loads["fleet-sim-0"].labels["kvpool.io/pool"] == (
        "fleet"
    )
    assert not loads["demo-p2p-0"].simulated  # the reference engine runs alone
    hosts = lr.sim_hosts(loads, sorted(loads))
    assert list(hosts) == ["fleet-sim-host"]
    assert hosts["fleet-sim-host"] == sorted(f"fleet-sim-{i}" for i in range(16))
    assert lr.sim_hosts(loads, ["fleet-sim-3", "demo-p2p-0"]) == {"fleet-sim-host": ["fleet-sim-3"]}


def _stack(root: Path) -> LocalStack:
    objects = render_files([FLEET]).objects
    return LocalStack(
        objects, root, cluster=ls.cluster_map(objects, itertools.count(40000).__next__)
    )


def test_the_instances_file_is_each_instance_as_it_runs_alone(tmp_path: Path) -> None:
    stack = _stack(tmp_path)
    names = [n for n in start_order(stack) if stack.rendered[n].simulated][:3]
    alone = [stack.prepare(n) for n in names]
    entries = json.loads(lr.host_instances(alone))
    assert [e["argv"] for e in entries] == [lw.argv for lw in alone]
    assert [e["env"] for e in entries] == [lw.env for lw in alone]
    for entry, lw in zip(entries, alone, strict=True):
        assert entry["argv"][:4] == ["kvpool-worker", "serve", "--engine", "sim"]
        assert (
            entry["env"]["LMCACHE_CONFIG_FILE"] == lw.file_map["/etc/kvpool/lmcache/lmcache.yaml"]
        )
        assert "PATH" not in entry["env"]  # the pod's env only
        assert stack.rewrites[lw.name]  # checked against the render like any process


def test_a_host_process_lists_its_instances_by_name_port_and_log(tmp_path: Path) -> None:
    """State and endpoints of a host process: every instance under its own name and port,
    with the host's process group (what ``down`` stops) and log."""
    stack = _stack(tmp_path)
    instances = [stack.prepare(f"fleet-sim-{i}") for i in range(2)]
    argv = ["kvpool-worker", "host", "--instances", "x.json"]
    host = lr.LocalWorkload("fleet-sim-host", "worker", argv, {}, {}, {}, {}, None)
    proc = subprocess.Popen(["true"])  # stands for the host process: its id is what is listed
    proc.wait()
    stack.running[host.name] = Running(host, proc, tmp_path / "h.log", hosts=instances)
    manifest = stack.manifest()
    assert manifest["fleet-sim-host"]["hosts"] == ["fleet-sim-0", "fleet-sim-1"]
    for lw in instances:
        entry = manifest[lw.name]
        assert (entry["pgid"], entry["hosted_by"], entry["log"]) == (
            proc.pid,
            "fleet-sim-host",
            str(tmp_path / "h.log"),
        )
        assert entry["argv"] == lw.argv
    assert stack.endpoints() == {
        lw.name: f"http://{ls.LOOPBACK}:{lw.ports['http']}" for lw in instances
    }
