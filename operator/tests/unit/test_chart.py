"""The Helm chart, rendered and linted with the real Helm library (helm-python-sdk: Helm v4's Go
SDK behind a C ABI, no helm binary), with the default values and every values file in
charts/kvpool/ci/. Every rendered object is checked with kubernetes-validate --strict (the
cert-manager and Prometheus Operator kinds, whose schemas it does not ship, structurally);
values are checked against the generated values.schema.json, so a typo is refused.

No API server runs here: whether the operator starts from these manifests is covered by the
runtime's own tests (its settings parse the rendered args below) and by e2e against kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import op_builders
import pytest
import yaml
from op_builders import EXAMPLES, REPO

from kvpool.operator.api import chart as chart_api
from kvpool.operator.loader import load_text
from kvpool.operator.render import network, render_domain
from kvpool.operator.runtime import permissions
from kvpool.operator.runtime.settings import OperatorSettings

CHART = REPO / "charts" / "kvpool"
VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))
CASES = [("default", {})] + [(p.stem, yaml.safe_load(p.read_text())) for p in VALUES_FILES]
NAMESPACE = "kvpool-system"
#: Kinds from CRDs kubernetes-validate has no schema for: checked structurally instead.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"}


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(CHART)
    manifests = chart.render(values, name="kvpool", namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


@pytest.mark.parametrize(("case", "values"), CASES, ids=[c for c, _ in CASES])
def test_chart_renders_valid_objects_and_lints_clean(case: str, values: dict[str, Any]) -> None:
    helm.Chart.load(CHART).validate_schema(values)
    docs = _render(values)
    assert {"Deployment", "ClusterRole", "ClusterRoleBinding", "Service"} <= {
        d["kind"] for d in docs
    }
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"].count("/") == 1 and doc["metadata"]["name"] and doc["spec"]
            continue
        kubernetes_validate.validate(doc, "1.33", strict=True)
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_crds_are_the_generated_ones_and_valid() -> None:
    """Helm installs crds/ before the templates; they are the generated CRDs, byte for byte."""
    crds = {Path(c["name"]).name: c["data"] for c in helm.Chart.load(CHART).crds}
    generated = {p.name: p.read_text() for p in sorted((REPO / "crds").glob("*.yaml"))}
    assert crds == generated
    for text in crds.values():
        kubernetes_validate.validate(yaml.safe_load(text), "1.33", strict=True)


@pytest.mark.parametrize(
    "values",
    [
        {"webhok": {"enabled": False}},
        {"webhook": {"certmode": "cert-manager"}},
        {"webhook": {"certMode": "vault"}},
        {"replicas": 2},
        {"metrics": {"serviceMonitor": {"interval": "often"}}},
    ],
    ids=["top-level-typo", "nested-typo", "bad-enum", "two-replicas", "bad-interval"],
)
def test_a_typo_in_values_is_refused_by_the_schema(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        helm.Chart.load(CHART).validate_schema(values)
    with pytest.raises(helm.HelmValuesError):
        _render(values)


def _granted(docs: list[dict[str, Any]], kind: str) -> set[tuple[str, str, str, str]]:
    out: set[tuple[str, str, str, str]] = set()
    for doc in docs:
        if doc["kind"] != kind:
            continue
        where = doc["metadata"].get("namespace", "")
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out |= {(where, group, resource, verb) for verb in rule["verbs"]}
    return out


def _used(scope: str, where: str, *, self_signed: bool) -> set[tuple[str, str, str, str]]:
    return {
        (where, p.group, p.resource, verb)
        for p in permissions.PERMISSIONS
        if p.scope == scope and (self_signed or p.resource != "validatingwebhookconfigurations")
        for verb in p.verbs
    }


def test_cluster_role_grants_exactly_what_the_handlers_use() -> None:
    docs = _render({})
    expected = _used("cluster", "", self_signed=True) | _used("namespaced", "", self_signed=True)
    assert _granted(docs, "ClusterRole") == expected
    assert not [d for d in docs if d["kind"] == "Role"]
    binding = _one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvpool-operator", "namespace": NAMESPACE}
    ]


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_cluster_rules_only() -> None:
    docs = _render({"watchNamespaces": ["llm", "team-b"], "webhook": {"certMode": "cert-manager"}})
    assert _granted(docs, "ClusterRole") == _used("cluster", "", self_signed=False)
    roles = _used("namespaced", "llm", self_signed=False)
    roles |= _used("namespaced", "team-b", self_signed=False)
    assert _granted(docs, "Role") == roles
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"} == {
        "llm",
        "team-b",
    }


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][
        0
    ]
    return container


@pytest.mark.parametrize(("case", "values"), CASES, ids=[c for c, _ in CASES])
def test_operator_args_are_what_kvpool_operator_run_accepts(
    case: str, values: dict[str, Any]
) -> None:
    """The runtime's own settings class parses the rendered command line (no drift)."""
    docs = _render(values)
    container = _container(docs)
    assert container["command"] == permissions.COMMAND
    settings = OperatorSettings(_cli_parse_args=container["args"])
    merged = helm.Chart.load(CHART).merge_values(values)
    assert settings.health_port == merged["healthPort"]
    assert settings.metrics_port == merged["metrics"]["port"]
    assert settings.webhook_port == merged["webhook"]["port"]
    assert settings.namespace == merged["watchNamespaces"]
    expected_mode = merged["webhook"]["certMode"] if merged["webhook"]["enabled"] else "none"
    assert settings.webhook_mode == expected_mode
    assert settings.webhook_cert_dir == permissions.WEBHOOK_CERT_DIR
    if expected_mode != "none":
        service = _one(docs, "Service", settings.webhook_service)
        assert settings.webhook_namespace == service["metadata"]["namespace"] == NAMESPACE
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == settings.health_port and ports["metrics"] == settings.metrics_port


