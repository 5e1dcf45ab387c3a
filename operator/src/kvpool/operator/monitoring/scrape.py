"""What Prometheus scrapes in a cache domain, defined once: the chart's ServiceMonitors and the
scrape configuration ``kvpool-operator up --monitoring`` hands a local Prometheus.

Why one definition with two outputs: a ServiceMonitor is only a request to the Prometheus
Operator, which turns it into relabelling rules over Kubernetes service discovery. The local
run writes those same rules into ``prometheus.yml`` and gives each local target the
``__meta_kubernetes_*`` labels Kubernetes discovery would give it (from the rendered Services
and the pods they select), so the real Prometheus applies the chart's selectors and label
rules itself: the member Service is dropped because it lacks ``kvpool.io/instance``, a
worker's ``instance`` label becomes its kvpool instance name, exactly as in a cluster.

Why ServiceMonitors in the chart and not one set per domain from the operator: they select by
the labels every domain's Services carry (``app.kubernetes.io/managed-by: kvpool-operator``
and ``kvpool.io/component``), so three objects cover every domain in the watched namespaces,
the operator needs no RBAC on ``monitoring.coreos.com`` nor that CRD to exist, and a domain
is scraped from its first Service on without a reconcile. The domain's labels become target
labels (``pool``, and for workers ``instance``, ``member``, ``role``).

The implicit rules follow the Prometheus Operator's generator (``pkg/prometheus/promcfg.go``:
keep by selector and port name, then ``namespace``, ``service``, ``pod``, ``container``,
``job``, ``endpoint``, then the endpoint's own ``relabelings``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvpool.operator.derive.names import (
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MEMBER,
    LABEL_POOL,
    LABEL_ROLE,
    MANAGED_BY,
)
from kvpool.operator.local.plan import selects

Obj = dict[str, Any]
META = "__meta_kubernetes_"
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def sanitize(label: str) -> str:
    """A Kubernetes label key as Prometheus service discovery names it."""
    return _UNSAFE.sub("_", label)


def service_label(key: str) -> str:
    return f"{META}service_label_{sanitize(key)}"


def service_label_present(key: str) -> str:
    return f"{META}service_labelpresent_{sanitize(key)}"


@dataclass(frozen=True)
class Relabel:
    """One relabelling rule (Prometheus ``relabel_config``)."""

    target: str | None
    sources: tuple[str, ...] = ()
    regex: str = "(.*)"
    replacement: str = "$1"
    action: str = "replace"

    def prometheus(self) -> Obj:
        """As in prometheus.yml."""
        out: Obj = {"action": self.action}
        if self.sources:
            out["source_labels"] = list(self.sources)
        if self.regex != "(.*)":
            out["regex"] = self.regex
        if self.action == "replace":
            out["target_label"] = self.target
            out["replacement"] = self.replacement
        return out

    def operator(self) -> Obj:
        """As a ServiceMonitor endpoint's ``relabelings`` item (the operator's field names)."""
        p = self.prometheus()
        names = {"source_labels": "sourceLabels", "target_label": "targetLabel"}
        return {names.get(k, k): v for k, v in p.items()}


def _copy(label: str, target: str) -> Relabel:
    return Relabel(target, (service_label(label),))


@dataclass(frozen=True)
class ScrapeJob:
    """The scrape of one component of every domain (one ServiceMonitor)."""

    component: str
    honor_labels: bool = False
    require: tuple[str, ...] = ()  # Service labels that must be present
    relabel: tuple[Relabel, ...] = ()
    port: str = "http"
    path: str = "/metrics"
    doc: str = ""
    match_labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The ``job`` label of its series."""
        return f"kvpool-{self.component}"

    @property
    def selector(self) -> Obj:
        labels = {**MANAGED_BY, LABEL_COMPONENT: self.component, **self.match_labels}
        out: Obj = {"matchLabels": labels}
        if self.require:
            out["matchExpressions"] = [{"key": k, "operator": "Exists"} for k in self.require]
        return out

    def relabelings(self) -> list[Relabel]:
        """The endpoint's own rules: the domain and the job name, then the component's."""
        return [
            _copy(LABEL_POOL, "pool"),
            Relabel("job", (), replacement=self.name),
            *self.relabel,
        ]


