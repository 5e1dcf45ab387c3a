"""KV transfer bandwidth between processes: LMCache P2P and PD over NIXL next to raw NIXL.

Why this module exists: P2P (a peer pulls another's chunks) and PD (prefill hands its prompt to
decode) are only worth their machinery if they move KV near the speed of the transport under
them. This measures, in one run and on the same box, the same bytes moved three ways, each
between two real processes over NIXL/UCX on 127.0.0.1 (``UCX_NET_DEVICES=lo``):

- raw NIXL: one agent WRITEs a registered buffer into another's (the transport's ceiling);
- P2P: worker B's LMCache looks up and prefetches worker A's chunks (kvpool-controller
  answers the lookup; A writes into B's buffers), timed from the lookup to the prefetch's
  answer, i.e. until the data is in B's memory;
- PD: the prefill's LMCache stores with a ``transfer_spec``, timed until the proxy's
  ``ProxyNotif`` (the decoder's buffers hold the data).

Each role runs as ``python transfer_bench.py ROLE DIR ...``; ``measure()`` starts all six
processes at once and interleaves the rounds (raw, P2P, PD, raw, ...), so the load of a shared
box hits the three ways alike. Each side times its phases (:mod:`phases`): the JSON says where
the time went on both sides of every transfer.
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import phases as phase_timing
import services

GEOMETRY = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
CHUNK = 256
CHANNEL = {"transfer_channel": "nixl", "nixl_backends": ["UCX"]}


def _wait_file(path: Path, timeout_s: float = 180) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists():
            return path.read_text()
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout_s}s")


def _round(d: Path, role: str, i: int) -> None:
    """Wait until the orchestrator lets ``role`` run its round ``i`` (rounds of the three ways
    are interleaved, so the shared box's load hits them alike)."""
    _wait_file(d / f"go.{role}.{i}", 600)


def _round_done(d: Path, role: str, i: int) -> None:
    (d / f"done.{role}.{i}").write_text("1")


def _tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(5, 8000) for _ in range(n)]


def _offload(config: dict[str, Any], name: str) -> Any:
    from kvpool.worker.engine.offload import LMCacheOffload

    cfg = {"chunk_size": CHUNK, **config}
    return LMCacheOffload(
        cfg, instance_id=name, dtype="float32", model_name="kvpool/bench", **GEOMETRY
    )


