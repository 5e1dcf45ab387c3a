"""ChartValues: the Helm chart's values, modelled so values.schema.json is generated, not typed.

Why: a typo in a Helm values file is otherwise silently ignored; generating the schema from a
strict model (additionalProperties: false everywhere) makes `helm install` reject it. The
chart's values.yaml is generated from the same defaults (``python -m kvpool.operator.gen``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvpool.operator.api.common import ApiModel, Resources, Toleration

# The operator process's ports (kvpool.operator.runtime.permissions defines them for the
# runtime; the chart test checks both agree, the api package stays free of the runtime).
HEALTH_PORT = 8080
METRICS_PORT = 8081
WEBHOOK_PORT = 9443


class OperatorImage(ApiModel):
    """The operator image."""

    repository: str = Field(default="ghcr.io/kvpool/operator", description="Image repository.")
    tag: str = Field(default="0.1.0", description="Image tag. Default 0.1.0.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Default IfNotPresent."
    )


class CertManager(ApiModel):
    """cert-manager issues the webhook's serving certificate (webhook.certMode cert-manager)."""

    issuer_ref: dict[str, str] = Field(
        default_factory=dict,
        description="An existing Issuer/ClusterIssuer ({name, kind}); empty: the chart creates "
        "a self-signed Issuer.",
    )
    duration: str = Field(default="8760h", description="Certificate lifetime. Default 8760h.")


class Webhook(ApiModel):
    """The validating admission webhook (runs the same validation as the CLI)."""

    enabled: bool = Field(default=True, description="Default true.")
    port: int = Field(default=WEBHOOK_PORT, ge=1, le=65535, description="Default 9443.")
    cert_mode: Literal["self-signed", "cert-manager"] = Field(
        default="self-signed",
        description="self-signed: the operator generates its CA and serving certificate and "
        "writes the ValidatingWebhookConfiguration kvpool.io itself; cert-manager: the chart "
        "templates a Certificate and the ValidatingWebhookConfiguration, cert-manager injects "
        "the CA. Default self-signed.",
    )
    failure_policy: Literal["Fail", "Ignore"] = Field(
        default="Fail", description="cert-manager mode: the webhooks' failurePolicy. Default Fail."
    )
    timeout_seconds: int = Field(default=10, ge=1, le=30, description="Default 10.")
    cert_manager: CertManager = Field(default_factory=CertManager)


class ServiceMonitor(ApiModel):
    """A Prometheus Operator ServiceMonitor for the metrics Service."""

    enabled: bool = Field(default=False, description="Default false (needs the CRD).")
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Default 30s.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels (e.g. release: prometheus)."
    )


class Metrics(ApiModel):
    """Prometheus metrics of reconciles, errors and durations."""

    port: int = Field(default=METRICS_PORT, ge=1, le=65535, description="Default 8081.")
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor)


class DomainServiceMonitors(ServiceMonitor):
    """ServiceMonitors for the controller, gateway and workers of every cache domain in the
    watched namespaces (kvpool.operator.monitoring.scrape)."""

    interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Default 15s.")


class PrometheusRuleValues(ApiModel):
    """The domains' alerts as a PrometheusRule (charts/kvpool/monitoring/alerts.yaml)."""

    enabled: bool = Field(default=False, description="Default false (needs the CRD).")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels (e.g. release: prometheus)."
    )


class Dashboards(ApiModel):
    """Grafana dashboards as ConfigMaps for Grafana's dashboard sidecar."""

    enabled: bool = Field(default=False, description="Default false.")
    namespace: str = Field(
        default="",
        description="Where the ConfigMaps go (the sidecar's namespace); default: "
        "the release namespace.",
    )
    labels: dict[str, str] = Field(
        default_factory=lambda: {"grafana_dashboard": "1"},
        description='Labels the sidecar selects on. Default grafana_dashboard: "1".',
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="e.g. grafana_folder: kvpool."
    )


class Monitoring(ApiModel):
    """Monitoring of the cache domains the operator runs (kvpool.operator.monitoring)."""

    service_monitors: DomainServiceMonitors = Field(default_factory=DomainServiceMonitors)
    prometheus_rule: PrometheusRuleValues = Field(default_factory=PrometheusRuleValues)
    dashboards: Dashboards = Field(default_factory=Dashboards)


class NetworkPolicies(ApiModel):
    """A NetworkPolicy for the operator's pod (its webhook, metrics and health ports only).

    The cache domains' own policies (controller and worker ports reachable from their
    namespace only) are rendered by the operator with each pool and member."""

    enabled: bool = Field(default=True, description="Default true.")


class ServiceAccount(ApiModel):
    """The operator's ServiceAccount."""

    create: bool = Field(default=True, description="Default true.")
    name: str = Field(default="", description="Default: the release's full name.")


def _default_resources() -> Resources:
    return Resources(requests={"cpu": "100m", "memory": "128Mi"}, limits={"memory": "512Mi"})


class ChartValues(ApiModel):
    """Values of the kvpool Helm chart."""

    image: OperatorImage = Field(default_factory=OperatorImage)
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secret names.")
    replicas: int = Field(
        default=1,
        ge=0,
        le=1,
        description="0 or 1: the operator runs standalone (no kopf peering); a second replica "
        "would reconcile every resource twice.",
    )
    watch_namespaces: list[str] = Field(
        default_factory=list,
        description="Namespaces to watch (Roles there); empty: all (a ClusterRole).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Default INFO."
    )
    log_format: Literal["json", "text"] = Field(default="json", description="Default json.")
    drift_interval_seconds: float = Field(
        default=30.0, gt=0, description="Seconds between drift checks of each pool. Default 30."
    )
    figures_interval_seconds: float = Field(
        default=30.0,
        ge=0,
        description="Seconds between reads of each pool's controller and gateway for the live "
        "figures in status (status.live, columns INSTANCES and HIT); 0 turns them off. Default 30.",
    )
    health_port: int = Field(
        default=HEALTH_PORT, ge=1, le=65535, description="/healthz and /readyz. Default 8080."
    )
    webhook: Webhook = Field(default_factory=Webhook)
    metrics: Metrics = Field(default_factory=Metrics)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    network_policies: NetworkPolicies = Field(default_factory=NetworkPolicies)
    service_account: ServiceAccount = Field(default_factory=ServiceAccount)
    resources: Resources = Field(default_factory=_default_resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
