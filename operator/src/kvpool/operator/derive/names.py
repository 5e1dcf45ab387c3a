"""Names, labels and in-cluster addresses of everything the operator renders.

Why: the controller address in a worker's LMCache config, the Service the renderer creates and
the status endpoint must be spelled identically; one module spells them.
"""

from __future__ import annotations

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool

#: Who manages an object (the Kubernetes recommended label), and the value kvpool's carry: what
#: the operator lists, prunes and watches, and the chart's ServiceMonitors select.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "kvpool-operator"
MANAGED_BY = {LABEL_MANAGED_BY: MANAGER}
LABEL_POOL = "kvpool.io/pool"
LABEL_COMPONENT = "kvpool.io/component"
LABEL_MEMBER = "kvpool.io/member"
LABEL_INSTANCE = "kvpool.io/instance"
LABEL_ROLE = "kvpool.io/role"
ANNOTATION_ROLLOUT = "kvpool.io/domain-rollout-hash"
ANNOTATION_FINGERPRINT = "kvpool.io/domain-fingerprint"
ANNOTATION_CONFIG = "kvpool.io/config-hash"  # the mounted config: a change restarts the pod

ANNOTATION_TOKEN = "kvpool.io/api-token-hash"  # a new controller API token restarts it

LMCACHE_CONFIG_DIR = "/etc/kvpool/lmcache"
LMCACHE_CONFIG_FILE = f"{LMCACHE_CONFIG_DIR}/lmcache.yaml"
#: The controller's allowlist of instance ids (its ConfigMap, mounted; --instances-file).
CONTROLLER_CONFIG_DIR = "/etc/kvpool/controller"
INSTANCES_KEY = "instances.yaml"
CONTROLLER_INSTANCES_FILE = f"{CONTROLLER_CONFIG_DIR}/{INSTANCES_KEY}"


def controller_name(pool: KVCachePool) -> str:
    """Deployment and Service name of the pool's controller."""
    return f"{pool.metadata.name}-controller"


def controller_token_name(pool: KVCachePool) -> str:
    """Secret holding the domain's controller API token (the operator generates it once)."""
    return f"{pool.metadata.name}-controller-token"


def gateway_name(pool: KVCachePool) -> str:
    """Deployment and Service name of the pool's gateway."""
    return f"{pool.metadata.name}-gateway"


def domain_configmap_name(pool: KVCachePool) -> str:
    """ConfigMap holding the domain seed and fingerprint."""
    return f"{pool.metadata.name}-domain"


def mooncake_name(pool: KVCachePool, part: str) -> str:
    """Name of a Mooncake part: master, metadata or store."""
    return f"{pool.metadata.name}-mooncake-{part}"


def service_host(name: str, namespace: str) -> str:
    """The cluster DNS name of a Service."""
    return f"{name}.{namespace}.svc"


def instance_pod_host(instance: str, namespace: str) -> str:
    """Stable DNS name of an instance's pod (StatefulSet pod 0 behind its headless Service)."""
    return f"{instance}-0.{instance}.{namespace}.svc"


def controller_url(pool: KVCachePool) -> str:
    """The controller's HTTP API inside the cluster (gateway config, status endpoint)."""
    host = service_host(controller_name(pool), pool.metadata.namespace)
    return f"http://{host}:{pool.spec.controller.ports.http}"


def gateway_url(pool: KVCachePool) -> str:
    """The gateway's OpenAI endpoint inside the cluster."""
    host = service_host(gateway_name(pool), pool.metadata.namespace)
    return f"http://{host}:{pool.spec.gateway.port}"


def lmcache_configmap_name(member: P2PGroup | PDPair) -> str:
    """ConfigMap with one LMCache YAML per instance, key ``<instance>.yaml``."""
    return f"{member.metadata.name}-lmcache"


def instance_config_key(instance: str) -> str:
    """Key of an instance's LMCache YAML in the member's ConfigMap."""
    return f"{instance}.yaml"


def pool_labels(pool: KVCachePool, component: str) -> dict[str, str]:
    """Labels every object of the pool carries."""
    return {
        "app.kubernetes.io/name": "kvpool",
        **MANAGED_BY,
        LABEL_POOL: pool.metadata.name,
        LABEL_COMPONENT: component,
    }