def _paged(num_tokens: int, seed: int) -> tuple[list[Any], Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    bs = GEOMETRY["block_size"]
    blocks = num_tokens // bs + 1
    shape = (2, blocks, bs, GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"])
    order = torch.randperm(blocks, generator=g)  # whole blocks in random order, as an engine's
    slots = (order[:, None] * bs + torch.arange(bs)).flatten()[:num_tokens]
    return [torch.randn(shape, generator=g) for _ in range(GEOMETRY["num_layers"])], slots


# --- roles (each in its own process) -----------------------------------------------------------
def role_raw(d: Path, side: str, nbytes: int, repeats: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(side, nixl_agent_config(backends=["UCX"]))
    buf = (
        torch.ones(nbytes, dtype=torch.uint8)
        if side == "src"
        else torch.zeros(nbytes, dtype=torch.uint8)
    )
    agent.register_memory(buf)
    if side == "dst":
        (d / "raw.meta").write_bytes(agent.get_agent_metadata())
        (d / "raw.descs").write_bytes(agent.get_serialized_descs(agent.get_xfer_descs(buf)))
        (d / "raw.ready").write_text("1")
        _wait_file(d / "raw.done", 600)
        ok = bool(buf[:: max(1, nbytes // 4096)].eq(1).all())
        (d / "raw.verified").write_text("1" if ok else "0")
        return
    _wait_file(d / "raw.ready")
    remote = agent.add_remote_agent((d / "raw.meta").read_bytes())
    remote_descs = agent.deserialize_descs((d / "raw.descs").read_bytes())
    times = []
    for i in range(repeats + 1):  # the first transfer also connects: not counted
        _round(d, "raw", i)
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(buf), remote_descs, remote)
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - t0)
        agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError("raw NIXL transfer failed")
        _round_done(d, "raw", i)
    (d / "raw.json").write_text(json.dumps({"seconds": times[1:]}))
    (d / "raw.done").write_text("1")


def _controller_sees(http: str, instance: str, tokens: list[int], timeout_s: float = 180) -> None:
    """Wait until the controller's ``/lookup`` offers ``instance`` for all of ``tokens`` (its
    admit events are batched and, on a loaded box, can take seconds to land)."""
    import urllib.request

    end = time.monotonic() + timeout_s
    body = json.dumps({"tokens": tokens}).encode()
    while time.monotonic() < end:
        req = urllib.request.Request(
            f"{http}/lookup", body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as reply:
            layout = json.loads(reply.read()).get("layout_info", {})
        if layout.get(instance, [None, 0])[1] >= len(tokens):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the controller never offered {instance} for the stored prompt")


def role_p2p(d: Path, side: str, ctl: dict[str, str], ntok: int, repeats: int) -> None:
    from kvpool.worker.engine.offload.lmcache_offload import LMCacheOffload

    http = ctl.pop("http")
    cfg: dict[str, Any] = {
        "local_cpu": True, "max_local_cpu_size": 0.5, "enable_controller": True,
        "lmcache_instance_id": f"bench-{side}", **ctl,
        "lmcache_worker_ports": [services.free_port()], "enable_p2p": True, "p2p_host": "127.0.0.1",
        "p2p_init_ports": [services.free_port()], "p2p_lookup_ports": [services.free_port()],
        "enable_async_loading": True, **CHANNEL,
    }  # fmt: skip
    timing = phase_timing.Phases()
    (phase_timing.p2p_holder if side == "a" else phase_timing.p2p_requester)(timing)
    off: LMCacheOffload = _offload(cfg, f"bench-{side}")
    prompts = [_tokens(ntok, seed=i) for i in range(repeats + 1)]
    if side == "a":
        kv, slots = _paged(ntok, 1)
        for p in prompts:
            off.store(p, kv, slots)
        off.flush()
        _controller_sees(http, f"bench-{side}", prompts[-1])  # and so every earlier prompt
        (d / "p2p.ready").write_text("1")
        _wait_file(d / "p2p.done", 600)
        (d / "p2p.a.phases.json").write_text(json.dumps(timing.medians(skip=1)))
    else:
        _wait_file(d / "p2p.ready")
        times, hits = [], []
        for i, p in enumerate(prompts):  # distinct prompts: B never has them locally
            _round(d, "p2p", i)
            t0 = time.perf_counter()
            lid = off.start_lookup(p)
            assert off.async_lookups is not None
            hits.append(off.async_lookups.wait(lid))
            times.append(time.perf_counter() - t0)
            off.cancel_lookup(lid)
            _round_done(d, "p2p", i)
        (d / "p2p.b.phases.json").write_text(json.dumps(timing.medians(skip=1)))
        (d / "p2p.json").write_text(json.dumps({"seconds": times[1:], "hit_tokens": hits[1:]}))
        (d / "p2p.done").write_text("1")
    off.close(5)


def role_pd(d: Path, side: str, ports: dict[str, int], ntok: int, repeats: int) -> None:
    common: dict[str, Any] = {
        "local_cpu": False, "enable_pd": True, "pd_buffer_size": 256 * 2**20,
        "pd_buffer_device": "cpu", **CHANNEL,
    }  # fmt: skip
    if side == "recv":
        import msgspec
        import zmq

        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"tcp://127.0.0.1:{ports['proxy']}")
        timing = phase_timing.Phases()
        phase_timing.pd_receiver(timing)
        off = _offload(
            {**common, "pd_role": "receiver", "pd_peer_host": "127.0.0.1",
             "pd_peer_init_port": [ports["init"]], "pd_peer_alloc_port": [ports["alloc"]]},
            "bench-pd-recv",
        )  # fmt: skip
        (d / "pd.ready").write_text("1")
        kv, slots = _paged(ntok, 3)
        got, loaded = [], []
        for i in range(repeats + 1):
            got.append(msgspec.msgpack.decode(pull.recv()))
            (d / f"pd.notified.{len(got)}").write_text(str(time.time()))
            # consume it as a decoder does: LMCache frees a receiver's PD buffer only when the
            # KV is retrieved (remove_after_retrieve); unread transfers fill the buffer and the
            # sender's next allocation waits forever (the 8th of 8192 tokens in 256 MiB)
            tokens = _tokens(ntok, seed=100 + i)
            loaded.append(off.retrieve(tokens, off.lookup(tokens), kv, slots))
            (d / f"pd.consumed.{len(got)}").write_text("1")
        (d / "pd.recv.json").write_text(json.dumps({"notifications": got, "loaded": loaded}))
        (d / "pd.recv.phases.json").write_text(json.dumps(timing.medians(skip=1)))
        pull.close(linger=0)
        ctx.term()
        off.close(5)
        return
    from kvpool.worker.engine_api import KVTransferParams

    timing = phase_timing.Phases()
    phase_timing.pd_sender(timing)
    off = _offload(
        {**common, "pd_role": "sender", "pd_proxy_host": "127.0.0.1",
         "pd_proxy_port": ports["proxy"], "save_unfull_chunk": True},
        "bench-pd-send",
    )  # fmt: skip
    _wait_file(d / "pd.ready")
    kv, slots = _paged(ntok, 2)
    times = []
    for i in range(repeats + 1):
        spec = KVTransferParams(f"bench-{i}", "127.0.0.1", (ports["init"],), (ports["alloc"],))
        _round(d, "pd", i)
        t0 = time.time()
        off.store(_tokens(ntok, seed=100 + i), kv, slots, kv_transfer=spec)
        done = float(_wait_file(d / f"pd.notified.{i + 1}", 120))
        times.append(done - t0)
        _wait_file(d / f"pd.consumed.{i + 1}", 120)  # the decoder's retrieve, not timed
        _round_done(d, "pd", i)
    (d / "pd.json").write_text(json.dumps({"seconds": times[1:]}))
    (d / "pd.send.phases.json").write_text(json.dumps(timing.medians(skip=1)))
    off.close(5)


# --- orchestration -------------------------------------------------------------------------------
def _spawn(d: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    log = (d / f"{name}.log").open("wb")
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(Path(__file__).resolve()), *args]
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _join(d: Path, procs: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    try:
        for name, proc in procs.items():
            rc = proc.wait(max(1.0, end - time.monotonic()))
            if rc != 0:
                tail = (d / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"transfer bench role {name} exited {rc}:\n{tail}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _wait_done(d: Path, role: str, i: int, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Wait for ``role``'s round ``i``; a role process that died ends the run with its log."""
    end = time.monotonic() + 300
    while not (d / f"done.{role}.{i}").exists():
        for name, proc in procs.items():
            if proc.poll() not in (None, 0):
                tail = (d / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"transfer bench role {name} exited {proc.returncode}:\n{tail}")
        if time.monotonic() > end:
            raise TimeoutError(f"round {i} of {role} did not finish within 300 s")
        time.sleep(0.02)


def chunk_bytes() -> int:
    """Bytes of one stored chunk as LMCache holds it (payload plus kvpool's guard row)."""
    import torch

    from kvpool.worker.engine.offload import guard

    hidden = GEOMETRY["num_kv_heads"] * GEOMETRY["head_dim"]
    width = guard.stored_row_width(hidden, torch.float32)
    return 2 * GEOMETRY["num_layers"] * CHUNK * width * 4


def measure(tmp: Path, *, tokens: int, repeats: int) -> dict[str, Any]:
    """GB/s of raw NIXL, LMCache P2P and LMCache PD for the KV of ``tokens`` tokens."""
    d = tmp / "transfer"
    d.mkdir(parents=True, exist_ok=True)
    nbytes = (tokens // CHUNK) * chunk_bytes()
    ctl_ports = {
        "http": services.free_port(),
        "pull": services.free_port(),
        "reply": services.free_port(),
    }
    ctl_cmd = [
        str(services.BIN / "kvpool-controller"), "--host", "127.0.0.1",
        "--port", str(ctl_ports["http"]),
        "--monitor-ports", json.dumps({"pull": ctl_ports["pull"], "reply": ctl_ports["reply"]}),
    ]  # fmt: skip
    ctl_http = f"http://127.0.0.1:{ctl_ports['http']}"
    ctl = {
        "controller_pull_url": f"127.0.0.1:{ctl_ports['pull']}",
        "controller_reply_url": f"127.0.0.1:{ctl_ports['reply']}",
    }
    pd_ports = {
        "proxy": services.free_port(),
        "init": services.free_port(),
        "alloc": services.free_port(),
    }
    r = str(repeats)

    def pair(role: str, sides: tuple[str, str], arg: str) -> dict[str, subprocess.Popen[bytes]]:
        return {
            f"{role}-{side}": _spawn(d, f"{role}-{side}", role, str(d), side, arg, str(tokens), r)
            for side in sides
        }

    with services.started(ctl_cmd, ctl_ports["http"], "kvpool-controller", d / "controller.log"):
        procs = {
            "raw-dst": _spawn(d, "raw-dst", "raw", str(d), "dst", str(nbytes), r),
            "raw-src": _spawn(d, "raw-src", "raw", str(d), "src", str(nbytes), r),
            **pair("p2p", ("a", "b"), json.dumps({**ctl, "http": ctl_http})),
            **pair("pd", ("recv", "send"), json.dumps(pd_ports)),
        }
        try:
            for i in range(repeats + 1):  # round i of each way, one after the other
                for role in ("raw", "p2p", "pd"):
                    (d / f"go.{role}.{i}").write_text("1")
                    _wait_done(d, role, i, procs)
        except BaseException:
            for proc in procs.values():
                proc.kill()
            raise
        _join(d, procs, 300)
    raw_s = json.loads((d / "raw.json").read_text())["seconds"]
    p2p_r = json.loads((d / "p2p.json").read_text())
    pd_s = json.loads((d / "pd.json").read_text())["seconds"]
    pd_loaded = json.loads((d / "pd.recv.json").read_text())["loaded"]
    if min(pd_loaded) < tokens - 1:  # the receiver skips the prompt's last token
        raise RuntimeError(f"PD receiver loaded {pd_loaded} tokens, expected ~{tokens}")
    if (d / "raw.verified").read_text() != "1":
        raise RuntimeError("raw NIXL: the destination buffer does not hold the source bytes")
    if min(p2p_r["hit_tokens"]) < tokens:
        raise RuntimeError(f"P2P pulled {p2p_r['hit_tokens']} tokens, expected {tokens}")
    gb = nbytes / 1e9
    out = {
        "raw_nixl_GBps": gb / statistics.median(raw_s),
        "p2p_GBps": gb / statistics.median(p2p_r["seconds"]),
        "pd_GBps": gb / statistics.median(pd_s),
        "transfer_bytes": float(nbytes),
    }
    for side in ("p2p.a", "p2p.b", "pd.send", "pd.recv"):  # where the time went, per side
        for label, ms in json.loads((d / f"{side}.phases.json").read_text()).items():
            out[f"{side.replace('.', '_')}_{label}_ms"] = ms
    out["raw_nixl_ms"] = statistics.median(raw_s) * 1e3
    out["p2p_ms"] = statistics.median(p2p_r["seconds"]) * 1e3
    out["pd_ms"] = statistics.median(pd_s) * 1e3
    out["p2p_vs_raw_nixl"] = out["p2p_GBps"] / out["raw_nixl_GBps"]
    out["pd_vs_raw_nixl"] = out["pd_GBps"] / out["raw_nixl_GBps"]
    return out


def main(argv: list[str]) -> None:
    role, d = argv[0], Path(argv[1])
    if role == "raw":
        role_raw(d, argv[2], int(argv[3]), int(argv[4]))
    elif role == "p2p":
        role_p2p(d, argv[2], json.loads(argv[3]), int(argv[4]), int(argv[5]))
    elif role == "pd":
        role_pd(d, argv[2], json.loads(argv[3]), int(argv[4]), int(argv[5]))
    else:
        raise SystemExit(f"unknown role {role!r}")
    sys.stdout.flush()
    os._exit(0)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1:])
