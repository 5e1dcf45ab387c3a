"""Webhook serving certificates: generated self-signed (default) or read from cert-manager.

Why: the API server only calls a webhook over TLS it trusts. By default the operator makes a
private CA and a serving certificate for its Service's DNS names at start-up and hands the CA
to the ValidatingWebhookConfiguration (kopf writes the caBundle); with cert-manager the chart
mounts the issued Secret (tls.crt, tls.key, ca.crt) into the cert dir and injects the CA.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class CertFiles:
    """Paths of the serving certificate and key, and the CA bundle (PEM bytes)."""

    certfile: Path
    keyfile: Path
    ca_pem: bytes


def service_dns_names(service: str, namespace: str) -> list[str]:
    """The names the API server may use to reach ``service`` in ``namespace``."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def generate(
    directory: Path,
    dns_names: list[str],
    days: int = 3650,
    ip_addresses: Sequence[str] = (),
    ca_name: str = "kvpool-operator-ca",
) -> CertFiles:
    """Write a fresh CA and a serving certificate for ``dns_names`` (and ``ip_addresses``:
    ``kvpool-operator cluster``'s API server on 127.0.0.1) into ``directory``."""
    now = datetime.datetime.now(tz=datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns_names[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns_names]
                + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    files = CertFiles(directory / "tls.crt", directory / "tls.key", ca_pem)
    files.certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.keyfile.chmod(0o600)
    (directory / "ca.crt").write_bytes(ca_pem)
    return files


def load(directory: Path) -> CertFiles:
    """The cert-manager Secret as mounted: tls.crt, tls.key and ca.crt."""
    missing = [n for n in ("tls.crt", "tls.key", "ca.crt") if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"webhook cert dir {directory} lacks {', '.join(missing)}: mount the cert-manager "
            "Certificate's Secret there, or run with --webhook-mode=self-signed"
        )
    return CertFiles(
        directory / "tls.crt", directory / "tls.key", (directory / "ca.crt").read_bytes()
    )
