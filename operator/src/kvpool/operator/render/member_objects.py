"""Objects of a P2PGroup or PDPair: per-instance StatefulSets, Services, LMCache ConfigMap, PDB.

Why: each instance is its own single-pod StatefulSet because each has its own ports, LMCache
config and instance id; a headless Service per instance gives the pod a stable DNS name that
the LMCache config can name (p2p_host, pd_peer_host, Mooncake local_hostname). LMCache's own
loader lets env override file keys, so the pod IP (downward API) replaces the DNS name at run
time via LMCACHE_P2P_HOST / LMCACHE_PD_PEER_HOST.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvpool.operator.api.members import EngineSpec, P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.render import k8s, names
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.operator.render.lmcache_config import p2p_config, pd_config, pd_sender_pull
from kvpool.operator.render.ports import InstancePorts, p2p_ports, pd_ports
from kvpool.protocol.domain import REQUIRED_WORKER_ENV

Obj = k8s.Obj


def worker_env(pool: KVCachePool, engine: EngineSpec, inst: InstancePorts) -> list[Obj]:
    """Rule 9 env plus the domain env (rule 1) and the pod IP for LMCache's host keys."""
    out = [
        *k8s.domain_env(pool),
        *(k8s.env(name, value) for name, value in REQUIRED_WORKER_ENV.items()),
        k8s.env("LMCACHE_CONFIG_FILE", names.LMCACHE_CONFIG_FILE),
        k8s.env("KVPOOL_INSTANCE", inst.name),
        k8s.field_env("POD_IP", "status.podIP"),
    ]
    if inst.role == "p2p":
        out.append(k8s.field_env("LMCACHE_P2P_HOST", "status.podIP"))
    elif inst.role == "decode" or engine.platform == "ascend":
        out.append(k8s.field_env("LMCACHE_PD_PEER_HOST", "status.podIP"))
    return out


WORKER_SHUTDOWN_DEADLINE_SECONDS = 30
WORKER_GRACE_SECONDS = WORKER_SHUTDOWN_DEADLINE_SECONDS + 15


