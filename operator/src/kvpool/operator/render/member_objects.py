"""Objects of a P2PGroup or PDPair: per-instance StatefulSets, Services, LMCache ConfigMap, PDB.

Why: each instance is its own single-pod StatefulSet because each has its own ports, LMCache
config and instance id; a headless Service per instance gives the pod a stable DNS name that
the LMCache config can name (p2p_host, pd_peer_host, Mooncake local_hostname). LMCache's own
loader lets env override file keys, so the pod IP (downward API) replaces the DNS name at run
time via LMCACHE_P2P_HOST / LMCACHE_PD_PEER_HOST.
"""

from __future__ import annotations

from typing import Any

from kvpool.operator.api.common import Resources
from kvpool.operator.api.members import EngineSpec, P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.derive.instances import (
    WORKER_SHUTDOWN_DEADLINE_SECONDS,
    Instance,
    instances,
    worker_command,
)
from kvpool.operator.derive.ownership import instance_configs
from kvpool.operator.derive.platform import carries_pool_tiers
from kvpool.operator.derive.ports import InstancePorts
from kvpool.operator.derive.sizing import instance_host_bytes
from kvpool.operator.quantity import parse_quantity
from kvpool.operator.render import k8s, network
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.protocol.domain import REQUIRED_WORKER_ENV

Obj = k8s.Obj


def worker_env(
    pool: KVCachePool, engine: EngineSpec, inst: InstancePorts, *, p2p: bool = True
) -> list[Obj]:
    """Rule 9 env plus the domain env (rule 1) and the pod IP for LMCache's host keys
    (``p2p``: whether a P2P-group instance pulls from its peers, i.e. has a p2p_host)."""
    out = [
        *k8s.domain_env(pool),
        *(k8s.env(name, value) for name, value in REQUIRED_WORKER_ENV.items()),
        k8s.env("LMCACHE_CONFIG_FILE", names.LMCACHE_CONFIG_FILE),
        k8s.env("KVPOOL_INSTANCE", inst.name),
        k8s.field_env("POD_IP", "status.podIP"),
    ]
    if inst.role == "p2p" and p2p:
        out.append(k8s.field_env("LMCACHE_P2P_HOST", "status.podIP"))
    elif inst.role == "decode" or engine.platform == "ascend":
        out.append(k8s.field_env("LMCACHE_PD_PEER_HOST", "status.podIP"))
    return out


WORKER_GRACE_SECONDS = WORKER_SHUTDOWN_DEADLINE_SECONDS + 15
#: The worker's ``memory_budget_bytes`` setting (``KVPOOL_WORKER_<FIELD>``): the pod's memory
#: request, exported as kvpool_worker_memory_budget_bytes for the over-budget alert.
MEMORY_BUDGET_ENV = "KVPOOL_WORKER_MEMORY_BUDGET_BYTES"


def _quantity(value: int) -> str:
    """Bytes as the shortest exact Kubernetes quantity (``4Gi``, ``1536Mi``, ``1000``)."""
    for suffix, unit in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if value and value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def worker_resources(pool: KVCachePool, member: P2PGroup | PDPair, inst: Instance) -> Obj:
    """The engine's resources plus the host memory LMCache pins in this pod (staging, CPU
    cache, PD buffers, Mooncake buffer; rule 7; none for a simulated engine, whose tiers
    allocate nothing), so the scheduler never packs more instances on a node than its memory
    holds; accelerators requested = acceleratorCount or TP."""
    lmcache = instance_host_bytes(pool, member, inst.role, inst.tp)
    spec = inst.engine.resources
    requests, limits = dict(spec.requests), dict(spec.limits)
    if lmcache:
        for table in (requests, limits) if "memory" in limits else (requests,):
            try:
                table["memory"] = _quantity(parse_quantity(table.get("memory", 0)) + lmcache)
            except ValueError:  # refused by validation (rules_domain.model_relations)
                continue
    extra: dict[str, str] = {}
    accelerator = inst.engine.accelerator()
    if accelerator:
        count = inst.engine.accelerator_count
        extra[accelerator] = str(count if count is not None else inst.tp)
    return k8s.resources(Resources(requests=requests, limits=limits), extra)


