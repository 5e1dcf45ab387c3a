"""The proxy's answers as ASGI responses: a whole answer in one write, or a stream passed
through chunk by chunk, with the least work per request and per chunk.

Why this module exists: Starlette's ``Response`` re-encodes a header dict for every answer,
and its ``StreamingResponse`` starts a task group (an extra task and cancel scope per request)
to notice a client that leaves. An upstream answer's headers arrive here already as a list
and go out as one; a stream watches the connection with one plain task that cancels the
stream when the client disconnects, which closes the upstream connection (the worker stops
generating). Both are Starlette responses, so the routes and the PD flow handle them as any
other (``body`` / ``status_code``, ``body_iterator``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

RawHeaders = list[tuple[bytes, bytes]]


def raw_headers(pairs: list[tuple[str, str]], drop: frozenset[str]) -> RawHeaders:
    """``pairs`` (lowercase names) as ASGI headers, without the names in ``drop``."""
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs if k not in drop]


class WholeResponse(Response):
    """A complete answer: head and body in one go, with ``Content-Length``."""

    def __init__(self, body: bytes, status: int, headers: RawHeaders) -> None:
        self.body = body
        self.status_code = status
        self.background = None
        self.media_type = None
        self.raw_headers = [*headers, (b"content-length", b"%d" % len(body))]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.body})


class PassThroughStream(StreamingResponse):
    """A streamed answer forwarded as its chunks arrive; a client that disconnects cancels
    the stream (the chunk iterator sees ``CancelledError`` and closes its upstream)."""

    def __init__(self, chunks: AsyncIterator[bytes], status: int, headers: RawHeaders) -> None:
        self.body_iterator = chunks
        self.status_code = status
        self.background = None
        self.media_type = None
        self.raw_headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # our own cancel: the client left, the stream is closed
        finally:
            watcher.cancel()
            # a cancel that landed in ``send`` leaves the iterator suspended: close it now
            # (its cleanup frees the load, the admission slot and the upstream connection)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
