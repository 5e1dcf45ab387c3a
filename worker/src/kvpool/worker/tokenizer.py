"""Text in, token ids out, and back: the runtime side of tokenization.

Why this module exists: the Engine protocol speaks token ids only, so the HTTP runtime owns
the tokenizer (the committed reference ``tokenizer.json`` or a model directory's), the chat
template (ChatML by default, read from ``tokenizer_config.json`` beside the tokenizer, the
same file the gateway loads), incremental detokenization for streaming, and stop strings
(which must hold back text that could still become a stop string).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
IM_END = "<|im_end|>"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class TextTokenizer:
    """A HF ``tokenizers`` tokenizer plus the special-token facts the runtime needs."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, object]) -> None:
        self._tok = tokenizer
        self.config = dict(config)
        template = config.get("chat_template")
        self._template = (
            ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False).from_string(
                template
            )
            if isinstance(template, str)
            else None
        )
        self.eos_token_id = self._special_id(config.get("eos_token"))
        self.bos_token_id = self._special_id(config.get("bos_token"))
        self.pad_token_id = self._special_id(config.get("pad_token"))
        self.im_end_token_id = self._tok.token_to_id(IM_END)

    def _special_id(self, token: object) -> int | None:
        if isinstance(token, dict):  # HF AddedToken form {"content": ...}
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.config.get("bos_token", ""),
            eos_token=self.config.get("eos_token", ""),
        )

    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn (ChatML's ``<|im_end|>``)."""
        return (self.im_end_token_id,) if self.im_end_token_id is not None else ()


def load_tokenizer(path: str | Path | None = None) -> TextTokenizer:
    """Load ``tokenizer.json`` (a file, or a directory holding one) and the config beside it.

    ``None`` loads the committed reference tokenizer from the package assets.
    """
    target = Path(path) if path is not None else ASSETS_DIR
    tok_file = target / "tokenizer.json" if target.is_dir() else target
    cfg_file = tok_file.parent / "tokenizer_config.json"
    tokenizer = Tokenizer.from_file(str(tok_file))
    config: dict[str, object] = {}
    if cfg_file.is_file():
        loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            config = loaded
    logger.info("loaded tokenizer %s (%d ids)", tok_file, tokenizer.get_vocab_size())
    return TextTokenizer(tokenizer, config)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without splitting UTF-8 characters.

    Byte-level BPE tokens can end in the middle of a multi-byte character; decoding then
    yields U+FFFD. Keep a small window of ids and only emit once the window decodes cleanly.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
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

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()) -> None:
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
