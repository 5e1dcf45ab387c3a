"""``kvpool-gateway hashes``: a prompt's token ids and LMCache chunk hashes, as JSON.

Why this module exists: when a pool shows 0 % hits, the first question is whether the gateway,
the controller and the workers agree on the hashes of one prompt. This command prints them the
way the router computes them — the same request models (``CompletionBody``, ``ChatBody``), the
same tokenizer (:mod:`kvpool.protocol.chat` through ``LocalEncoder``) and the same hashing
regime (``GatewayConfig.hash_config`` → :mod:`kvpool.protocol.hashing`) — for a rendered
``gateway.yaml`` or for a regime given by flags, so the output can be compared with what a
worker's LMCache stored (``/memory`` answers, the controller's ``/v1/prefix_lookup``).

    kvpool-gateway hashes --config gateway.yaml --prompt "hello"
    kvpool-gateway hashes --chunk-size 256 --hash-algorithm sha256_cbor --vllm --seed 123 \\
        --tokenizer ./tokenizer.json --chat body.json
    kvpool-gateway hashes --chunk-size 4 --tokens 1,2,3,4,5 --save-unfull-chunk

Bad input exits 2 with one line naming the flag (or the config key) and the fix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvpool.gateway.config import ConfigError, GatewayConfig, load_config
from kvpool.gateway.errors import GatewayError, bad_request
from kvpool.gateway.models import ChatBody, CompletionBody
from kvpool.gateway.prompts import LocalEncoder, chat_tokens, completion_tokens, local_tokenizer
from kvpool.protocol.chat import TextTokenizer
from kvpool.protocol.hashing import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_HASH_ALGORITHM,
    HASH_ALGORITHMS,
    HashConfig,
    HashConfigError,
    iter_chunk_hashes,
    none_hash,
)

EXIT_OK = 0
EXIT_REFUSED = 2
_FLAG_OF = {
    "chunk_size": "--chunk-size",
    "hash_algorithm": "--hash-algorithm",
    "hash_seed": "--seed",
}


class HashesError(Exception):
    """Bad input to ``hashes``; the message starts with the flag to fix."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``hashes`` on ``kvpool-gateway``'s subcommands (called by ``cli.main``)."""
    p = sub.add_parser(
        "hashes",
        help="print a prompt's token ids and LMCache chunk hashes as JSON",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    src = p.add_argument_group("the prompt (exactly one)").add_mutually_exclusive_group(
        required=True
    )
    src.add_argument("--prompt", help="completion prompt text")
    src.add_argument(
        "--chat", metavar="FILE", help="chat body JSON (or a messages list); - = stdin"
    )
    src.add_argument("--tokens", help="token ids: 1,2,3 or a JSON list")
    regime = p.add_argument_group("the pool's hashing regime (default: from --config)")
    regime.add_argument("--config", metavar="GATEWAY_YAML", help="the rendered gateway.yaml")
    regime.add_argument("--chunk-size", type=int, help=f"tokens per chunk ({DEFAULT_CHUNK_SIZE})")
    regime.add_argument("--hash-algorithm", help=f"{' | '.join(HASH_ALGORITHMS)}")
    regime.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engines import vLLM (cuda/ascend workers; not the cpu reference engine)",
    )
    regime.add_argument("--seed", help="the domain's PYTHONHASHSEED (default: $PYTHONHASHSEED)")
    regime.add_argument(
        "--save-unfull-chunk",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also hash the trailing partial chunk (LMCache save_unfull_chunk; routing: no)",
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json or its directory, or 'reference' (default: from --config)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """The ``hashes`` handler: JSON on stdout, or one error line on stderr and exit 2."""
    try:
        out = compute(args, os.environ.get("PYTHONHASHSEED"), sys.stdin.read)
    except HashesError as exc:
        print(f"kvpool-gateway hashes: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def compute(
    args: argparse.Namespace, env_seed: str | None, read_stdin: Callable[[], str]
) -> dict[str, Any]:
    """Tokens and chunk hashes for the parsed arguments (pure apart from reading files)."""
    config = _load(args.config) if args.config else None
    cfg = _regime(args, config, env_seed)
    tokens = _tokens(args, config, read_stdin)
    chunks = list(iter_chunk_hashes(tokens, cfg))
    return {
        "regime": {
            "chunk_size": cfg.chunk_size,
            "hash_algorithm": cfg.hash_algorithm,
            "effective_algorithm": cfg.effective_algorithm,
            "vllm": cfg.vllm,
            "hash_seed": cfg.hash_seed,
            "save_unfull_chunk": cfg.save_unfull_chunk,
            "none_hash": none_hash(cfg),
        },
        "num_tokens": len(tokens),
        "tokens": tokens,
        "chunks": [
            {"index": i, "start": c.start, "end": c.end, "hash": c.hash}
            for i, c in enumerate(chunks)
        ],
        "hashes": [c.hash for c in chunks],
    }


def _load(path: str) -> GatewayConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        raise HashesError(f"--config: {exc}") from None


def _regime(
    args: argparse.Namespace, config: GatewayConfig | None, env_seed: str | None
) -> HashConfig:
    """The router's regime for ``config`` (``GatewayConfig.hash_config``), flags overriding."""
    seed = args.seed if args.seed is not None else env_seed
    overrides = {
        key: value
        for key, value in (
            ("chunk_size", args.chunk_size),
            ("hash_algorithm", args.hash_algorithm),
            ("vllm", args.vllm),
        )
        if value is not None
    }
    try:
        if config is not None:
            return config.model_copy(update=overrides).hash_config(
                seed, save_unfull_chunk=args.save_unfull_chunk
            )
        return HashConfig(
            chunk_size=overrides.get("chunk_size", DEFAULT_CHUNK_SIZE),
            hash_algorithm=overrides.get("hash_algorithm", DEFAULT_HASH_ALGORITHM),
            hash_seed=seed,
            save_unfull_chunk=args.save_unfull_chunk,
            vllm=bool(overrides.get("vllm", False)),
        )
    except ConfigError as exc:  # the config's regime, named by its key or PYTHONHASHSEED
        raise HashesError(f"--config: {exc}") from None
    except HashConfigError as exc:
        flag = _FLAG_OF.get(exc.field, exc.field)
        if exc.field == "hash_seed" and args.seed is None:
            flag = "--seed (or PYTHONHASHSEED)"
        raise HashesError(f"{flag}: {exc.reason}") from None


def _tokens(
    args: argparse.Namespace, config: GatewayConfig | None, read_stdin: Callable[[], str]
) -> list[int]:
    if args.tokens is not None:
        return _parse_tokens(args.tokens)
    encoder = LocalEncoder(_tokenizer(args, config))
    try:
        if args.prompt is not None:
            body = CompletionBody.model_validate({"prompt": args.prompt})
            return asyncio.run(completion_tokens(encoder, body.prompt))
        text = read_stdin() if args.chat == "-" else _read(args.chat)
        chat = _chat_body(text)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in chat.messages]
        except ValueError as exc:
            raise bad_request(f"messages: {exc}", "messages") from exc
        return asyncio.run(chat_tokens(encoder, messages, chat.add_generation_prompt))
    except GatewayError as exc:
        flag = "--prompt" if args.prompt is not None else "--chat"
        raise HashesError(f"{flag}: {exc}") from None


