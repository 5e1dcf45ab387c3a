"""Webhook certificates: the self-signed pair serves the Service names; cert-manager's Secret is
read as mounted, and a missing one is a clear error naming the files and the fix."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509

from kvpool.operator.runtime import certs
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
    self_signed = kopf_settings(OperatorSettings(webhook_cert_dir=str(tmp_path / "a")))
    assert self_signed.admission.managed == "kvpool.io"
    certs.generate(tmp_path / "b", ["svc"])
    managed_by_chart = kopf_settings(
        OperatorSettings(webhook_mode="cert-manager", webhook_cert_dir=str(tmp_path / "b"))
    )
    assert managed_by_chart.admission.managed is None
    assert managed_by_chart.admission.server is not None
    assert kopf_settings(OperatorSettings(webhook_mode="none")).admission.server is None