def memory_budget_env(resources: Obj) -> list[Obj]:
    """The pod's memory request in bytes for the worker to export (none without a request)."""
    request = resources.get("requests", {}).get("memory")
    return [] if request is None else [k8s.env(MEMORY_BUDGET_ENV, str(parse_quantity(request)))]


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
    if inst.kv_events is not None:  # port names are at most 15 characters
        out["kv-events"], out["kv-replay"] = inst.kv_events
    return out


def _volumes(
    pool: KVCachePool, member: P2PGroup | PDPair, instance: Instance
) -> tuple[list[Obj], list[Obj]]:
    """The pod's volumes and the engine's mounts of them: the instance's LMCache config,
    ``/dev/shm``, and the disk tier (its size for every TP rank) when the pool has one and the
    member carries it (``platform.carries_pool_tiers``)."""
    name = instance.ports.name
    volumes: list[Obj] = [
        {
            "name": "lmcache-config",
            "configMap": {
                "name": names.lmcache_configmap_name(member),
                "items": [{"key": names.instance_config_key(name), "path": "lmcache.yaml"}],
            },
        },
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[Obj] = [
        {"name": "lmcache-config", "mountPath": names.LMCACHE_CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    disk = pool.spec.tiers.disk
    if disk is not None and carries_pool_tiers(member):
        volumes.append({"name": "kv-disk", "emptyDir": {"sizeLimit": str(disk.size * instance.tp)}})
        mounts.append({"name": "kv-disk", "mountPath": disk.path})
    return volumes, mounts


def worker_container(
    pool: KVCachePool, member: P2PGroup | PDPair, instance: Instance, mounts: list[Obj]
) -> Obj:
    """The engine container of one instance: command, env, named ports, resources (with the
    memory LMCache pins), readiness probe and ``mounts``."""
    inst, engine = instance.ports, instance.engine
    resources = worker_resources(pool, member, instance)
    container = k8s.container(
        "engine",
        engine.image or pool.spec.images.worker,
        worker_command(pool, instance),
        [
            *worker_env(pool, engine, inst, p2p=isinstance(member, P2PGroup) and member.spec.p2p),
            *memory_budget_env(resources),
        ],
        _port_names(inst),
        resources,
        # vLLM serves /health; kvpool's reference engine serves /readyz (false while draining).
        k8s.http_probe(inst.http, "/readyz" if engine.platform == "cpu" else "/health"),
    )
    container["volumeMounts"] = mounts
    return container


def instance_objects(
    pool: KVCachePool,
    member: P2PGroup | PDPair,
    instance: Instance,
    mounted_config: str,
) -> list[Obj]:
    """StatefulSet (1 replica) and headless Service of one instance; ``mounted_config`` is the
    instance's LMCache YAML as mounted (its hash restarts the pod when it changes)."""
    ns = pool.metadata.namespace
    spec = member.spec
    inst = instance.ports
    labels = {
        **names.pool_labels(pool, "worker"),
        names.LABEL_MEMBER: member.metadata.name,
        names.LABEL_INSTANCE: inst.name,
        names.LABEL_ROLE: inst.role,
    }
    volumes, mounts = _volumes(pool, member, instance)
    pod: Obj = {
        "containers": [worker_container(pool, member, instance, mounts)],
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


def lmcache_configs(pool: KVCachePool, member: P2PGroup | PDPair) -> dict[str, dict[str, Any]]:
    """The LMCache config of every instance, keyed by instance name."""
    return instance_configs(pool, member, pool_fingerprint(pool))


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
        names.instance_config_key(inst): header + k8s.config_text(cfg)
        for inst, cfg in configs.items()
    }
    out: list[Obj] = [
        k8s.configmap(names.lmcache_configmap_name(member), ns, base_labels, data),
    ]
    for instance in instances(member):
        config = data[names.instance_config_key(instance.name)]
        out.extend(instance_objects(pool, member, instance, config))
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
    out.append(network.worker_policy(pool, name, base_labels))
    return out