def worker_command(
    pool: KVCachePool, engine: EngineSpec, tp: int, inst: InstancePorts
) -> list[str]:
    """``kvpool-worker serve``: vLLM on ascend/cuda, the reference engine on cpu.

    The worker derives vLLM's --kv-transfer-config (connector, kv_role from pd_role,
    discard_partial_chunks, skip_last_n_tokens) from the mounted LMCache config; the operator
    passes the domain facts and the instance's distinct lmcache_rpc_port identifier (rule 3).
    """
    command = [
        "kvpool-worker",
        "serve",
        "--engine",
        "reference" if engine.platform == "cpu" else "vllm",
        "--platform",
        engine.platform,
        "--model",
        pool.spec.model.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(inst.http),
        "--tensor-parallel-size",
        str(tp),
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
    if engine.args:
        command += ["--", *engine.args]
    return command


def _port_names(inst: InstancePorts) -> dict[str, int]:
    short = {
        "lmcache_worker_ports": "wrk",
        "p2p_init_ports": "p2pinit",
        "p2p_lookup_ports": "p2plkp",
        "pd_peer_init_port": "pdinit",
        "pd_peer_alloc_port": "pdalloc",
        "pd_pull_done_port": "pddone",
    }
    out = {"http": inst.http}
    for key, ports in inst.lists.items():
        for rank, port in enumerate(ports):
            out[f"{short[key]}-{rank}"] = port
    return out


def instance_objects(
    pool: KVCachePool,
    member: P2PGroup | PDPair,
    inst: InstancePorts,
    engine: EngineSpec,
    tp: int,
    mounted_config: str,
) -> list[Obj]:
    """StatefulSet (1 replica) and headless Service of one instance; ``mounted_config`` is the
    instance's LMCache YAML as mounted (its hash restarts the pod when it changes)."""
    ns = pool.metadata.namespace
    spec = member.spec
    labels = {
        **names.pool_labels(pool, "worker"),
        names.LABEL_MEMBER: member.metadata.name,
        names.LABEL_INSTANCE: inst.name,
        names.LABEL_ROLE: inst.role,
    }
    extra_limits: dict[str, str] = {}
    accelerator = engine.accelerator()
    if accelerator:
        count = engine.accelerator_count if engine.accelerator_count is not None else tp
        extra_limits[accelerator] = str(count)
    volumes: list[Obj] = [
        {
            "name": "lmcache-config",
            "configMap": {
                "name": names.lmcache_configmap_name(member),
                "items": [{"key": names.instance_config_key(inst.name), "path": "lmcache.yaml"}],
            },
        },
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[Obj] = [
        {"name": "lmcache-config", "mountPath": names.LMCACHE_CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    disk = pool.spec.tiers.disk
    if disk is not None:
        volumes.append({"name": "kv-disk", "emptyDir": {"sizeLimit": str(disk.size * tp)}})
        mounts.append({"name": "kv-disk", "mountPath": disk.path})
    container = k8s.container(
        "engine",
        engine.image or pool.spec.images.worker,
        worker_command(pool, engine, tp, inst),
        worker_env(pool, engine, inst),
        _port_names(inst),
        k8s.resources(engine.resources, extra_limits),
        # vLLM serves /health; kvpool's reference engine serves /readyz (false while draining).
        k8s.http_probe(inst.http, "/readyz" if engine.platform == "cpu" else "/health"),
    )
    container["volumeMounts"] = mounts
    pod: Obj = {
        "containers": [container],
        "volumes": volumes,
        # Longer than the worker's SIGTERM deadline (kvpool-worker --shutdown-deadline, 30 s by
        # default), so it drains, flushes stores and deregisters before the kubelet kills it.
        "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS,
        **k8s.placement(spec.placement),
    }
    if spec.host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    sts: Obj = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": k8s.meta(inst.name, ns, labels),
        "spec": {
            "replicas": 1,
            "serviceName": inst.name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(sorted(labels.items()))},
            "template": {
                "metadata": {
                    "labels": dict(sorted(labels.items())),
                    "annotations": dict(sorted(k8s.pod_annotations(pool, mounted_config).items())),
                },
                "spec": pod,
            },
        },
    }
    svc = k8s.service(inst.name, ns, labels, _port_names(inst), headless=True)
    return [sts, svc]


def member_instances(member: P2PGroup | PDPair) -> list[InstancePorts]:
    """Every instance of a member with its ports."""
    if isinstance(member, P2PGroup):
        return p2p_ports(member)
    return pd_ports(member, sender_pull=pd_sender_pull(member))


def lmcache_configs(pool: KVCachePool, member: P2PGroup | PDPair) -> dict[str, dict[str, Any]]:
    """The LMCache config of every instance, keyed by instance name."""
    fingerprint = pool_fingerprint(pool)
    out: dict[str, dict[str, Any]] = {}
    for inst in member_instances(member):
        if isinstance(member, P2PGroup):
            out[inst.name] = p2p_config(pool, member, inst, fingerprint)
        else:
            out[inst.name] = pd_config(pool, member, inst, fingerprint)
    return out


def member_objects(pool: KVCachePool, member: P2PGroup | PDPair) -> list[Obj]:
    """Every object a member owns."""
    ns = pool.metadata.namespace
    name = member.metadata.name
    base_labels = {**names.pool_labels(pool, "worker"), names.LABEL_MEMBER: name}
    configs = lmcache_configs(pool, member)
    header = (
        f"# Rendered by kvpool for {member.kind} {ns}/{name}; domain "
        f"{pool_fingerprint(pool)}. Do not edit: the operator overwrites it.\n"
    )
    data = {
        names.instance_config_key(inst): header + yaml.safe_dump(cfg, sort_keys=True)
        for inst, cfg in configs.items()
    }
    out: list[Obj] = [
        k8s.configmap(names.lmcache_configmap_name(member), ns, base_labels, data),
    ]
    for inst in member_instances(member):
        if isinstance(member, P2PGroup):
            engine, tp = member.spec.engine, member.spec.tensor_parallel_size
        else:
            role = member.spec.prefill if inst.role == "prefill" else member.spec.decode
            engine, tp = role.engine, role.tensor_parallel_size
        config = data[names.instance_config_key(inst.name)]
        out.extend(instance_objects(pool, member, inst, engine, tp, config))
    out.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": k8s.meta(name, ns, base_labels),
            "spec": {
                "selector": dict(sorted(base_labels.items())),
                "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    )
    out.append(k8s.pdb(name, ns, base_labels, 1))
    return out
