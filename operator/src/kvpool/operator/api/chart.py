"""ChartValues: the Helm chart's values, modelled so values.schema.json is generated, not typed.

Why: a typo in a Helm values file is otherwise silently ignored; generating the schema from a
strict model (additionalProperties: false everywhere) makes `helm install` reject it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvpool.operator.api.common import ApiModel, Resources, Toleration


class OperatorImage(ApiModel):
    """The operator image."""

    repository: str = Field(default="ghcr.io/kvpool/operator", description="Image repository.")
    tag: str = Field(default="0.1.0", description="Image tag. Default 0.1.0.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Default IfNotPresent."
    )


class Webhook(ApiModel):
    """The validating admission webhook (runs the same validation as the CLI)."""

    enabled: bool = Field(default=True, description="Default true.")
    port: int = Field(default=9443, ge=1, le=65535, description="Default 9443.")
    failure_policy: Literal["Fail", "Ignore"] = Field(default="Fail", description="Default Fail.")


class ChartValues(ApiModel):
    """Values of the kvpool Helm chart."""

    image: OperatorImage = Field(default_factory=OperatorImage)
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secret names.")
    replicas: int = Field(default=1, ge=1, description="Operator replicas (leader-elected).")
    watch_namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch; empty means all."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Default INFO."
    )
    webhook: Webhook = Field(default_factory=Webhook)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    install_crds: bool = Field(default=True, description="Install the CRDs. Default true.")
