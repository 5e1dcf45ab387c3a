"""Objects of the pool itself: domain ConfigMap, controller, gateway and the Mooncake parts.

Why: these processes serve every member of the domain; they get the same PYTHONHASHSEED and
fingerprint as the workers and the same rollout hash, so a domain change restarts them too.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.derive.instances import instance_url, member_instances
from kvpool.operator.derive.platform import hashes_like_vllm, pd_bypass_ratio, pd_sender_pull
from kvpool.operator.derive.ports import p2p_ports, pd_ports
from kvpool.operator.render import election, k8s, network
from kvpool.operator.render.fingerprint import pool_fingerprint, resolve_hash_seed
from kvpool.protocol.domain import instance_id
from kvpool.protocol.gateway_config import restart_part
from kvpool.protocol.http_api import CONTROLLER_TOKEN_ENV, CONTROLLER_TOKEN_KEY, instances_body

Obj = k8s.Obj


def domain_configmap(pool: KVCachePool) -> Obj:
    """The domain's seed and fingerprint, readable by tools and people (`kubectl get cm`)."""
    spec = pool.spec
    return k8s.configmap(
        names.domain_configmap_name(pool),
        pool.metadata.namespace,
        names.pool_labels(pool, "domain"),
        {
            "PYTHONHASHSEED": resolve_hash_seed(pool),
            "KVPOOL_DOMAIN_FINGERPRINT": pool_fingerprint(pool),
            "chunkSize": str(spec.chunk_size),
            "blockSize": str(spec.block_size),
            "hashAlgorithm": spec.hash_algorithm,
            "model": spec.model.name,
            "kvDtype": spec.model.kv_dtype,
        },
    )


def instance_ids(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> list[str]:
    """The ``lmcache_instance_id`` of every instance the members render, sorted: what the
    controller lets register (and what a member's finalizer deregisters)."""
    fp = pool_fingerprint(pool)
    return sorted(instance_id(i.name, fp) for m in members for i in member_instances(m))


def controller_access(
    pool: KVCachePool, members: list[P2PGroup | PDPair], api_token: str | None
) -> list[Obj]:
    """The controller's allowlist ConfigMap (every instance id of the domain, mounted as its
    ``--instances-file``) and, when the token is given, the Secret holding its API token
    (generated once by the operator and read back from this Secret ever after)."""
    ns = pool.metadata.namespace
    labels = names.pool_labels(pool, "controller")
    allowed = k8s.config_text(instances_body(instance_ids(pool, members)))
    out = [k8s.configmap(names.controller_name(pool), ns, labels, {names.INSTANCES_KEY: allowed})]
    if api_token is not None:
        token = base64.b64encode(api_token.encode()).decode()
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": k8s.meta(names.controller_token_name(pool), ns, labels),
                "type": "Opaque",
                "data": {CONTROLLER_TOKEN_KEY: token},
            }
        )
    return out


