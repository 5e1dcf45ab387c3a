"""A request's prompt as token ids and chained chunk hashes — what the router routes on.

Why this module exists: KV affinity needs the exact token ids the engine will prefill and
LMCache's chunk hashes of them. Completions may already carry token ids; text prompts and chat
messages are tokenized (and chat rendered with the model's template) by kvpool.protocol's
tokenizer, the same code the worker runs, so the ids and therefore the hashes are the
engine's. When the gateway has no tokenizer file it asks one ready instance's ``/tokenize``
(one extra round trip, same ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvpool.gateway.config import ConfigError, GatewayConfig
from kvpool.gateway.errors import GatewayError, bad_request, upstream_error
from kvpool.gateway.instances import InstanceSet
from kvpool.gateway.upstream import CALL_ERRORS, Upstream
from kvpool.protocol.chat import (
    REFERENCE_TOKENIZER_DIR,
    TOKENIZER_FILE,
    ChatError,
    ChatMessage,
    TextTokenizer,
    content_text,
    load_tokenizer,
)

TOKENIZE_TIMEOUT_S = 5.0
#: ``tokenizer: reference`` in gateway.yaml: kvpool's reference engine tokenizer.
REFERENCE = "reference"


class Encoder(Protocol):
    """Token ids of a completion prompt or of rendered chat messages."""

    async def completion(self, prompt: str) -> list[int]: ...

    async def chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> list[int]: ...

    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn (added to PD requests sent as completions)."""
        ...


class RemoteEncoder:
    """Tokenizes on a ready instance (``POST /tokenize``, the worker's own tokenizer)."""

    def __init__(self, instances: InstanceSet, upstream: Upstream) -> None:
        self.instances = instances
        self.upstream = upstream

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        ready = self.instances.available(self.instances)
        if not ready:
            raise upstream_error(
                503, "no instance is ready to tokenize the prompt", "no_instance_available"
            )
        last = ""
        for inst in sorted(ready, key=lambda i: i.name)[:2]:
            try:
                status, payload, _ = await self.upstream.post_json(
                    f"{inst.url}/tokenize", body, TOKENIZE_TIMEOUT_S
                )
            except CALL_ERRORS as exc:
                last = f"{inst.name}: {type(exc).__name__}"
                continue
            if status == 400 and isinstance(payload, dict):
                err = payload.get("error", {})
                raise GatewayError(str(err.get("message", "bad prompt")), param=err.get("param"))
            if status == 200 and isinstance(payload, dict):
                return [int(t) for t in payload["tokens"]]
            last = f"{inst.name}: HTTP {status}"
        raise upstream_error(
            502, f"tokenization failed ({last})", "tokenize_failed", retry_after=True
        )

    async def completion(self, prompt: str) -> list[int]:
        return await self._tokenize({"prompt": prompt})

    def chat_stop_token_ids(self) -> tuple[int, ...]:
        return ()  # unknown without the tokenizer: configure ``tokenizer`` for PD chat

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        return await self._tokenize(
            {"messages": messages, "add_generation_prompt": add_generation_prompt}
        )


class LocalEncoder:
    """Tokenizes in the gateway with kvpool.protocol's tokenizer (the worker's own code).

    Long inputs are tokenized on a worker thread so one 32K-token prompt does not stall
    every other request on the event loop.
    """

    INLINE_CHARS = 4096

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    async def _run(self, size: int, fn: Callable[[], list[int]]) -> list[int]:
        if size <= self.INLINE_CHARS:
            return fn()
        return await asyncio.to_thread(fn)

    async def completion(self, prompt: str) -> list[int]:
        return await self._run(len(prompt), lambda: self.tokenizer.encode(prompt))

    def chat_stop_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.chat_stop_token_ids()

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        msgs = [ChatMessage(str(m["role"]), content_text(m.get("content"))) for m in messages]
        size = sum(len(m.content) for m in msgs)

        def render() -> list[int]:
            try:
                return self.tokenizer.chat_token_ids(
                    msgs, add_generation_prompt=add_generation_prompt
                )
            except ChatError as exc:
                raise bad_request(f"{exc.param}: {exc}", exc.param) from exc

        return await self._run(size, render)


def encoder_for(config: GatewayConfig, instances: InstanceSet, upstream: Upstream) -> Encoder:
    """The encoder for ``config``: local when ``tokenizer`` names the model's tokenizer
    files, else the workers' own ``/tokenize`` (exact too, one round trip more)."""
    if config.tokenizer is None:
        return RemoteEncoder(instances, upstream)
    try:
        return LocalEncoder(local_tokenizer(config.tokenizer, config.model))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer: {exc}") from None


def local_tokenizer(name: str, model: str | None = None) -> TextTokenizer:
    """gateway.yaml's ``tokenizer`` loaded: a tokenizer.json (or its directory), a Hugging Face
    hub cache holding ``model`` (see :func:`hub_snapshot`), or ``reference``; raises OSError or
    ValueError naming the file."""
    if name == REFERENCE:
        return load_tokenizer(REFERENCE_TOKENIZER_DIR)
    path = Path(name)
    if model and path.is_dir() and not (path / TOKENIZER_FILE).exists():
        snapshot = hub_snapshot(path, model)
        if snapshot is None:
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {path}, nor a Hugging Face cache entry "
                f"{hub_repo_dir(model)} of the model {model!r} in it or in {path / 'hub'}"
            )
        path = snapshot
    return load_tokenizer(path)


def hub_repo_dir(model: str) -> str:
    """The directory a Hugging Face hub cache keeps a model repository in."""
    return "models--" + model.replace("/", "--")


def hub_snapshot(root: Path, model: str) -> Path | None:
    """The snapshot of ``model`` in a Hugging Face hub cache at ``root`` (``HF_HUB_CACHE``), or
    in ``root/hub`` (``HF_HOME``): the revision ``refs/main`` names, else the only snapshot
    there is; None when the cache has no entry for the model. The files a vLLM worker loads the
    model from, so the gateway tokenizes with exactly the engine's tokenizer."""
    for base in (root, root / "hub"):
        entry = base / hub_repo_dir(model)
        if not entry.is_dir():
            continue
        snapshots = entry / "snapshots"
        ref = entry / "refs" / "main"
        if ref.is_file():
            named = snapshots / ref.read_text(encoding="utf-8").strip()
            if named.is_dir():
                return named
        found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        if len(found) != 1:
            raise FileNotFoundError(
                f"{entry}: {len(found)} snapshots and no refs/main naming one of them; give "
                "the snapshot directory itself as the tokenizer"
            )
        return found[0]
    return None


async def completion_tokens(encoder: Encoder, prompt: str | list[Any]) -> list[int]:
    """One prompt: text, token ids, or a batch of exactly one of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await encoder.completion(prompt)
    ids = [int(t) for t in prompt]
    if any(t < 0 for t in ids):
        raise bad_request("prompt: token ids must be non-negative", "prompt")
    return ids


async def chat_tokens(
    encoder: Encoder, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    """Token ids of chat messages (role and plain-text content) rendered with the template."""
    return await encoder.chat(messages, add_generation_prompt)


def check_tokens(tokens: Sequence[int], param: str) -> None:
    if not tokens:
        raise bad_request(f"{param}: the prompt is empty; send at least one token", param)
