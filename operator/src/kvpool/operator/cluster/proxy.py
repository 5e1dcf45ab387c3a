"""The cluster's service proxy: ``*.svc`` HTTP names for processes that cannot resolve them.

Why: a pod in a cluster reaches a Service by its DNS name (the operator calls each pool's
controller at ``http://<pool>-controller.<namespace>.svc:9000`` to deregister instances).
Names the rendered command line and config carry are rewritten to 127.0.0.1 by the kubelet, but
a URL a program builds at run time is not; so every pod gets ``HTTP_PROXY`` pointing here, and
this proxy resolves ``<service>.<namespace>.svc[.cluster.local]:<port>`` (and a StatefulSet
pod's ``<pod>.<service>.<namespace>.svc``) to the ready backend's local port, as cluster DNS
and kube-proxy together would. HTTP only (no CONNECT tunnels).
"""

from __future__ import annotations

import logging

import aiohttp
import aiohttp.web

from kvpool.operator.cluster.admission import Resolve

log = logging.getLogger(__name__)
_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}


def service_of(host: str) -> tuple[str, str] | None:
    """(namespace, service) of a cluster DNS name, None for any other host."""
    name = host.removesuffix(".cluster.local")
    if not name.endswith(".svc"):
        return None
    parts = name.removesuffix(".svc").split(".")
    if len(parts) == 2:
        return parts[1], parts[0]
    if len(parts) == 3:  # <pod>.<service>.<namespace>: the pod behind its headless Service
        return parts[2], parts[1]
    return None


def app(resolve: Resolve) -> aiohttp.web.Application:
    """An aiohttp application that forwards absolute-form requests to Service backends."""

    async def forward(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        url = request.url
        target = service_of(url.host or "")
        if target is None or not url.is_absolute():
            return aiohttp.web.Response(status=502, text=f"not a cluster service: {url.host}")
        backend = await resolve(target[0], target[1], str(url.port or 80))
        if backend is None:
            return aiohttp.web.Response(status=503, text=f"no ready endpoint for {url.host}")
        upstream = url.with_scheme("http").with_host(backend[0]).with_port(backend[1])
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with (
            aiohttp.ClientSession() as http,
            http.request(
                request.method, upstream, headers=headers, data=await request.read()
            ) as resp,
        ):
            body = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            log.info("proxied %s %s -> %s: %d", request.method, url, upstream, resp.status)
            return aiohttp.web.Response(status=resp.status, body=body, headers=out)

    application = aiohttp.web.Application()
    application.router.add_route("*", "/{tail:.*}", forward)
    return application