def controller_objects(
    pool: KVCachePool,
    members: list[P2PGroup | PDPair],
    api_token: str | None = None,
    operator_namespace: str | None = None,
) -> list[Obj]:
    """Controller Deployment and Service; flags mirror lmcache_controller's (``--vllm`` when the
    domain's engines are vLLM, so its token lookups hash like them), plus the allowlist of
    instance ids it mounts and the API token it reads from the domain's Secret
    (``controller_access``), its NetworkPolicy and, with several replicas (election), a PDB
    (a node drain evicts one replica at a time: the standby takes over, warm)."""
    spec = pool.spec.controller
    ns = pool.metadata.namespace
    name = names.controller_name(pool)
    labels = names.pool_labels(pool, "controller")
    ports = spec.ports
    monitor = json.dumps(
        {"pull": ports.pull, "reply": ports.reply, "heartbeat": ports.heartbeat},
        separators=(", ", ": "),
    )
    command = [
        "kvpool-controller",
        "--host",
        "0.0.0.0",
        "--port",
        str(ports.http),
        "--monitor-ports",
        monitor,
        "--pub-port",
        str(ports.pub),
        "--snapshot-port",
        str(ports.snapshot),
        "--health-check-interval",
        str(spec.health_check_interval_seconds),
        "--lmcache-worker-timeout",
        str(spec.worker_timeout_seconds),
        "--advertise-host",
        names.service_host(name, ns),
        "--chunk-size",
        str(pool.spec.chunk_size),
        "--hash-algorithm",
        pool.spec.hash_algorithm,
        "--persistence",
        spec.persistence.mode,
        "--instances-file",
        names.CONTROLLER_INSTANCES_FILE,
    ]
    elected = election.enabled(pool)
    if elected:
        command += election.args(pool)
    if spec.persistence.redis_url:
        command += ["--redis-url", spec.persistence.redis_url]
    if hashes_like_vllm(members):
        command.append("--vllm")
    port_map = {
        "http": ports.http,
        "pull": ports.pull,
        "reply": ports.reply,
        "heartbeat": ports.heartbeat,
        "pub": ports.pub,
        "snapshot": ports.snapshot,
    }
    token_env = {
        "name": CONTROLLER_TOKEN_ENV,
        "valueFrom": {
            "secretKeyRef": {"name": names.controller_token_name(pool), "key": CONTROLLER_TOKEN_KEY}
        },
    }
    pod: Obj = {
        "containers": [
            {
                **k8s.container(
                    "controller",
                    pool.spec.images.controller,
                    command,
                    [*k8s.domain_env(pool), token_env, *(election.env() if elected else [])],
                    port_map,
                    k8s.resources(spec.resources),
                    k8s.http_probe(ports.http, "/readyz"),
                ),
                "volumeMounts": [
                    {"name": "access", "mountPath": names.CONTROLLER_CONFIG_DIR, "readOnly": True}
                ],
            }
        ],
        # The allowlist is re-read when the kubelet updates it: its changes restart nothing.
        "volumes": [{"name": "access", "configMap": {"name": name}}],
        **({"serviceAccountName": election.lease_name(pool)} if elected else {}),
        **k8s.placement(pool.spec.placement),
    }
    annotations = k8s.pod_annotations(pool)
    if api_token is not None:  # a new token (its Secret deleted) restarts the controller
        digest = hashlib.sha256(api_token.encode()).hexdigest()[:16]
        annotations[names.ANNOTATION_TOKEN] = digest
    host_network = any(m.spec.host_network for m in members)
    return [
        *controller_access(pool, members, api_token),
        *(election.objects(pool, labels) if elected else []),
        k8s.deployment(name, ns, labels, spec.replicas, pod, annotations),
        k8s.service(
            name, ns, labels, port_map, selector=election.selector(labels) if elected else None
        ),
        network.controller_policy(
            pool, name, labels, host_network=host_network, operator_namespace=operator_namespace
        ),
        *([k8s.pdb(name, ns, labels, 1)] if elected else []),
    ]


