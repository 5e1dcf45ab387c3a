"""Text and chat messages → the token ids the engine prefills (install ``kvpool-protocol[chat]``).

Why this module exists: the gateway routes on the chunk hashes of the exact token ids the
engine will prefill. If the gateway rendered a chat with a different template, whitespace or
special-token handling than the worker, its ids (and so every hash) would differ from the
engine's and every lookup would miss. So there is one renderer, used by the worker's
``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` and ``/memory/*`` and by the
gateway: a HF ``tokenizers`` tokenizer (``tokenizer.json``) plus the chat template and special
tokens of the ``tokenizer_config.json`` beside it. The template is compiled the way HF
transformers' ``apply_chat_template`` compiles it (which is what vLLM renders chats with):
jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a
``{% generation %}`` block, and the globals and filters templates on the Hub rely on
(``raise_exception``, ``strftime_now``, ``namespace``, ``dict``, a non-escaping ``tojson``); the
tokenizer's special tokens are passed as template variables, and the rendered text is encoded
without adding special tokens.

Pure apart from :func:`load_tokenizer`, the explicit loader of those two files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

#: ChatML's end-of-turn token (the reference template's; vLLM's default stop for chat).
IM_END = "<|im_end|>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ChatError(ValueError):
    """A prompt that cannot be rendered; ``param`` names the request field to fix."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def content_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """The plain text of an OpenAI message ``content``: a string, or text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ChatError("only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (HF marks assistant spans)."""

    tags = {"generation"}  # noqa: RUF012 -- jinja2's Extension API is a class attribute

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled the way HF transformers compiles it."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = jinja2.utils.Namespace
    env.globals["dict"] = dict
    return env.from_string(template)


_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TextTokenizer:
    """A HF ``tokenizers`` tokenizer plus its ``tokenizer_config.json`` facts."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, object]) -> None:
        self._tok = tokenizer
        self.config = dict(config)
        template = config.get("chat_template")
        self._template = compile_chat_template(template) if isinstance(template, str) else None
        self._special_tokens = {
            key: token
            for key in _SPECIAL_TOKEN_KEYS
            if (token := _token_text(config.get(key))) is not None
        }
        self.eos_token_id = self._special_id(config.get("eos_token"))
        self.bos_token_id = self._special_id(config.get("bos_token"))
        self.pad_token_id = self._special_id(config.get("pad_token"))
        self.im_end_token_id = self._tok.token_to_id(IM_END)

    def _special_id(self, token: object) -> int | None:
        text = _token_text(token)
        return self._tok.token_to_id(text) if text is not None else None

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
        """The prompt text of ``messages`` rendered with the model's chat template."""
        if self._template is None:
            raise ChatError("this tokenizer has no chat_template in tokenizer_config.json")
        try:
            return self._template.render(
                **self._special_tokens,
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as exc:
            raise ChatError(f"the chat template refused these messages ({exc})") from exc

    def chat_token_ids(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The token ids the engine prefills for a chat request: template, then encode."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn (ChatML's ``<|im_end|>``)."""
        return (self.im_end_token_id,) if self.im_end_token_id is not None else ()


def _token_text(token: object) -> str | None:
    """A special token as text (``tokenizer_config.json`` may hold HF's AddedToken form)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load ``tokenizer.json`` (a file, or a directory holding one) and the config beside it.

    Raises ``FileNotFoundError`` naming the missing file, ``ValueError`` for a broken one.
    """
    target = Path(path)
    tok_file = target / TOKENIZER_FILE if target.is_dir() else target
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer file at {tok_file}")
    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # the Rust loader raises a bare Exception on a broken file
        raise ValueError(f"{tok_file} is not a tokenizers JSON file ({exc})") from exc
    cfg_file = tok_file.parent / TOKENIZER_CONFIG_FILE
    config: dict[str, object] = {}
    if cfg_file.is_file():
        try:
            loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_file} is not valid JSON ({exc})") from exc
        if isinstance(loaded, dict):
            config = loaded
    return TextTokenizer(tokenizer, config)
