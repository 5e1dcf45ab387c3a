"""Webhook certificates: the self-signed pair serves the Service names; cert-manager's Secret is
read as mounted, and a missing one is a clear error naming the files and the fix."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509

from kvpool.operator.runtime import certs, permissions
from kvpool.operator.runtime.main import kopf_settings
from kvpool.operator.runtime.settings import OperatorSettings


def test_self_signed_pair_names_the_service_and_loads_into_tls(tmp_path: Path) -> None:
    names = certs.service_dns_names("kvpool-operator-webhook", "kvpool-system")
    files = certs.generate(tmp_path, names)
    cert = x509.load_pem_x509_certificate(files.certfile.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == names
    assert "kvpool-operator-webhook.kvpool-system.svc" in names
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(files.certfile, files.keyfile)
    assert certs.load(tmp_path).ca_pem == files.ca_pem
    assert (files.keyfile.stat().st_mode & 0o077) == 0


def test_cert_manager_mode_without_the_secret_says_what_to_mount(tmp_path: Path) -> None:
    settings = OperatorSettings(webhook_mode="cert-manager", webhook_cert_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"lacks tls\.crt, tls\.key, ca\.crt"):
        kopf_settings(settings)


def test_modes_decide_who_writes_the_webhook_configuration(tmp_path: Path) -> None:
    """Self-signed: the operator's own client writes it (not kopf's managed mode, which also
    creates a MutatingWebhookConfiguration the chart's RBAC does not grant); cert-manager: the
    chart templates it."""
    self_signed = kopf_settings(OperatorSettings(webhook_cert_dir=str(tmp_path / "a")))
    assert self_signed.admission.managed is None
    assert self_signed.admission.server is not None
    certs.generate(tmp_path / "b", ["svc"])
    managed_by_chart = kopf_settings(
        OperatorSettings(webhook_mode="cert-manager", webhook_cert_dir=str(tmp_path / "b"))
    )
    assert managed_by_chart.admission.managed is None
    assert managed_by_chart.admission.server is not None
    assert kopf_settings(OperatorSettings(webhook_mode="none")).admission.server is None
    config = permissions.webhook_configuration("svc", "ns", 443, "Q0E=")
    hooks = {h["name"]: h for h in config["webhooks"]}  # type: ignore[attr-defined]
    pool = hooks["kvcachepool.validate.kvpool.io"]
    assert pool["clientConfig"] == {
        "service": {"name": "svc", "namespace": "ns", "path": "/validate-kvcachepool", "port": 443},
        "caBundle": "Q0E=",
    }
    assert pool["rules"][0]["operations"] == ["CREATE", "UPDATE", "DELETE"]
    assert permissions.webhook_configuration("s", "n", 443, "x", enabled=False)["webhooks"] == []


def test_the_client_trusts_a_kubeconfigs_base64_ca_and_a_serving_ip(tmp_path: Path) -> None:
    """A kubeconfig's certificate-authority-data reaches the client as kopf read it (base64
    text): the handlers' client must decode it as kopf's own does (it used to hand the base64
    to ssl as PEM: "no start line", every reconcile failed under a kubeconfig login)."""
    import base64

    import kopf

    from kvpool.operator.runtime.kube import ssl_context

    files = certs.generate(tmp_path, ["localhost"], ip_addresses=["127.0.0.1"])
    cert = x509.load_pem_x509_certificate(files.certfile.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    info = kopf.ConnectionInfo(
        server="https://127.0.0.1:6443", ca_data=base64.b64encode(files.ca_pem).decode()
    )
    ctx = ssl_context(info)
    assert isinstance(ctx, ssl.SSLContext)
    assert [c["subject"] for c in ctx.get_ca_certs()] == [
        ((("commonName", "kvpool-operator-ca"),),)
    ]
    assert ssl_context(kopf.ConnectionInfo(server="http://127.0.0.1:8080")) is False