JOBS: tuple[ScrapeJob, ...] = (
    ScrapeJob("controller", doc="The domain's KV controller (its HTTP port serves /metrics)."),
    ScrapeJob(
        "gateway",
        honor_labels=True,
        doc="The gateway's replicas. Its series name the kvpool instance they are about in "
        "their own ``instance`` label, which honorLabels keeps (a series without one gets "
        "the target's address).",
    ),
    ScrapeJob(
        "worker",
        require=(LABEL_INSTANCE,),
        relabel=(
            _copy(LABEL_INSTANCE, "instance"),
            _copy(LABEL_MEMBER, "member"),
            _copy(LABEL_ROLE, "role"),
        ),
        doc="Each instance through its own headless Service (the member Service, which selects "
        "all of them, lacks kvpool.io/instance): ``instance`` is the kvpool instance name, as "
        "in the gateway's series.",
    ),
)


# --------------------------------------------------------------------------- the operator's rules
def implicit_relabels(job: ScrapeJob) -> list[Relabel]:
    """What the Prometheus Operator puts before an endpoint's own ``relabelings``."""
    out: list[Relabel] = []
    for key, value in job.selector["matchLabels"].items():
        out.append(
            Relabel(
                None,
                (service_label(key), service_label_present(key)),
                f"({re.escape(value)});true",
                action="keep",
            )
        )
    for key in job.require:
        out.append(Relabel(None, (service_label_present(key),), "true", action="keep"))
    out += [
        Relabel(None, (f"{META}endpoint_port_name",), re.escape(job.port), action="keep"),
        Relabel(
            "pod",
            (f"{META}endpoint_address_target_kind", f"{META}endpoint_address_target_name"),
            "Pod;(.*)",
        ),
        Relabel("namespace", (f"{META}namespace",)),
        Relabel("service", (f"{META}service_name",)),
        Relabel("pod", (f"{META}pod_name",)),
        Relabel("container", (f"{META}pod_container_name",)),
        Relabel("job", (f"{META}service_name",)),
        Relabel("endpoint", (), replacement=job.port),
    ]
    return out


# --------------------------------------------------------------------------- chart
SERVICE_MONITORS_PATH = "charts/kvpool/templates/domain-servicemonitors.yaml"
_INTERVAL = "__interval__"


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def service_monitor_spec(job: ScrapeJob, interval: str) -> Obj:
    """A ServiceMonitor's ``selector`` and ``endpoints`` (the namespace selector is the
    chart's: the watched namespaces)."""
    endpoint: Obj = {"port": job.port, "path": job.path, "interval": interval}
    if job.honor_labels:
        endpoint["honorLabels"] = True
    endpoint["relabelings"] = [r.operator() for r in job.relabelings()]
    return {"selector": job.selector, "endpoints": [endpoint]}


