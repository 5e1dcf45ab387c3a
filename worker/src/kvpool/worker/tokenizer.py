"""Text in, token ids out, and back: the runtime side of tokenization.

Why this module exists: the Engine protocol speaks token ids only, so the HTTP runtime owns
the tokenizer (the committed reference ``tokenizer.json`` or a model directory's), incremental
detokenization for streaming, and stop strings (which must hold back text that could still
become a stop string). Prompt rendering itself — text and chat messages to the ids the engine
prefills — is :mod:`kvpool.protocol.chat`, the code the gateway runs too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from kvpool.protocol import chat

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path | None = None, *, memo: int = 0) -> chat.TextTokenizer:
    """The tokenizer at ``path`` (see :func:`kvpool.protocol.chat.load_tokenizer`); ``None``
    loads the reference engine's (``kvpool.protocol.chat.REFERENCE_TOKENIZER_DIR``)."""
    target = path if path is not None else chat.REFERENCE_TOKENIZER_DIR
    tokenizer = chat.load_tokenizer(target, memo=memo)
    logger.info("loaded tokenizer %s (%d ids)", target, tokenizer.vocab_size)
    return tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without splitting UTF-8 characters.

    Byte-level BPE tokens can end in the middle of a multi-byte character; decoding then
    yields U+FFFD. Keep a small window of ids and only emit once the window decodes cleanly.
    """

    def __init__(self, tokenizer: chat.TextTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character decodes as U+FFFD)."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]


class TextStream:
    """Incremental detokenization plus stop strings, for one generated sequence.

    ``push`` returns the text that is safe to emit now. Text that could be the start of a
    stop string is held back until it is known not to be one; once a stop string appears,
    ``stopped`` is True and the output ends right before it (OpenAI semantics).
    """

    def __init__(self, tokenizer: chat.TextTokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = [s for s in stop if s]
        self._held = ""
        self.stopped = False
        self.text = ""  # everything emitted so far

    def _emit(self, text: str) -> str:
        self.text += text
        return text

    def _feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + delta
        hits = [i for i in (buf.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return self._emit(buf[: min(hits)])
        keep = _longest_partial_stop(buf, self._stop)
        self._held = buf[len(buf) - keep :] if keep else ""
        return self._emit(buf[: len(buf) - keep])

    def push(self, token_id: int) -> str:
        return self._feed(self._detok.push(token_id))

    def finish(self) -> str:
        """End of generation: release held text (it can no longer become a stop string)."""
        out = self._feed(self._detok.flush())
        if self.stopped:
            return out
        held, self._held = self._held, ""
        return out + self._emit(held)


def _longest_partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