def test_chart_port_defaults_match_the_runtime() -> None:
    assert chart_api.HEALTH_PORT == permissions.HEALTH_PORT
    assert chart_api.METRICS_PORT == permissions.METRICS_PORT
    assert chart_api.WEBHOOK_PORT == permissions.WEBHOOK_PORT


def test_operator_pod_is_hardened_with_probes_and_resources() -> None:
    docs = _render({})
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    container = _container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # The self-signed certificates are written under the writable /tmp emptyDir.
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert permissions.WEBHOOK_CERT_DIR.startswith("/tmp/") and "/tmp" in mounts


def test_self_signed_mode_leaves_the_webhook_configuration_to_the_operator() -> None:
    docs = _render({})
    assert not [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    assert _one(docs, "Service", "kvpool-operator-webhook")["spec"]["ports"][0]["port"] == 443


def test_cert_manager_mode_wires_certificate_and_webhooks_to_the_handlers_paths() -> None:
    docs = _render({"webhook": {"certMode": "cert-manager"}})
    vwc = _one(docs, "ValidatingWebhookConfiguration", permissions.WEBHOOK_CONFIGURATION)
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/kvpool-operator-webhook"
    )
    paths = {
        w["rules"][0]["resources"][0]: w["clientConfig"]["service"]["path"] for w in vwc["webhooks"]
    }
    assert paths == {
        "kvcachepools": permissions.WEBHOOK_PATHS["KVCachePool"],
        "p2pgroups": permissions.WEBHOOK_PATHS["P2PGroup"],
        "pdpairs": permissions.WEBHOOK_PATHS["PDPair"],
    }
    cert = _one(docs, "Certificate")
    assert "kvpool-operator-webhook.kvpool-system.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"name": "kvpool-operator-webhook", "kind": "Issuer"}
    _one(docs, "Issuer")
    volumes = _one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"secretName": cert["spec"]["secretName"]} in [v.get("secret") for v in volumes]