def _tokenizer(args: argparse.Namespace, config: GatewayConfig | None) -> TextTokenizer:
    path = args.tokenizer or (config.tokenizer if config is not None else None)
    if path is None:
        raise HashesError(
            "--tokenizer: a prompt or chat needs the model's tokenizer.json (the gateway config "
            "names none); pass --tokenizer PATH, or give --tokens"
        )
    try:
        return local_tokenizer(path)
    except (OSError, ValueError) as exc:
        where = "--tokenizer" if args.tokenizer else "--config: tokenizer"
        raise HashesError(f"{where}: {exc}") from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise HashesError(f"--chat: cannot read {path}: {exc.strerror}") from None


def _chat_body(text: str) -> ChatBody:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HashesError(f"--chat: not JSON ({exc})") from None
    if isinstance(data, list):
        data = {"messages": data}
    try:
        return ChatBody.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(body)"
        raise HashesError(f"--chat: {where}: {first['msg']}") from None


def _parse_tokens(text: str) -> list[int]:
    raw = text.strip()
    try:
        values = (
            json.loads(raw) if raw.startswith("[") else [v for v in raw.split(",") if v.strip()]
        )
        if not isinstance(values, list) or any(isinstance(v, bool | float) for v in values):
            raise TypeError(values)
        tokens = [int(v) for v in values]
    except (ValueError, TypeError):
        raise HashesError(
            f"--tokens: {text!r:.60} is not a list of token ids (write 1,2,3 or [1, 2, 3])"
        ) from None
    if any(t < 0 for t in tokens):
        raise HashesError("--tokens: token ids must be non-negative")
    return tokens