def _gateway_config(
    pool: KVCachePool,
    members: list[P2PGroup | PDPair],
    ready_pd_pairs: frozenset[str] | None = None,
) -> dict[str, Any]:
    ns = pool.metadata.namespace
    spec = pool.spec
    p2p: list[dict[str, Any]] = []
    pd: list[dict[str, Any]] = []
    for member in sorted(members, key=lambda m: (m.kind, m.metadata.name)):
        if isinstance(member, P2PGroup):
            group: dict[str, Any] = {
                "name": member.metadata.name,
                "instances": [
                    {
                        "name": inst.name,
                        "url": instance_url(inst.name, ns, inst.http),
                    }
                    for inst in p2p_ports(member)
                ],
            }
            if not member.spec.p2p:  # members never pull from each other: no peer credit
                group["p2p"] = False
            p2p.append(group)
        elif ready_pd_pairs is None or member.metadata.name in ready_pd_pairs:
            insts = pd_ports(member, sender_pull=pd_sender_pull(member))
            ratio = pd_bypass_ratio(pool, member)
            bypass = {"bypassMinCachedRatio": ratio} if ratio > 0 else {}
            pd.append(
                {
                    "name": member.metadata.name,
                    "mode": member.spec.transfer.mode,
                    "proxyPort": member.spec.proxy.port,
                    "prefill": [
                        {
                            "name": i.name,
                            "url": instance_url(i.name, ns, i.http),
                        }
                        for i in insts
                        if i.role == "prefill"
                    ],
                    "decode": [
                        {
                            "name": i.name,
                            "url": instance_url(i.name, ns, i.http),
                            "host": names.instance_pod_host(i.name, ns),
                            "initPorts": i.lists["pd_peer_init_port"],
                            "allocPorts": i.lists["pd_peer_alloc_port"],
                        }
                        for i in insts
                        if i.role == "decode"
                    ],
                    **bypass,
                }
            )
    controller_host = names.service_host(names.controller_name(pool), ns)
    return {
        "model": spec.model.name,
        "chunkSize": spec.chunk_size,
        "hashAlgorithm": spec.hash_algorithm,
        # vLLM engines seed LMCache's NONE_HASH from PYTHONHASHSEED; the reference engine
        # (platform cpu) does not import vLLM: the gateway must hash like the engines do.
        "vllm": hashes_like_vllm(members),
        # the reference engine's tokenizer ships with kvpool.protocol: the gateway tokenizes
        # locally; vLLM pools with spec.gateway.tokenizer too, without it by their workers'
        # /tokenize
        **_gateway_tokenizer(pool, members),
        "controllerUrl": names.controller_url(pool),
        "controllerPubUrl": f"tcp://{controller_host}:{spec.controller.ports.pub}",
        "controllerSnapshotUrl": f"tcp://{controller_host}:{spec.controller.ports.snapshot}",
        "routing": spec.gateway.routing.model_dump(by_alias=True),
        "p2pGroups": p2p,
        "pdPairs": pd,
    }


