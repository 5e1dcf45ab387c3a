"""The operator's calls of a domain's controller that change it: deregistration and the allowlist.

Why one module: both are mutating routes of the controller's HTTP API, so both carry the
domain's API token (``Authorization: Bearer``, read back from the domain's Secret by the pure
plan), reach the controller the same way (``--controller-url``, the pod's HTTP proxy honoured),
are bounded by ``--controller-timeout`` and report a failure as text, never as an exception:
the caller decides what a failure means (a member's finalizer posts an Event and goes on; a
reconcile pass holds back the pods that carry ids the controller has not allowed yet).
"""

from __future__ import annotations

import logging

import aiohttp

from kvpool.operator.runtime.plan import AllowlistPush, ControllerTarget, Deregistration
from kvpool.operator.runtime.settings import OperatorSettings
from kvpool.protocol.http_api import INSTANCES_PATH, bearer, instances_body

log = logging.getLogger(__name__)


class ControllerApi:
    """HTTP calls of the controllers' mutating routes, and what each controller allows."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        #: (namespace, controller Service) -> the ids its controller last acknowledged.
        self._allowed: dict[tuple[str, str], tuple[str, ...]] = {}

    def url(self, namespace: str, target: ControllerTarget) -> str:
        return self.settings.controller_url.format(
            service=target.service, namespace=namespace, port=target.port
        )

    def _session(self) -> aiohttp.ClientSession:
        # trust_env: an HTTP proxy in the pod's environment (a cluster's egress proxy, or the
        # service proxy of `kvpool-operator cluster`) is used, as Go clients do; NO_PROXY exempts.
        timeout = aiohttp.ClientTimeout(total=self.settings.controller_timeout)
        return aiohttp.ClientSession(timeout=timeout, trust_env=True)

    @staticmethod
    def _headers(target: ControllerTarget) -> dict[str, str]:
        return bearer(target.token) if target.token else {}

    async def deregister(self, namespace: str, dereg: Deregistration) -> list[str]:
        """``POST /v1/deregister`` of each instance id; the failures, one text each."""
        url, failed = self.url(namespace, dereg.target), []
        headers = self._headers(dereg.target)
        async with self._session() as http:
            for iid in dereg.instance_ids:
                body = {"instance_id": iid}
                try:
                    async with http.post(
                        f"{url}/v1/deregister", json=body, headers=headers
                    ) as resp:
                        if resp.status >= 400:
                            failed.append(f"{iid}: HTTP {resp.status}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failed.append(f"{iid}: {exc.__class__.__name__} {exc}")
        return failed

    async def allow(self, namespace: str, push: AllowlistPush) -> str | None:
        """Make the controller allow exactly ``push.instance_ids`` (``PUT /v1/instances``, only
        when they differ from what it last acknowledged to this operator); None when it has,
        else why not."""
        key = (namespace, push.target.service)
        if self._allowed.get(key) == push.instance_ids:
            return None
        url = f"{self.url(namespace, push.target)}{INSTANCES_PATH}"
        try:
            async with (
                self._session() as http,
                http.put(
                    url,
                    json=instances_body(push.instance_ids),
                    headers=self._headers(push.target),
                ) as resp,
            ):
                if resp.status >= 400:
                    text = (await resp.text())[:300]
                    return f"PUT {url}: HTTP {resp.status} {text}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"PUT {url}: {exc.__class__.__name__} {exc}"
        self._allowed[key] = push.instance_ids
        log.info(
            "controller %s/%s allows %d instance id(s)",
            namespace,
            push.target.service,
            len(push.instance_ids),
            extra={"object": f"{namespace}/{push.target.service}"},
        )
        return None
