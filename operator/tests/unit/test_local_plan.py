"""The local stack's rewrite of a rendered domain: only what a cluster provides changes.

Why: every end-to-end claim of ``test_local_stack.py`` rests on the processes running the
operator's render, not a hand-made variant. These tests run no process: they take the real
render of ``examples/cpu-demo.yaml`` and check that the local form differs from it only by
DNS names, bind addresses, ports and mount paths, that those rewrites are consistent across
workloads (a worker's controller URL reaches the controller's local socket), and that the
independent rewrite check fails on any other change.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import localstack as ls

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo.yaml"


@pytest.fixture(scope="module")
def objects() -> list[ls.Obj]:
    return ls.render_file(EXAMPLE)


def test_extracts_every_workload_with_its_mounted_lmcache_config(objects: list[ls.Obj]) -> None:
    loads = ls.workloads(objects)
    workers = {n for n, w in loads.items() if w.component == "worker"}
    assert workers == {"demo-p2p-0", "demo-p2p-1", "demo-pd-prefill-0", "demo-pd-decode-0"}
    assert loads["demo-controller"].argv[0] == "kvpool-controller"
    for name in workers:
        w = loads[name]
        assert w.argv[:2] == ["kvpool-worker", "serve"]
        mounted = w.env["LMCACHE_CONFIG_FILE"]
        assert list(w.files) == [mounted]
        assert yaml.safe_load(w.files[mounted])["lmcache_instance_id"].startswith(f"{name}~")


def test_rewrite_touches_only_cluster_provided_values(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    cmap = ls.cluster_map(objects)
    for name, w in ls.workloads(objects).items():
        lw = ls.localize(w, cmap, tmp_path)
        changes = ls.check_rewrite(w, lw, cmap)
        assert changes, name
        assert all(v == ls.LOOPBACK or not v.startswith("0.0.0.0") for v in lw.argv)
        # Identity, seed and every non-address setting are byte-for-byte the render's.
        for key in ("PYTHONHASHSEED", "KVPOOL_DOMAIN_FINGERPRINT"):
            assert lw.env[key] == w.env[key]
        for mounted, text in w.files.items():
            if w.component != "worker":
                continue  # nested configs: check_rewrite above covers every leaf
            before = yaml.safe_load(text)
            after = yaml.safe_load(lw.files[lw.file_map[mounted]])
            assert set(before) == set(after)
            kept = {k for k in before if not any(s in k.lower() for s in ("port", "host", "url"))}
            assert {k: after[k] for k in kept} == {k: before[k] for k in kept}


def test_gateway_routing_config_reaches_local_workers(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    """Nested addresses (the gateway's instance URLs) move with their workers' ports."""
    cmap = ls.cluster_map(objects)
    loads = ls.workloads(objects)
    gw = ls.localize(loads["demo-gateway"], cmap, tmp_path)
    cfg = yaml.safe_load(next(iter(gw.files.values())))
    urls = {i["name"]: i["url"] for g in cfg["p2pGroups"] for i in g["instances"]}
    for name, url in urls.items():
        port = ls.localize(loads[name], cmap, tmp_path).ports["http"]
        assert url == f"http://{ls.LOOPBACK}:{port}"
    ctl = ls.localize(loads["demo-controller"], cmap, tmp_path)
    assert cfg["controllerUrl"] == f"http://{ls.LOOPBACK}:{ctl.ports['http']}"


def test_worker_and_controller_addresses_meet_on_the_same_local_sockets(
    objects: list[ls.Obj], tmp_path: Path
) -> None:
    cmap = ls.cluster_map(objects)
    loads = ls.workloads(objects)
    ctl = ls.localize(loads["demo-controller"], cmap, tmp_path)
    monitor = json.loads(ctl.argv[ctl.argv.index("--monitor-ports") + 1])
    assert monitor["pull"] == ctl.ports["pull"] and monitor["reply"] == ctl.ports["reply"]
    assert ctl.argv[ctl.argv.index("--port") + 1] == str(ctl.ports["http"])
    for name in ("demo-p2p-0", "demo-p2p-1"):
        lw = ls.localize(loads[name], cmap, tmp_path)
        cfg = yaml.safe_load(next(iter(lw.files.values())))
        assert cfg["controller_pull_url"] == f"{ls.LOOPBACK}:{monitor['pull']}"
        assert cfg["controller_reply_url"] == f"{ls.LOOPBACK}:{monitor['reply']}"
        assert cfg["lmcache_worker_ports"] == [lw.ports["wrk-0"]]
        assert lw.argv[lw.argv.index("--port") + 1] == str(lw.ports["http"])
        assert lw.env["POD_IP"] == lw.env["LMCACHE_P2P_HOST"] == ls.LOOPBACK
    all_ports = list(cmap.ports.values())
    assert len(set(all_ports)) == len(all_ports)


@pytest.mark.parametrize(
    ("where", "mutate"),
    [
        ("chunk_size", lambda cfg: cfg.update(chunk_size=128)),
        ("lmcache_instance_id", lambda cfg: cfg.update(lmcache_instance_id="other~0123456789ab")),
        ("controller_pull_url", lambda cfg: cfg.update(controller_pull_url="10.0.0.9:8300")),
        ("enable_p2p", lambda cfg: cfg.update(enable_p2p=False)),
    ],
)
def test_rewrite_check_refuses_any_other_change(
    objects: list[ls.Obj], tmp_path: Path, where: str, mutate: object
) -> None:
    cmap = ls.cluster_map(objects)
    w = ls.workloads(objects)["demo-p2p-0"]
    lw = ls.localize(w, cmap, tmp_path)
    path = next(iter(lw.files))
    cfg = yaml.safe_load(lw.files[path])
    mutate(cfg)  # type: ignore[operator]
    lw.files[path] = yaml.safe_dump(cfg)
    with pytest.raises(ls.StackError, match=where):
        ls.check_rewrite(w, lw, cmap)


def test_rewrite_check_refuses_a_changed_flag_or_env(objects: list[ls.Obj], tmp_path: Path) -> None:
    cmap = ls.cluster_map(objects)
    w = ls.workloads(objects)["demo-p2p-0"]
    lw = ls.localize(w, cmap, tmp_path)
    lw.argv[lw.argv.index("--block-size") + 1] = "32"
    with pytest.raises(ls.StackError, match="'16' -> '32'"):
        ls.check_rewrite(w, lw, cmap)
    lw = ls.localize(w, cmap, tmp_path)
    lw.env["PYTHONHASHSEED"] = "1"
    with pytest.raises(ls.StackError, match="PYTHONHASHSEED"):
        ls.check_rewrite(w, lw, cmap)


def test_a_port_outside_the_domain_is_an_error(objects: list[ls.Obj], tmp_path: Path) -> None:
    cmap = ls.cluster_map(objects)
    w = ls.workloads(objects)["demo-p2p-0"]
    path = next(iter(w.files))
    cfg = yaml.safe_load(w.files[path])
    cfg["controller_pull_url"] = "demo-controller.default.svc:1234"
    w.files[path] = yaml.safe_dump(cfg)
    with pytest.raises(ls.StackError, match="port 1234 is not a port of any Service"):
        ls.localize(w, cmap, tmp_path)
