"""The open-loop load generator behind ``kvpool-gateway replay`` (and the gateway benchmark).

Why this module exists: a router is judged by what clients see under a real arrival process,
so the replay must send each request at its trace time (scaled), whatever happens to earlier
ones — an open loop — and measure TTFT, TPOT and hits per request without becoming the
bottleneck itself. One aiohttp session with keep-alive connections sends every request (a
bounded number at once); streams are read as raw chunks by :class:`SseReader`
(:mod:`kvpool.gateway.sse_reader`). Requests of one session (agent traces) go in order, each
when its time has come and the session's previous request has answered.

Each request's :class:`Outcome` records when it was due and when it left (lateness: an
overloaded client, or one held back by ``concurrency`` / ``max_sessions``, shows there), its
HTTP status or error kind, TTFT (sent → first content), end-to-end time, output tokens (usage,
else content events), usage's prompt and cached tokens, and the ``x-kvpool-instance`` header.
No attempt outlives ``timeout_s``; :meth:`Replay.stop` ends a run early, :meth:`Replay.finish`
sends nothing more and lets what is in flight answer.

A client that retries (``Endpoint.retries``; the chaos suite, e2e/chaos) sends a request again
after an answer it may retry: a retryable status (429, 502, 503, 504), a connection refused or
cut, or an error event in the stream (the answer is incomplete; the requests are greedy, so a
second answer is the same), after 0.5 s doubling to 8 s, or the answer's ``Retry-After`` when
it asks for longer. Each failed attempt is kept (:class:`FailedAttempt`: kind, status,
``Retry-After``); a timeout is never retried (it is what the suite counts as a hung request),
nor an answer that ended without error yet incomplete.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpool.gateway.sse_reader import SseReader
from kvpool.protocol import http_api

#: the response headers kvpool's gateway names the serving instance and its reason with
INSTANCE_HEADER = http_api.INSTANCE
REASON_HEADER = http_api.ROUTE_REASON
_ERROR_BODY_BYTES = 2048
#: HTTP statuses a retrying client sends again (the server said: not now)
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
_RETRY_AFTER_CAP_S = 30.0


@dataclass(frozen=True, slots=True)
class FailedAttempt:
    """An attempt of a request that the client retried (seconds from the replay's start)."""

    error: str  # its kind: http_503, connect, disconnect, stream_upstream_cut, ...
    status: int | None
    retry_after: str | None  # the answer's Retry-After header, verbatim
    at_s: float  # when it failed
    wait_s: float  # how long the client waited before the next attempt


@dataclass(frozen=True, slots=True)
class Job:
    """One request to send: ``body()`` is built when it is due (prompts can be large)."""

    index: int  # the trace's row
    at_s: float  # due this many seconds after the replay starts (time scale applied)
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: Callable[[], bytes]
    session: str | None = None  # requests of a session go in order, one at a time
    trace_prompt_tokens: int = 0  # the trace's prompt length (0: not known, e.g. chat)


@dataclass(slots=True)
class Outcome:
    """What happened to one job (times in seconds; ``sent_s`` from the replay's start)."""

    index: int
    session: str | None
    due_s: float  # max(scheduled time, the session's previous answer)
    sent_s: float
    trace_prompt_tokens: int = 0
    status: int | None = None  # HTTP status (None: no response)
    error: str | None = None  # None: ok; else a kind: http_503, timeout, connect, ...
    detail: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    events: int = 0  # SSE data events
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    cached_tokens: int | None = None
    instance: str | None = None
    reason: str | None = None  # the gateway's routing reason, when it says
    retry_after: str | None = None  # an error answer's Retry-After header
    done: bool = False  # the stream ended with ``data: [DONE]``
    finish_reason: str | None = None  # the last one the stream named
    text: str | None = None  # the answer's text (``Endpoint.keep_text``)
    attempts: list[FailedAttempt] = field(default_factory=list)  # retried ones, in order

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def lateness_s(self) -> float:
        return self.sent_s - self.due_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e − TTFT) / (output tokens − 1); None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: base URL (``http://host:port``), headers for every request."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    concurrency: int = 256  # requests in flight at most
    max_sessions: int | None = None  # sessions with a request pending or in flight, at most
    retries: int = 0  # attempts after the first, on the failures the module docstring names
    keep_text: bool = False  # keep each answer's text (Outcome.text)

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout_s}")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")


@dataclass
class Progress:
    """Counters a progress line reads while the replay runs."""

    total: int
    sent: int = 0
    done: int = 0
    errors: int = 0
    events: int = 0
    elapsed_s: float = 0.0

    @property
    def inflight(self) -> int:
        return self.sent - self.done


