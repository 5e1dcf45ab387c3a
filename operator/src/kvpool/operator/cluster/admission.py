"""Validating admission webhooks, called over HTTPS as the API server calls them.

Why: the operator's webhook (kopf's server, its self-signed CA written into the
ValidatingWebhookConfiguration ``kvpool.io`` by the operator itself) is what refuses a bad
cache domain at ``kubectl apply``, and a pool deletion while members remain. Here the API
server reads the ValidatingWebhookConfigurations stored in it, matches each webhook's rules
(groups, versions, resources with subresources, operations, namespace and object selectors),
sends an ``admission.k8s.io/v1`` AdmissionReview to the webhook's Service (resolved to the
pod's local port by the kubelet) over TLS verified against the webhook's ``caBundle`` for the
Service's DNS name, and refuses with the webhook's message, or passes its warnings on.
``failurePolicy: Fail`` refuses when the webhook cannot be reached; ``Ignore`` lets it pass.

Not reproduced (README): mutating webhooks, ``matchConditions``, ``matchPolicy: Equivalent``
across versions, reinvocation, and the ``timeout`` bound per call is ``timeoutSeconds`` only.
"""

from __future__ import annotations

import base64
import ssl
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpool.operator.cluster.registry import Kind
from kvpool.operator.cluster.selectors import selector_matcher
from kvpool.operator.cluster.store import Obj, Res, Store

CONFIGS = Res("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations")
NAMESPACES = Res("", "v1", "namespaces")

#: (namespace, service, port) -> (host, port) of a ready backend, or None.
Resolve = Callable[[str, str, str], Awaitable[tuple[str, int] | None]]


class AdmissionError(Exception):
    """A refusal: HTTP status, reason and the message the client prints."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def _any(values: Any, value: str) -> bool:
    return "*" in (values or []) or value in (values or [])


def rule_matches(rule: Mapping[str, Any], operation: str, kind: Kind, sub: str | None) -> bool:
    """One RuleWithOperations against a request (``*`` and ``plural/*`` wildcards)."""
    resource = kind.res.plural + (f"/{sub}" if sub else "")
    resources = rule.get("resources") or []
    by_resource = (
        resource in resources
        or ("*" in resources and not sub)
        or "*/*" in resources
        or (sub is not None and f"{kind.res.plural}/*" in resources)
        or (sub is not None and f"*/{sub}" in resources)
    )
    scope = rule.get("scope", "*")
    scoped = scope == "*" or (scope == "Namespaced") == kind.namespaced
    return (
        _any(rule.get("apiGroups"), kind.res.group)
        and _any(rule.get("apiVersions"), kind.res.version)
        and _any(rule.get("operations"), operation)
        and by_resource
        and scoped
    )


def review_body(
    hook_uid: str,
    operation: str,
    kind: Kind,
    obj: Obj | None,
    old: Obj | None,
    user: Mapping[str, Any],
    sub: str | None,
    dry_run: bool,
) -> dict[str, Any]:
    """The AdmissionReview the API server sends for one request."""
    some = obj or old or {}
    gvk = {"group": kind.res.group, "version": kind.res.version, "kind": kind.kind}
    gvr = {"group": kind.res.group, "version": kind.res.version, "resource": kind.res.plural}
    request: dict[str, Any] = {
        "uid": hook_uid,
        "kind": gvk,
        "resource": gvr,
        "requestKind": gvk,
        "requestResource": gvr,
        "name": some.get("metadata", {}).get("name", ""),
        "operation": operation,
        "userInfo": dict(user),
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.title()}Options"},
    }
    if kind.namespaced:
        request["namespace"] = some.get("metadata", {}).get("namespace", "")
    if sub:
        request["subResource"] = sub
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


@dataclass
class Webhooks:
    """The API server's validating admission: ``review`` refuses or returns warnings."""

    store: Store
    resolve: Resolve

    def _selected(self, hook: Mapping[str, Any], kind: Kind, some: Obj) -> bool:
        labels = some.get("metadata", {}).get("labels") or {}
        if hook.get("objectSelector") and not selector_matcher(hook["objectSelector"])(labels):
            return False
        if hook.get("namespaceSelector") and kind.namespaced:
            ns = self.store.find(NAMESPACES, None, some.get("metadata", {}).get("namespace", ""))
            ns_labels = (ns or {}).get("metadata", {}).get("labels") or {}
            if not selector_matcher(hook["namespaceSelector"])(ns_labels):
                return False
        return True

    async def review(
        self,
        operation: str,
        kind: Kind,
        obj: Obj | None,
        old: Obj | None,
        user: Mapping[str, Any],
        sub: str | None,
        dry_run: bool,
    ) -> list[str]:
        warnings: list[str] = []
        some = obj or old or {}
        for config in self.store.list(CONFIGS):
            for hook in config.get("webhooks") or []:
                if not any(rule_matches(r, operation, kind, sub) for r in hook.get("rules") or []):
                    continue
                if not self._selected(hook, kind, some):
                    continue
                body = review_body(str(uuid.uuid4()), operation, kind, obj, old, user, sub, dry_run)
                warnings += await self._call(hook, body)
        return warnings

    async def _call(self, hook: Mapping[str, Any], body: dict[str, Any]) -> list[str]:
        name = str(hook.get("name", "?"))
        timeout = float(hook.get("timeoutSeconds", 10))
        config = hook.get("clientConfig") or {}
        try:
            url, host, ctx = await self._endpoint(config)
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))
            async with (
                session as http,
                http.post(url, json=body, ssl=ctx, server_hostname=host) as resp,
            ):
                if resp.status != 200:
                    raise OSError(f"the webhook answered {resp.status}")
                answer = await resp.json()
        except (OSError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if hook.get("failurePolicy", "Fail") == "Ignore":
                return []
            raise AdmissionError(
                500,
                "InternalError",
                f'Internal error occurred: failed calling webhook "{name}": {exc}',
            ) from None
        response = answer.get("response") or {}
        if response.get("allowed"):
            return [str(w) for w in response.get("warnings") or []]
        result = response.get("status") or {}
        message = result.get("message") or "denied"
        raise AdmissionError(
            int(result.get("code") or 403),
            str(result.get("reason") or "Forbidden"),
            f'admission webhook "{name}" denied the request: {message}',
        )

    async def _endpoint(self, config: Mapping[str, Any]) -> tuple[str, str, ssl.SSLContext]:
        ctx = ssl.create_default_context()
        if config.get("caBundle"):
            ctx = ssl.create_default_context(cadata=base64.b64decode(config["caBundle"]).decode())
        if config.get("url"):
            url = str(config["url"])
            return url, url.split("//", 1)[-1].split("/", 1)[0].split(":")[0], ctx
        service = config.get("service") or {}
        ns, svc = str(service.get("namespace", "default")), str(service.get("name", ""))
        target = await self.resolve(ns, svc, str(service.get("port", 443)))
        if target is None:
            raise OSError(f'service "{ns}/{svc}" has no ready endpoint')
        path = str(service.get("path") or "/")
        return f"https://{target[0]}:{target[1]}{path}", f"{svc}.{ns}.svc", ctx
