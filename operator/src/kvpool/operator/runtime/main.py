"""``kvpool-operator run``: kopf under the operator's settings, with probes, metrics and webhook.

Why a module of its own: the CLI stays import-light for ``validate``/``render`` (no kopf), and
the integration tests and the benchmark start exactly the operator the chart runs — same kopf
settings, same handlers — only with a different login.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import aiohttp.web
import kopf

from kvpool.operator.runtime import certs, handlers, kube, metrics, permissions
from kvpool.operator.runtime.settings import OperatorSettings

log = logging.getLogger(__name__)


class ServiceWebhookServer:
    """kopf's HTTPS webhook server, announced to the API server as a Service (in-cluster).

    In self-signed mode (``client`` given) the operator writes the ValidatingWebhookConfiguration
    itself once the server listens (``permissions.webhook_configuration``: the chart's webhooks,
    its CA) and empties it when it stops, so kvpool resources stay writable without it. kopf's
    managed mode is not used: it also creates a MutatingWebhookConfiguration (for no handler),
    which the chart's least-privilege RBAC refuses, and a refusal there stops kopf (the operator
    restarted in a loop under the chart's own RBAC, seen with kvpool-operator cluster).
    """

    def __init__(
        self,
        settings: OperatorSettings,
        files: certs.CertFiles,
        client: kube.KubeClient | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.inner = kopf.WebhookServer(
            addr=settings.webhook_host,
            port=settings.webhook_port,
            certfile=str(files.certfile),
            pkeyfile=str(files.keyfile),
            cadata=files.ca_pem,
        )

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        ca: str | None = None
        try:
            async for config in self.inner(fn):
                out: kopf.WebhookClientConfig = {
                    "service": {
                        "name": self.settings.webhook_service,
                        "namespace": self.settings.webhook_namespace,
                        "port": self.settings.webhook_service_port,
                    },
                }
                if config.get("caBundle"):
                    out["caBundle"] = config["caBundle"]
                    ca = str(config["caBundle"])
                    await self.configure(ca, enabled=True)
                yield out
        finally:
            if ca is not None and self.client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.configure(ca, enabled=False, attempts=1), 5.0)

    async def configure(self, ca: str, *, enabled: bool, attempts: int = 30) -> None:
        """Write the webhook configuration (self-signed mode), retrying until the operator's
        client has logged in and the API server accepts it."""
        if self.client is None:
            return
        s = self.settings
        body = permissions.webhook_configuration(
            s.webhook_service, s.webhook_namespace, s.webhook_service_port, ca, enabled=enabled
        )
        for attempt in range(attempts):
            try:
                await self.client.put_cluster_object(body)
                log.info("webhook configuration %s written", permissions.WEBHOOK_CONFIGURATION)
                return
            except RuntimeError:  # kopf has not logged in yet
                await asyncio.sleep(0.5)
            except (kube.ApiError, aiohttp.ClientError, TimeoutError) as exc:
                log.warning("could not write the webhook configuration (%s); retrying", exc)
                await asyncio.sleep(min(5.0, 0.5 * 2**attempt))


def kopf_settings(
    settings: OperatorSettings, client: kube.KubeClient | None = None
) -> kopf.OperatorSettings:
    """kopf's settings derived from ours (finalizer and storage names, webhook; ``client``
    writes the self-signed webhook configuration)."""
    ks = kopf.OperatorSettings()
    ks.persistence.finalizer = "kvpool.io/finalizer"
    ks.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpool.io")
    ks.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvpool.io", key="last-handled-configuration"
    )
    ks.posting.level = logging.WARNING
    if settings.webhook_mode != "none":
        cert_dir = Path(settings.webhook_cert_dir)
        if settings.webhook_mode == "self-signed":
            dns = certs.service_dns_names(settings.webhook_service, settings.webhook_namespace)
            files = certs.generate(cert_dir, dns)
            ks.admission.server = ServiceWebhookServer(settings, files, client)
        else:
            ks.admission.server = ServiceWebhookServer(settings, certs.load(cert_dir))
    return ks


async def serve_probes(rt: handlers.Runtime) -> list[aiohttp.web.AppRunner]:
    """/healthz (the process answers), /readyz (kopf started, indexes attached), /metrics."""
    s = rt.settings
    health = {
        "/healthz": lambda: (200, b"ok", "text/plain"),
        "/readyz": lambda: (200, b"ready", "text/plain")
        if rt.ready
        else (503, b"starting", "text/plain"),
    }
    runners = [await metrics.serve(s.health_host, s.health_port, health)]
    runners.append(
        await metrics.serve(
            s.health_host, s.metrics_port, {"/metrics": metrics.metrics_route(rt.metrics)}
        )
    )
    return runners


async def operate(
    settings: OperatorSettings,
    *,
    login: Callable[..., kopf.ConnectionInfo | None] | None = None,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | None = None,
    kopf_overrides: Callable[[kopf.OperatorSettings], None] | None = None,
    runtime: handlers.Runtime | None = None,
) -> None:
    """Run the operator until ``stop_flag`` (or a signal) stops it."""
    rt = runtime or handlers.Runtime.build(settings)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, rt, login=login)
    ks = kopf_settings(settings, rt.client)
    if kopf_overrides is not None:
        kopf_overrides(ks)
    runners = await serve_probes(rt)
    try:
        await kopf.operator(
            registry=registry,
            settings=ks,
            standalone=True,
            clusterwide=settings.clusterwide,
            namespaces=settings.namespace,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvpool-operator run``."""
    settings = OperatorSettings(_cli_parse_args=list(argv))
    kopf.configure(
        verbose=settings.log_level == "DEBUG",
        quiet=settings.log_level in ("WARNING", "ERROR"),
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.FULL,
        log_refkey="k8s",
    )
    log.info(
        "kvpool-operator starting: %s, webhook %s",
        "cluster-wide" if settings.clusterwide else f"namespaces {settings.namespace}",
        settings.webhook_mode,
    )
    asyncio.run(operate(settings))
    return 0
