"""Instant OpenAI-shaped upstreams: answer every completion at once, for the overhead benchmark.

Why this module exists: the gateway's own cost (parse, tokenize, hash, score, proxy) is only
measurable against upstreams that cost nothing. One process listens on several ports (one per
"instance") with a raw asyncio HTTP/1.1 server (keep-alive, no framework), so the upstream is
never the bottleneck of a router in front of it. It answers:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: a fixed one-token answer with
  ``usage``; with ``"stream": true`` an SSE stream (chunked) of one content event (or
  min(``max_completion_tokens`` or ``max_tokens``, ``--max-events``) of them, one token
  each), a usage event and ``[DONE]``;
- ``POST /tokenize``: three token ids (what a gateway without a local tokenizer asks for);
- ``GET /v1/models``: the model list; any other ``GET`` (health, readiness, metrics): 200.

Run: ``python upstream.py --ports P1,P2,... [--model NAME] [--max-events N] [--decode]``;
prints ``READY`` when listening. (``--max-events`` > 1 measures a client's SSE event rate:
``kvpool-gateway replay``'s capacity, ``replay_capacity.py``, and a router's SSE pass-through,
``sse.py``.) With ``--decode`` a stream is written one event at a time, yielding to the other
streams between events, as an engine decoding a batch sends one token of each sequence per
step; without it the whole stream leaves in one write.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
_CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _usage(prompt_tokens: int, completion_tokens: int = 1) -> dict[str, object]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream:
    def __init__(self, model: str, max_events: int = 1, decode: bool = False) -> None:
        self.model = model
        self.max_events = max_events
        self.decode = decode
        self.requests = 0

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        return b"".join(self.answer_parts(method, path, body))

    def answer_parts(self, method: bytes, path: bytes, body: bytes) -> list[bytes]:
        """The answer as the pieces written one by one with ``--decode`` (a stream's head,
        each event, the end); any other answer is one piece."""
        return (
            [self._answer(method, path, body)]
            if not self.decode
            else self._parts(method, path, body)
        )

    def _parts(self, method: bytes, path: bytes, body: bytes) -> list[bytes]:
        whole = self._answer(method, path, body)
        if not whole.startswith(_CHUNKED):
            return [whole]
        parts = [_CHUNKED]
        rest = whole[len(_CHUNKED) :]
        while rest:
            size_end = rest.index(b"\r\n")
            size = int(rest[:size_end], 16)
            end = size_end + 2 + size + 2
            parts.append(rest[:end])
            rest = rest[end:]
        return parts

    def _answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        self.requests += 1
        if method == b"GET":
            if path.startswith(b"/v1/models"):
                data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
                return self._json(data)
            return self._json({"status": "ok"})
        if path.startswith(b"/tokenize"):  # a gateway without a local tokenizer asks here
            return self._json({"tokens": [1, 2, 3], "count": 3, "max_model_len": 8704})
        chat = path.startswith(b"/v1/chat/completions")
        if not chat and not path.startswith(b"/v1/completions"):
            return self._json({"status": "ok"})
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            req = {}
        stream = bool(req.get("stream"))
        prompt = req.get("messages") if chat else req.get("prompt")
        n = len(json.dumps(prompt)) // 4 if prompt else 1  # a size, not a tokenizer
        base = {
            "id": "cmpl-instant",
            "created": int(time.time()),
            "model": req.get("model") or self.model,
        }
        if not stream:
            choice: dict[str, object] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "ok"}
            else:
                choice["text"] = "ok"
            obj = "chat.completion" if chat else "text_completion"
            return self._json({**base, "object": obj, "choices": [choice], "usage": _usage(n)})
        obj = "chat.completion.chunk" if chat else "text_completion"
        delta: dict[str, object] = (
            {"delta": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
        )
        wanted = req.get("max_completion_tokens") or req.get("max_tokens") or 1  # either name
        k = max(1, min(int(wanted), self.max_events))
        content = {**base, "object": obj, "choices": [{"index": 0, **delta, "finish_reason": None}]}
        usage = {**base, "object": obj, "choices": [], "usage": _usage(n, k)}
        event = _chunk(b"data: " + json.dumps(content).encode() + b"\n\n")
        out = [_CHUNKED, event * k, _chunk(b"data: " + json.dumps(usage).encode() + b"\n\n")]
        out += [_chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
        return b"".join(out)

    @staticmethod
    def _json(data: object) -> bytes:
        payload = json.dumps(data).encode()
        return _HEAD % (b"application/json", len(payload)) + payload

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                parts = lines[0].split(b" ")
                if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
                    break  # e.g. an HTTP/2 prior-knowledge preface: HTTP/1.1 only here
                method, path = parts[0], parts[1]
                length = 0
                chunked = False
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"transfer-encoding" and b"chunked" in value.lower():
                        chunked = True
                body = await reader.readexactly(length) if length else b""
                if chunked:
                    body = await _read_chunked(reader)
                parts = self.answer_parts(method, path, body)
                for n, part in enumerate(parts):
                    writer.write(part)
                    if n + 1 < len(parts):
                        await asyncio.sleep(0)  # the other streams' turn (a decode step)
                await writer.drain()
        writer.close()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def serve(ports: list[int], model: str, max_events: int = 1, decode: bool = False) -> None:
    up = Upstream(model, max_events, decode)
    servers = [await asyncio.start_server(up.handle, "127.0.0.1", p, backlog=1024) for p in ports]
    print("READY", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--ports", required=True, help="comma-separated ports on 127.0.0.1")
    ap.add_argument("--model", default="kvpool/reference-tiny")
    ap.add_argument(
        "--max-events", type=int, default=1, help="content events of a streamed answer, at most"
    )
    ap.add_argument(
        "--decode", action="store_true", help="write a stream one event at a time (see above)"
    )
    args = ap.parse_args()
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        ports = [int(p) for p in args.ports.split(",")]
        asyncio.run(serve(ports, args.model, args.max_events, args.decode))


if __name__ == "__main__":
    main()