def service_monitors_template(header: str) -> str:
    """The chart template: one ServiceMonitor per job, when monitoring.serviceMonitors.enabled."""
    parts = [header, "{{- if .Values.monitoring.serviceMonitors.enabled }}\n"]
    for job in JOBS:
        spec = yaml.safe_dump(service_monitor_spec(job, _INTERVAL), sort_keys=False)
        spec = spec.replace(_INTERVAL, "{{ .Values.monitoring.serviceMonitors.interval }}")
        parts.append(
            "---\n"
            "apiVersion: monitoring.coreos.com/v1\n"
            "kind: ServiceMonitor\n"
            "metadata:\n"
            f'  name: {{{{ include "kvpool.fullname" . }}}}-{job.component}s\n'
            "  namespace: {{ .Release.Namespace }}\n"
            "  labels:\n"
            '    {{- include "kvpool.labels" . | nindent 4 }}\n'
            "    {{- with .Values.monitoring.serviceMonitors.labels }}\n"
            "    {{- toYaml . | nindent 4 }}\n"
            "    {{- end }}\n"
            "spec:\n"
            "  namespaceSelector:\n"
            "    {{- if .Values.watchNamespaces }}\n"
            "    matchNames:\n"
            "      {{- toYaml .Values.watchNamespaces | nindent 6 }}\n"
            "    {{- else }}\n"
            "    any: true\n"
            "    {{- end }}\n" + _indent(spec, 2)
        )
    parts.append("{{- end }}\n")
    return "".join(parts)


# --------------------------------------------------------------------------- local Prometheus
def _pods(objects: Sequence[Obj]) -> list[tuple[str, Obj]]:
    """(pod name, workload) of every Deployment (one local replica, named after it) and
    StatefulSet (``<name>-0``: kvpool's are single-pod)."""
    out = []
    for o in objects:
        if o.get("kind") == "StatefulSet":
            out.append((f"{o['metadata']['name']}-0", o))
        elif o.get("kind") == "Deployment":
            out.append((o["metadata"]["name"], o))
    return out


def discovered_targets(objects: Sequence[Obj], local_port: Mapping[int, int]) -> list[Obj]:
    """What Kubernetes endpoints discovery would list for the rendered Services, each pod's
    container port mapped to its local port: one static target per (Service port, pod) with
    the ``__meta_kubernetes_*`` labels the relabelling rules read."""
    out: list[Obj] = []
    for svc in (o for o in objects if o.get("kind") == "Service"):
        meta, spec = svc["metadata"], svc["spec"]
        selector = spec.get("selector") or {}
        for pod, workload in _pods(objects):
            # the controller Service selects its leader by the label the elected replica sets
            # on its own pod; locally its port reaches the leader as the endpoints would
            if not selector or not selects(selector, workload):
                continue
            template = workload["spec"]["template"]
            (container,) = template["spec"]["containers"]
            by_name = {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}
            for port in spec.get("ports", []):
                target = port.get("targetPort", port["port"])
                number = by_name.get(target) if isinstance(target, str) else int(target)
                if number is None or number not in local_port:
                    continue
                labels = {
                    f"{META}namespace": meta.get("namespace", "default"),
                    f"{META}service_name": meta["name"],
                    f"{META}endpoint_port_name": port.get("name", ""),
                    f"{META}endpoint_address_target_kind": "Pod",
                    f"{META}endpoint_address_target_name": pod,
                    f"{META}pod_name": pod,
                    f"{META}pod_container_name": container["name"],
                }
                for key, value in meta.get("labels", {}).items():
                    labels[service_label(key)] = value
                    labels[service_label_present(key)] = "true"
                out.append({"targets": [f"127.0.0.1:{local_port[number]}"], "labels": labels})
    return out


def prometheus_config(
    objects: Sequence[Obj],
    local_port: Mapping[int, int],
    interval: str,
    rule_files: Sequence[str] = (),
) -> Obj:
    """prometheus.yml for a local domain: one job per ServiceMonitor, its rules the operator's
    and the chart's, over the targets discovery would give."""
    targets = discovered_targets(objects, local_port)
    jobs = []
    for job in JOBS:
        relabels = implicit_relabels(job) + job.relabelings()
        scrape: Obj = {
            "job_name": f"serviceMonitor/{job.name}/0",
            "honor_labels": job.honor_labels,
            "scrape_interval": interval,
            "metrics_path": job.path,
            "static_configs": targets,
            "relabel_configs": [r.prometheus() for r in relabels],
        }
        jobs.append(scrape)
    out: Obj = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }
    if rule_files:
        out["rule_files"] = list(rule_files)
    return out
