"""Every instance of a member with its engine, TP size and ports, and the worker command line.

Why: a P2PGroup has one engine for all instances, a PDPair one per side; render (the pods),
validation (flags a user may not pass, accelerator counts) and status (instances) iterate the
same instances with the same engine and TP, so the pairing is made once here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from kvpool.operator.api.members import EngineSpec, P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.derive.platform import pd_sender_pull
from kvpool.operator.derive.ports import InstancePorts, p2p_ports, pd_ports
from kvpool.operator.derive.sim import sim_flags

WORKER_SHUTDOWN_DEADLINE_SECONDS = 30


@dataclass(frozen=True)
class Instance:
    """One engine instance: its ports, the engine spec it runs and its TP size."""

    ports: InstancePorts
    engine: EngineSpec
    tp: int

    @property
    def name(self) -> str:
        """The instance name (StatefulSet, headless Service, lmcache_rpc_port identifier)."""
        return self.ports.name

    @property
    def role(self) -> str:
        """p2p, prefill or decode."""
        return self.ports.role


def engines(member: P2PGroup | PDPair) -> Iterator[tuple[str, EngineSpec, int]]:
    """(field path, engine, TP size) of each engine a member declares."""
    if isinstance(member, P2PGroup):
        yield "spec.engine", member.spec.engine, member.spec.tensor_parallel_size
        return
    for side, role in (("prefill", member.spec.prefill), ("decode", member.spec.decode)):
        yield f"spec.{side}.engine", role.engine, role.tensor_parallel_size


def member_instances(member: P2PGroup | PDPair) -> list[InstancePorts]:
    """Every instance of a member with its ports."""
    if isinstance(member, P2PGroup):
        return p2p_ports(member)
    return pd_ports(member, sender_pull=pd_sender_pull(member))


def instances(member: P2PGroup | PDPair) -> list[Instance]:
    """Every instance of a member with its engine and TP size."""
    out: list[Instance] = []
    for ports in member_instances(member):
        if isinstance(member, P2PGroup):
            engine, tp = member.spec.engine, member.spec.tensor_parallel_size
        else:
            side = member.spec.prefill if ports.role == "prefill" else member.spec.decode
            engine, tp = side.engine, side.tensor_parallel_size
        out.append(Instance(ports, engine, tp))
    return out


def instance_url(instance: str, namespace: str, port: int) -> str:
    """The HTTP endpoint of an instance inside the cluster."""
    return f"http://{names.instance_pod_host(instance, namespace)}:{port}"


def engine_kind(engine: EngineSpec) -> str:
    """``--engine`` of the worker: sim (engine.sim), reference (cpu) or vllm (ascend, cuda)."""
    if engine.sim is not None:
        return "sim"
    return "reference" if engine.platform == "cpu" else "vllm"


def kv_events_config(ports: tuple[int, int]) -> str:
    """vLLM's ``--kv-events-config`` for the instance's (PUB, replay ROUTER) ports: ZMQ on every
    interface of the pod (``*``: vLLM binds; the simulated engine binds on its ``--host``)."""
    pub, replay = ports
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return json.dumps(config, separators=(",", ":"))


def worker_command(pool: KVCachePool, inst: Instance) -> list[str]:
    """``kvpool-worker serve``: vLLM on ascend/cuda, the reference engine on cpu, the
    simulated engine (its profile and the pool's model shape) for engine.sim.

    The worker derives vLLM's --kv-transfer-config (connector, kv_role from pd_role,
    discard_partial_chunks, skip_last_n_tokens) from the mounted LMCache config; the operator
    passes the domain facts and the instance's distinct lmcache_rpc_port identifier (rule 3),
    and with engine.kvEvents vLLM's KV-event publisher on the instance's own ports (the worker
    hands it to vLLM; the simulated engine publishes its device cache there).
    """
    engine = inst.engine
    command = [
        "kvpool-worker",
        "serve",
        "--engine",
        engine_kind(engine),
        "--platform",
        engine.platform,
        "--model",
        pool.spec.model.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(inst.ports.http),
        "--tensor-parallel-size",
        str(inst.tp),
        "--block-size",
        str(pool.spec.block_size),
        "--kv-dtype",
        pool.spec.model.kv_dtype,
        "--max-model-len",
        str(engine.max_model_len),
        "--lmcache-rpc-port",
        inst.name,
        "--shutdown-deadline",
        str(WORKER_SHUTDOWN_DEADLINE_SECONDS),
    ]
    if engine.sim is not None:
        command += sim_flags(pool, engine.sim)
    if engine.kv_events and inst.ports.kv_events is not None:
        command += ["--kv-events-config", kv_events_config(inst.ports.kv_events)]
    if engine.args:
        command += ["--", *engine.args]
    return command


def owned_flags(command: list[str]) -> set[str]:
    """The flags kvpool sets on a worker command (everything before the engine's ``--``)."""
    head = command[: command.index("--")] if "--" in command else command
    return {arg.split("=", 1)[0] for arg in head if arg.startswith("--")}