def _gateway_tokenizer(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> dict[str, str]:
    given = pool.spec.gateway.tokenizer
    if given is not None:
        return {"tokenizer": given.path}
    return {} if hashes_like_vllm(members) or not members else {"tokenizer": "reference"}


def gateway_objects(
    pool: KVCachePool,
    members: list[P2PGroup | PDPair],
    ready_pd_pairs: frozenset[str] | None = None,
) -> list[Obj]:
    """Gateway Deployment, Service, routing ConfigMap and PDB. The routing config lists a PD
    pair only once it is in ``ready_pd_pairs`` (prefill and decode ready, DESIGN.md rule 8);
    None (a dry run) lists every pair. A change of routing, guards, instances or ready pairs
    reaches the running gateway through its mounted file; only the rest restarts it."""
    spec = pool.spec.gateway
    ns = pool.metadata.namespace
    name = names.gateway_name(pool)
    labels = names.pool_labels(pool, "gateway")
    gateway_yaml = _gateway_config(pool, members, ready_pd_pairs)
    config = k8s.config_text(gateway_yaml)
    port_map = {"http": spec.port}
    for member in sorted(members, key=lambda m: m.metadata.name):
        if isinstance(member, PDPair):
            port_map[f"pd-{member.spec.proxy.port}"] = member.spec.proxy.port
    env_vars = k8s.domain_env(pool)
    if spec.auth_secret_ref is not None:
        env_vars.append(
            {
                "name": "KVPOOL_GATEWAY_AUTH_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": spec.auth_secret_ref.name,
                        "key": spec.auth_secret_ref.key,
                    }
                },
            }
        )
    command = [
        "kvpool-gateway",
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        str(spec.port),
        "--config",
        "/etc/kvpool/gateway/gateway.yaml",
    ]
    # The gateway applies a new routing, guards, instance list or PD pair list itself when the
    # kubelet updates the mounted file (kvpool.protocol.gateway_config): the hash that restarts
    # the pod covers only the rest of gateway.yaml, which a running gateway cannot change.
    annotations = k8s.pod_annotations(pool, k8s.config_text(restart_part(gateway_yaml)))
    mounts: list[Obj] = [{"name": "config", "mountPath": "/etc/kvpool/gateway"}]
    volumes: list[Obj] = [{"name": "config", "configMap": {"name": name}}]
    tokenizer = spec.tokenizer
    if tokenizer is not None and tokenizer.claim_name is not None:
        mounts.append({"name": "tokenizer", "mountPath": tokenizer.path, "readOnly": True})
        claim = {"claimName": tokenizer.claim_name, "readOnly": True}
        volumes.append({"name": "tokenizer", "persistentVolumeClaim": claim})
    pod: Obj = {
        "containers": [
            {
                **k8s.container(
                    "gateway",
                    pool.spec.images.gateway,
                    command,
                    env_vars,
                    port_map,
                    k8s.resources(spec.resources),
                    k8s.http_probe(spec.port, "/readyz"),
                ),
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
        **k8s.placement(pool.spec.placement),
    }
    return [
        k8s.configmap(name, ns, labels, {"gateway.yaml": config}),
        k8s.deployment(name, ns, labels, spec.replicas, pod, annotations),
        k8s.service(name, ns, labels, port_map),
        k8s.pdb(name, ns, labels, 1),
    ]


def mooncake_objects(pool: KVCachePool) -> list[Obj]:
    """Mooncake master, HTTP metadata server and the store process holding the segment."""
    remote = pool.spec.tiers.remote
    if remote is None or remote.mooncake is None:
        return []
    mc = remote.mooncake
    ns = pool.metadata.namespace
    image = pool.spec.images.mooncake
    master = names.mooncake_name(pool, "master")
    metadata = names.mooncake_name(pool, "metadata")
    store = names.mooncake_name(pool, "store")
    annotations = k8s.pod_annotations(pool)
    placement = k8s.placement(pool.spec.placement)
    out: list[Obj] = []
    parts = [
        (
            master,
            [
                "mooncake_master",
                f"--port={mc.master_port}",
                f"--eviction_high_watermark_ratio={mc.eviction_high_watermark_ratio}",
                f"--eviction_ratio={mc.eviction_ratio}",
            ],
            [],
            {"rpc": mc.master_port},
        ),
        (
            metadata,
            ["mooncake_http_metadata_server", "--host", "0.0.0.0", "--port", str(mc.metadata_port)],
            [],
            {"http": mc.metadata_port},
        ),
        (
            store,
            ["python3", "-m", "mooncake.mooncake_store_service", f"--port={mc.store_port}"],
            [
                k8s.field_env("POD_IP", "status.podIP"),
                k8s.env("MOONCAKE_LOCAL_HOSTNAME", "$(POD_IP)"),
                k8s.env("MOONCAKE_MASTER", f"{names.service_host(master, ns)}:{mc.master_port}"),
                k8s.env(
                    "MOONCAKE_TE_META_DATA_SERVER",
                    f"http://{names.service_host(metadata, ns)}:{mc.metadata_port}/metadata",
                ),
                k8s.env("MOONCAKE_GLOBAL_SEGMENT_SIZE", str(mc.segment_size)),
                k8s.env("MOONCAKE_LOCAL_BUFFER_SIZE", "0"),
                k8s.env("MOONCAKE_PROTOCOL", mc.protocol),
                k8s.env("MOONCAKE_DEVICE", mc.device_name),
            ],
            {"http": mc.store_port},
        ),
    ]
    for name, command, extra_env, ports in parts:
        labels = names.pool_labels(pool, name.removeprefix(f"{pool.metadata.name}-"))
        res = {"requests": {"memory": str(mc.segment_size)}} if name == store else {}
        pod: Obj = {
            "containers": [
                k8s.container(
                    "mooncake", image, command, k8s.domain_env(pool) + extra_env, ports, res, None
                )
            ],
            **placement,
        }
        out.append(k8s.deployment(name, ns, labels, 1, pod, annotations))
        if ports:
            out.append(k8s.service(name, ns, labels, ports))
    return out


def pool_objects(
    pool: KVCachePool,
    members: list[P2PGroup | PDPair],
    ready_pd_pairs: frozenset[str] | None = None,
    api_token: str | None = None,
    operator_namespace: str | None = None,
) -> list[Obj]:
    """Every object the pool itself owns (``ready_pd_pairs``: see gateway_objects;
    ``api_token``, ``operator_namespace``: see controller_objects)."""
    return [
        domain_configmap(pool),
        *controller_objects(pool, members, api_token, operator_namespace),
        *gateway_objects(pool, members, ready_pd_pairs),
        *mooncake_objects(pool),
    ]
