"""Forwarding one request upstream: retries before the first byte, streaming after it.

Why this module exists: the hard part of a reverse proxy is the moment it commits. Until
the first byte of an answer has been forwarded, a failed attempt (connect error, 503 from a
draining worker, a connection cut before any byte) may go to another instance after a short
backoff; after it, the client owns a partial answer and a failure can only be reported in
the stream. Every call has a timeout; the first byte is forwarded at once; a client that
disconnects closes the upstream response, which cancels the request on the worker. Each
exchange is tracked on its instance (``Instance.inflight``) while in flight: when the instance
stops answering its probes (frozen, cut off), the health loop drops them, and they fail like
a dropped connection (retried before the first byte, reported in the stream after it) instead
of waiting for the upstream timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from kvpool.gateway.errors import GatewayError, error_body, upstream_error
from kvpool.gateway.h1client import H1Response
from kvpool.gateway.instances import Instance
from kvpool.gateway.load import LoadTracker, Ticket
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.reliability import backoff_s
from kvpool.gateway.responses import PassThroughStream, WholeResponse, raw_headers
from kvpool.gateway.upstream import CONNECT_ERRORS, CUT_ERRORS, TIMEOUT_ERRORS, Upstream
from kvpool.protocol.http_api import INSTANCE, PREDICTED_HIT_TOKENS, ROUTE_REASON

logger = logging.getLogger(__name__)

#: Upstream statuses worth another instance (the worker is starting or draining).
RETRYABLE_STATUS = frozenset({503})
_HOP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
)


@dataclass
class Attempt:
    """Where one attempt goes: the instance and its load ticket."""

    instance: Instance
    ticket: Ticket
    reason: str = ""
    predicted_hit_tokens: int = 0


#: Picks the instance for attempt ``n`` (0-based), never one in ``exclude``.
Chooser = Callable[[int, set[str]], Awaitable[Attempt]]


class _RetryableError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Proxy:
    """Sends requests to instances with the retry and streaming rules above."""

    upstream: Upstream
    load: LoadTracker
    metrics: GatewayMetrics
    retries: int
    upstream_timeout_s: float
    clock: Callable[[], float] = time.monotonic

    def _timeout(self, name: str, what: str) -> GatewayError:
        return upstream_error(504, f"{name} {what} within {self.upstream_timeout_s:g}s", "timeout")

    async def _open(
        self,
        attempt: Attempt,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        stream: bool,
        raw: bytes | None,
    ) -> tuple[H1Response, bytes]:
        """Send; read the first chunk (streamed) or the whole answer; classify failures."""
        inst = attempt.instance
        try:
            resp = await self.upstream.post(f"{inst.url}{path}", body, headers, raw, inst.inflight)
        except CONNECT_ERRORS as exc:
            raise _RetryableError("connect", f"{inst.name}: {type(exc).__name__}: {exc}") from exc
        except TIMEOUT_ERRORS as exc:
            raise self._timeout(inst.name, "did not answer") from exc
        if resp.status in RETRYABLE_STATUS:
            text = (await resp.read())[:500].decode(errors="replace")
            resp.release()
            raise _RetryableError(f"status_{resp.status}", f"{inst.name}: {text}")
        try:
            first = await (resp.read_chunk() if stream else resp.read())
        except TIMEOUT_ERRORS as exc:
            resp.close()
            raise self._timeout(inst.name, "sent no byte") from exc
        except CUT_ERRORS as exc:
            resp.close()
            raise _RetryableError("cut", f"{inst.name} closed before answering: {exc}") from exc
        return resp, first

    async def forward(
        self,
        choose: Chooser,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        on_done: Callable[[], None],
        endpoint: str,
        raw: bytes | None = None,
    ) -> Response:
        """Forward ``body`` to ``path`` on the chosen instance; ``on_done`` runs exactly once
        when the answer has been fully sent (or failed), also for a disconnected client.
        ``raw``: ``body`` as JSON bytes already (the client's own), sent as they are.

        A streamed request is answered as the upstream's chunks arrive; any other with the
        whole answer at once (one write, with Content-Length)."""
        stream = bool(body.get("stream"))
        failed: set[str] = set()
        last: _RetryableError | None = None
        try:
            for n in range(self.retries + 1):
                try:
                    attempt = await choose(n, failed)
                except GatewayError:
                    if last is None:
                        raise
                    break  # every candidate failed already: report the last failure
                inst = attempt.instance
                if not inst.breaker.acquire(self.clock()):
                    failed.add(inst.name)
                    self.load.finish(attempt.ticket)
                    continue
                t0 = self.clock()
                try:
                    resp, first = await self._open(attempt, path, body, headers, stream, raw)
                except _RetryableError as exc:
                    inst.breaker.failure(self.clock())
                    self.load.finish(attempt.ticket)
                    self.metrics.upstream_errors.labels(inst.name, exc.kind).inc()
                    logger.warning("attempt %d on %s failed: %s", n + 1, inst.name, exc)
                    failed.add(inst.name)
                    last = exc
                    if n < self.retries:
                        self.metrics.retries.labels(exc.kind).inc()
                        await asyncio.sleep(backoff_s(n + 1))
                    continue
                except BaseException:
                    inst.breaker.failure(self.clock())
                    self.load.finish(attempt.ticket)
                    raise
                inst.breaker.success()
                ttft = self.load.first_byte(attempt.ticket, self.clock())
                self.metrics.ttft.labels(inst.name).observe(ttft)
                self.metrics.route_ttft.labels(attempt.reason).observe(ttft)
                response = self._respond(attempt, resp, first, stream, t0, on_done, endpoint)
                on_done = _noop  # the response owns it now
                return response
        finally:
            on_done()
        what = f" (last: {last})" if last else ""
        if last is not None and last.kind.startswith("status_"):
            raise upstream_error(503, f"every instance tried is unavailable{what}", "unavailable")
        raise upstream_error(
            502, f"no instance could be reached{what}", "upstream_unreachable", retry_after=True
        )

    def _respond(
        self,
        attempt: Attempt,
        resp: H1Response,
        first: bytes,
        stream: bool,
        t0: float,
        on_done: Callable[[], None],
        endpoint: str,
    ) -> Response:
        inst = attempt.instance
        headers = raw_headers(resp.headers, _HOP_HEADERS)
        if resp.header("content-type") is None:
            headers.append((b"content-type", b"application/json"))
        headers += (
            (INSTANCE_B, inst.name.encode("latin-1")),
            (ROUTE_REASON_B, attempt.reason.encode("latin-1")),
            (PREDICTED_B, b"%d" % attempt.predicted_hit_tokens),
        )
        status = resp.status

        def finish(outcome: str) -> None:
            self.load.finish(attempt.ticket)
            self.metrics.upstream_latency.labels(inst.name).observe(self.clock() - t0)
            self.metrics.requests.labels(endpoint, outcome).inc()
            on_done()

        if status >= 500:  # the worker's own 5xx (not 503): a bad gateway, with its message
            self.metrics.upstream_errors.labels(inst.name, f"status_{status}").inc()
            resp.close()
            finish(str(status))
            return _bad_gateway(inst.name, status, first)
        if not stream:
            resp.release()
            finish(str(status))
            return WholeResponse(first, status, headers)

        async def body() -> AsyncIterator[bytes]:
            outcome = str(status)
            try:
                if first:
                    yield first
                async for chunk in resp.iter_chunks():
                    yield chunk
            except (*CUT_ERRORS, *TIMEOUT_ERRORS) as exc:
                outcome = "cut"
                inst.breaker.failure(self.clock())
                self.metrics.upstream_errors.labels(inst.name, "cut").inc()
                logger.warning("%s failed mid-answer: %s", inst.name, exc)
                err = error_body(
                    f"instance {inst.name} failed mid-answer: {type(exc).__name__}",
                    type_="bad_gateway",
                    code="upstream_cut",
                )
                yield f"data: {json.dumps(err)}\n\n".encode()
            except BaseException:
                outcome = "client_gone"
                raise
            finally:
                if outcome == str(status):
                    resp.release()
                else:
                    resp.close()  # drop the connection: the worker aborts the request
                finish(outcome)

        return PassThroughStream(body(), status, headers)


INSTANCE_B = INSTANCE.encode()
ROUTE_REASON_B = ROUTE_REASON.encode()
PREDICTED_B = PREDICTED_HIT_TOKENS.encode()


def _noop() -> None:
    return None


def _bad_gateway(name: str, status: int, first: bytes) -> Response:
    """A worker error (5xx other than 503) as a 502 naming the instance and its message."""
    try:
        detail = json.loads(first.decode(errors="replace")).get("error", {}).get("message", "")
    except (ValueError, AttributeError):
        detail = first[:200].decode(errors="replace")
    err = GatewayError(
        f"instance {name} failed with {status}: {detail}",
        status=502,
        type_="bad_gateway",
        code="upstream_error",
    )
    return err.response()