def test_network_policies_admit_the_domain_and_the_operator_only() -> None:
    """The chart's policy guards the operator pod; the operator renders each domain's policies
    (controller and workers: the domain's own pods; the operator's pods on the controller's
    HTTP API), whose peers match exactly the labels of the domain's pods and of the chart's
    operator pod."""
    docs = _render({})
    chart_policy = _one(docs, "NetworkPolicy")
    operator_pod = _one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert chart_policy["spec"]["podSelector"]["matchLabels"].items() <= operator_pod.items()
    assert {p["port"] for p in chart_policy["spec"]["ingress"][0]["ports"]} == {8080, 8081, 9443}
    assert network.OPERATOR_POD_LABELS.items() <= operator_pod.items()

    domain = load_text((EXAMPLES / "cpu-demo.yaml").read_text(), "cpu-demo").domains()[0]
    objects = render_domain(domain.pool, domain.members, operator_namespace=NAMESPACE)
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {"demo-controller", "demo-p2p", "demo-pd"}
    pods = [
        o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    ]

    def matched(selector: dict[str, Any]) -> list[str]:
        want = selector["matchLabels"].items()
        return sorted({p["kvpool.io/component"] for p in pods if want <= p.items()})

    assert matched(policies["demo-controller"]["spec"]["podSelector"]) == ["controller"]
    for name in ("demo-p2p", "demo-pd"):
        assert matched(policies[name]["spec"]["podSelector"]) == ["worker"]
    domain_pods = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/managed-by": "kvpool-operator",
                "app.kubernetes.io/name": "kvpool",
                "kvpool.io/pool": "demo",
            }
        }
    }
    # every pod of the domain (the gateway among them), and no other pod of the namespace
    assert matched(domain_pods["podSelector"]) == ["controller", "gateway", "worker"]
    for policy in policies.values():
        assert policy["spec"]["ingress"][0] == {"from": [domain_pods]}
    assert policies["demo-controller"]["spec"]["ingress"][1:] == [
        {
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}
                    },
                    "podSelector": {"matchLabels": network.OPERATOR_POD_LABELS},
                }
            ],
            "ports": [{"port": 9000, "protocol": "TCP"}],
        }
    ]
    for name in ("demo-p2p", "demo-pd"):
        assert len(policies[name]["spec"]["ingress"]) == 1  # the operator has no business there
    # the gateway is the front door: no policy selects it
    assert all(
        not {"kvpool.io/component": "gateway"}.items()
        >= p["spec"]["podSelector"]["matchLabels"].items()
        for p in policies.values()
    )


def test_host_network_members_open_the_worker_facing_controller_ports_only() -> None:
    """A hostNetwork worker reaches the controller from its node's address, which no pod
    selector matches: the controller's pull, reply and heartbeat ports admit any source then
    (the allowlist of instance ids guards registration); its HTTP API, PUB and snapshot ports
    do not. Without a known operator namespace, the operator peer is any namespace."""
    the_pool = op_builders.pool()
    objects = render_domain(the_pool, [op_builders.p2p(hostNetwork=True)])
    ctl = next(
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "pool-controller"
    )
    ports = the_pool.spec.controller.ports
    assert ctl["spec"]["ingress"][1]["from"][0]["namespaceSelector"] == {}
    assert ctl["spec"]["ingress"][2] == {
        "ports": [
            {"port": port, "protocol": "TCP"} for port in (ports.pull, ports.reply, ports.heartbeat)
        ]
    }
    plain = load_text((EXAMPLES / "cpu-demo.yaml").read_text(), "cpu-demo").domains()[0]
    assert not any(m.spec.host_network for m in plain.members)
    policy = next(
        o
        for o in render_domain(plain.pool, plain.members)
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "demo-controller"
    )
    assert len(policy["spec"]["ingress"]) == 2


def test_notes_tell_the_next_steps() -> None:
    notes = helm.Chart.load(CHART).render({}, name="kvpool", namespace=NAMESPACE)[
        "kvpool/templates/NOTES.txt"
    ]
    assert "kubectl apply -f examples/cpu-demo.yaml" in notes
    assert "kubectl get kvcachepools,p2pgroups,pdpairs" in notes
