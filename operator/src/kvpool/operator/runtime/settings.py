"""Settings of ``kvpool-operator run``: one pydantic-settings class, from flags and environment.

Why: the chart sets flags, a developer sets environment variables (``KVPOOL_OPERATOR_*``); one
validated class reads both, so a typo in either is an error naming the setting, and kopf's own
settings are derived from it in one place (main.py).
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvpool.operator.runtime import permissions


class OperatorSettings(BaseSettings):
    """Everything ``kvpool-operator run`` can be told."""

    model_config = SettingsConfigDict(
        env_prefix="KVPOOL_OPERATOR_",
        cli_kebab_case=True,
        cli_prog_name="kvpool-operator run",
        cli_implicit_flags=True,
        extra="forbid",
    )

    namespace: list[str] = Field(
        default_factory=list,
        description="Namespace to watch (repeatable). None: every namespace (cluster-wide).",
    )
    health_host: str = Field(default="0.0.0.0", description="Address of /healthz and /readyz.")
    health_port: int = Field(default=permissions.HEALTH_PORT, ge=0, le=65535)
    metrics_port: int = Field(default=permissions.METRICS_PORT, ge=0, le=65535)
    webhook_mode: Literal["self-signed", "cert-manager", "none"] = Field(
        default="self-signed",
        description="self-signed: generate a CA and serving cert and let the operator write the "
        "caBundle; cert-manager: read tls.crt/tls.key/ca.crt from the cert dir; none: no webhook.",
    )
    webhook_port: int = Field(default=permissions.WEBHOOK_PORT, ge=0, le=65535)
    webhook_host: str = Field(default="0.0.0.0", description="Listen address of the webhook.")
    webhook_cert_dir: str = Field(default=permissions.WEBHOOK_CERT_DIR)
    webhook_service: str = Field(
        default="kvpool-operator-webhook", description="Service in front of the webhook."
    )
    webhook_service_port: int = Field(
        default=443, ge=1, le=65535, description="Port of that Service (targets --webhook-port)."
    )
    webhook_namespace: str = Field(
        default_factory=lambda: os.environ.get("POD_NAMESPACE", "kvpool-system"),
        description="Namespace of that Service (default: env POD_NAMESPACE, else kvpool-system).",
    )
    operator_namespace: str | None = Field(
        default_factory=lambda: os.environ.get("POD_NAMESPACE") or None,
        description="The operator's own namespace: the domains' NetworkPolicies admit the "
        "operator's pods from it alone (default: env POD_NAMESPACE, else any namespace).",
    )
    field_manager: str = Field(default=permissions.FIELD_MANAGER, min_length=1)
    drift_interval: float = Field(
        default=30.0, gt=0, description="Seconds between drift checks of each pool."
    )
    delete_retry: float = Field(
        default=10.0, gt=0, description="Seconds between checks of a blocked pool deletion."
    )
    controller_url: str = Field(
        default="http://{service}.{namespace}.svc:{port}",
        description="Where the operator reaches a pool's controller HTTP API (format string).",
    )
    controller_timeout: float = Field(default=5.0, gt=0)
    gateway_url: str = Field(
        default="http://{service}.{namespace}.svc:{port}",
        description="Where the operator reaches a pool's gateway (format string).",
    )
    figures_interval: float = Field(
        default=30.0,
        ge=0,
        description="Seconds between reads of each pool's controller and gateway for the live "
        "figures in status (0: never read them).",
    )
    figures_timeout: float = Field(
        default=2.0, gt=0, description="Seconds one read of a controller or gateway may take."
    )
    figures_window: float = Field(
        default=300.0, gt=0, description="Seconds the hit ratio in status is computed over."
    )
    log_format: Literal["json", "text"] = "json"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @property
    def clusterwide(self) -> bool:
        return not self.namespace
