"""Tokenization cost of the gateway's own tokenize path at 1K/8K/32K tokens (in process).

Why this module exists: the overhead benchmark sends a few-token prompt, so its added latency
leaves tokenization out; a long agent prompt pays it on every request. Measured here apart,
through the parts the gateway routes with, wired by its own ``build_state`` from the rendered
gateway config: the encoder (chat rendering + tokenizer, or a worker's ``/tokenize`` while the
gateway has no local tokenizer: the encoder's class is reported) and the chunk hasher. Median
of a few calls per size, on chat bodies of about the given sizes: ``tokenize_ms_*`` is the
whole path a request pays (render, encode, chunk hashes), ``encode_ms_*`` and ``hash_ms_*``
its parts, ``tokenize_cpu_ms_*`` the CPU time of the whole path (every thread of the
process: on a shared box the wall time also counts waiting for a core). The encoder is named
with the library that encodes (``LocalEncoder/tiktoken``: kvpool.protocol.fastbpe's mirror);
``encode_tokenizers_ms_*`` is the same rendered text through HF ``tokenizers``, side by side.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from kvpool.gateway.config import parse_config
from kvpool.gateway.instances import probe_all
from kvpool.gateway.state import build_state
from kvpool.gateway.traces.agent import filler
from kvpool.protocol.chat import ChatMessage

SIZES = {"1k": 1024, "8k": 8192, "32k": 32768}


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


async def _measure(config: dict[str, Any], repeats: int) -> tuple[dict[str, float], str]:
    state = build_state(parse_config(config))
    try:
        await probe_all(
            state.http, state.instances, state.metrics, 5.0
        )  # a remote encoder asks a ready one
        enc = state.encoder
        out: dict[str, float] = {}
        for key, target in SIZES.items():
            text = filler(random.Random(target), target)  # ~1.4 tokens per word: trimmed below
            words = text.split()
            ids = await enc.chat([{"role": "user", "content": text}], True)
            messages = [
                {"role": "user", "content": " ".join(words[: len(words) * target // len(ids)])}
            ]
            enc_s, hash_s, cpu_s = [], [], []
            for _ in range(repeats):
                c0 = time.process_time()
                t0 = time.perf_counter()
                ids = await enc.chat(messages, True)
                t1 = time.perf_counter()
                state.hasher(ids)
                hash_s.append(time.perf_counter() - t1)
                cpu_s.append(time.process_time() - c0)
                enc_s.append(t1 - t0)
            tokenizer = getattr(enc, "tokenizer", None)
            if tokenizer is not None:  # the same text through HF tokenizers, side by side
                text = tokenizer.apply_chat_template([ChatMessage(**m) for m in messages])
                hf_s = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    tokenizer.encode_tokenizers(text)
                    hf_s.append(time.perf_counter() - t0)
                out[f"encode_tokenizers_ms_{key}"] = _median_ms(hf_s)
            both = [a + b for a, b in zip(enc_s, hash_s, strict=True)]
            out[f"tokenize_ms_{key}"] = _median_ms(both)
            out[f"encode_ms_{key}"] = _median_ms(enc_s)
            out[f"hash_ms_{key}"] = _median_ms(hash_s)
            out[f"tokenize_cpu_ms_{key}"] = _median_ms(cpu_s)
            out[f"tokenize_tokens_{key}"] = float(len(ids))
        library = getattr(getattr(enc, "tokenizer", None), "encoder_name", "")
        return out, f"{type(enc).__name__}/{library}" if library else type(enc).__name__
    finally:
        await state.http.aclose()


def run(config: dict[str, Any], quick: bool) -> tuple[dict[str, float], str]:
    """Milliseconds per size (tokenize, hash, and the token count reached) and the encoder's
    class name."""
    return asyncio.run(_measure(config, 3 if quick else 9))