@dataclass
class ReplayRun:
    outcomes: list[Outcome]
    duration_s: float  # first send → last answer
    stopped: bool  # ended early (stop(): Ctrl-C)
    not_sent: int


class _Session:
    __slots__ = ("jobs", "last_done")

    def __init__(self) -> None:
        self.jobs: deque[Job] = deque()
        self.last_done = 0.0


class Replay:
    """Send ``jobs`` (sorted by ``at_s``) to ``endpoint``, open loop; see the module docstring."""

    def __init__(
        self,
        endpoint: Endpoint,
        jobs: Sequence[Job],
        *,
        on_progress: Callable[[Progress], None] | None = None,
        progress_every_s: float = 5.0,
    ) -> None:
        self.endpoint = endpoint
        self.jobs = jobs
        self.on_progress = on_progress
        self.progress_every_s = progress_every_s
        self.progress = Progress(total=len(jobs))
        self.outcomes: list[Outcome] = []
        self._gate = asyncio.Semaphore(endpoint.concurrency)
        self._session_gate = (
            asyncio.Semaphore(endpoint.max_sessions) if endpoint.max_sessions else None
        )
        self._sessions: dict[str, _Session] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._stopped = False
        self._finished = False
        self._t0 = 0.0

    @property
    def t0(self) -> float:
        """The event loop's time when the replay started (``Outcome.sent_s`` counts from it)."""
        return self._t0

    def finish(self) -> None:
        """Send nothing more; what is in flight (and its retries) still answers."""
        self._finished = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()

    def stop(self) -> None:
        """Send nothing more and cancel what is in flight (each counted as ``cancelled``)."""
        self._stopped = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for task in list(self._tasks):
            task.cancel()

    async def run(self) -> ReplayRun:
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(
            limit=self.endpoint.concurrency, limit_per_host=0, keepalive_timeout=60
        )
        headers = {"content-type": "application/json", **self.endpoint.headers}
        async with aiohttp.ClientSession(
            connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
        ) as http:
            self._http = http
            self._t0 = loop.time()
            ticker = asyncio.create_task(self._tick()) if self.on_progress else None
            self._dispatcher = asyncio.create_task(self._dispatch())
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
            while self._tasks:
                done, _ = await asyncio.wait(set(self._tasks))
                for task in done:  # a bug in a request's handling is not swallowed
                    if not task.cancelled() and task.exception() is not None:
                        self.stop()
                        raise task.exception()  # type: ignore[misc]
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
                self._report(loop.time())
        ends = [o.sent_s + (o.e2e_s or 0.0) for o in self.outcomes]
        first = min((o.sent_s for o in self.outcomes), default=0.0)
        return ReplayRun(
            outcomes=sorted(self.outcomes, key=lambda o: (o.sent_s, o.index)),
            duration_s=max(ends, default=0.0) - first,
            stopped=self._stopped or self._finished,
            not_sent=len(self.jobs) - len(self.outcomes),
        )

    def _report(self, now: float) -> None:
        if self.on_progress is not None:
            self.progress.elapsed_s = now - self._t0
            self.on_progress(self.progress)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.progress_every_s)
            self._report(loop.time())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        for job in self.jobs:
            delay = self._t0 + job.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if job.session is None:
                self._spawn(self._send(job, self._t0 + job.at_s))
                continue
            sess = self._sessions.setdefault(job.session, _Session())
            sess.jobs.append(job)
            if job.session not in self._running:
                self._running[job.session] = self._spawn(self._run_session(job.session, sess))

    async def _run_session(self, name: str, sess: _Session) -> None:
        loop = asyncio.get_running_loop()
        gate = self._session_gate
        try:
            if gate is not None:
                await gate.acquire()
            try:
                while sess.jobs and not self._finished:
                    job = sess.jobs.popleft()
                    await self._send(job, max(self._t0 + job.at_s, sess.last_done))
                    sess.last_done = loop.time()
            finally:
                if gate is not None:
                    gate.release()
        finally:
            del self._running[name]

    async def _send(self, job: Job, due: float) -> None:
        loop = asyncio.get_running_loop()
        async with self._gate:
            body = job.body()
            sent = loop.time()
            out = Outcome(
                job.index, job.session, due - self._t0, sent - self._t0, job.trace_prompt_tokens
            )
            self.outcomes.append(out)
            self.progress.sent += 1
            try:
                while True:
                    await self._attempt(job, body, sent, out)
                    wait = self._retry_wait(out)
                    if wait is None:
                        break
                    out.attempts.append(
                        FailedAttempt(
                            out.error or "", out.status, out.retry_after, loop.time() - self._t0,
                            wait,
                        )
                    )  # fmt: skip
                    _reset(out)
                    await asyncio.sleep(wait)
            finally:
                if out.e2e_s is None:
                    out.e2e_s = loop.time() - sent if out.error is None else None
                self.progress.done += 1
                self.progress.errors += out.error is not None
                self.progress.events += out.events

    async def _attempt(self, job: Job, body: bytes, sent: float, out: Outcome) -> None:
        """One attempt; its failure, if any, in ``out.error`` (times from the first send)."""
        try:
            async with asyncio.timeout(self.endpoint.timeout_s):
                await self._exchange(job, body, sent, out)
        except TimeoutError:
            out.error = "timeout"
            out.detail = f"no complete answer in {self.endpoint.timeout_s} s"
        except asyncio.CancelledError:
            out.error, out.detail = "cancelled", "the replay was stopped"
            raise
        except aiohttp.ClientConnectorError as exc:
            out.error, out.detail = "connect", str(exc)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            out.error, out.detail = "disconnect", str(exc) or type(exc).__name__
        except (aiohttp.ClientError, OSError) as exc:
            out.error, out.detail = f"client_{type(exc).__name__}", str(exc)

    def _retry_wait(self, out: Outcome) -> float | None:
        """Seconds before the next attempt of ``out``, or None: no retry (see the module)."""
        err = out.error
        if err is None or len(out.attempts) >= self.endpoint.retries or self._stopped:
            return None
        retryable = (
            (out.status in RETRYABLE_STATUS and err == f"http_{out.status}")
            or err in ("connect", "disconnect")
            or err.startswith(("client_", "stream_"))
        )
        if not retryable:
            return None
        backoff = min(8.0, 0.5 * (1 << min(len(out.attempts), 5)))
        if out.retry_after is not None:  # at least what the server asks, backing off still
            with contextlib.suppress(ValueError):
                after = float(out.retry_after)
                if math.isfinite(after) and after >= 0:
                    return max(backoff, min(after, _RETRY_AFTER_CAP_S))
        return backoff

    async def _exchange(self, job: Job, body: bytes, sent: float, out: Outcome) -> None:
        assert self._http is not None
        loop = asyncio.get_running_loop()
        async with self._http.post(self.endpoint.url + job.path, data=body) as resp:
            out.status = resp.status
            out.instance = resp.headers.get(INSTANCE_HEADER)
            out.reason = resp.headers.get(REASON_HEADER)
            if resp.status != 200:
                out.retry_after = resp.headers.get("Retry-After")
                raw = await resp.content.read(_ERROR_BODY_BYTES)
                out.error = f"http_{resp.status}"
                out.detail = raw.decode(errors="replace").strip()
                return
            sse = SseReader(self.endpoint.keep_text)
            if resp.content_type == "text/event-stream":
                async for chunk in resp.content.iter_any():
                    if sse.feed(chunk):
                        out.ttft_s = loop.time() - sent
                sse.finish()
            else:  # a server that answered in one piece: its first token came with the rest
                sse.feed(b"data: " + (await resp.read()).replace(b"\n", b" ") + b"\n")
                if sse.content_events:
                    out.ttft_s = loop.time() - sent
            out.e2e_s = loop.time() - sent
        _record(sse, out)


def _reset(out: Outcome) -> None:
    """Forget a failed attempt's answer before the next one (``attempts`` keeps its kind)."""
    out.status = out.error = out.ttft_s = out.e2e_s = out.retry_after = None
    out.prompt_tokens = out.cached_tokens = out.instance = out.reason = None
    out.finish_reason = out.text = None
    out.detail, out.events, out.output_tokens, out.done = "", 0, 0, False


def _record(sse: SseReader, out: Outcome) -> None:
    out.events = sse.events
    out.done = sse.done
    out.finish_reason = sse.finish_reason
    out.text = sse.text
    usage = sse.usage
    out.output_tokens = sse.content_events
    if usage is not None:
        out.prompt_tokens = usage.prompt_tokens
        details = usage.prompt_tokens_details
        out.cached_tokens = (details.cached_tokens if details else None) or 0
        if usage.completion_tokens is not None:
            out.output_tokens = usage.completion_tokens
    if sse.error is not None:
        out.error, out.detail = sse.error, "the stream carried an error event"
    elif out.ttft_s is None:
        out.error, out.detail = "no_content", "the answer carried no content token"
