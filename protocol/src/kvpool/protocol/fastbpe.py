"""The same token ids from a byte-level BPE, about five times faster: tiktoken, where it mirrors it.

Why this module exists: the gateway tokenizes every chat it routes (issue 15: an 8K-token
agent prompt cost ~18 ms in HF ``tokenizers``, which alone caps one gateway process at a few
dozen long requests a second). Most engines' tokenizers (GPT-2 style, Qwen2/3, Llama 3) are
byte-level BPEs that OpenAI's ``tiktoken`` encodes with the same algorithm and a faster
pre-tokenizer and merge loop. This module reads a ``tokenizer.json`` and builds the equivalent
``tiktoken.Encoding`` only when every part of the pipeline maps one to one; anything it cannot
mirror exactly (a normalizer, byte fallback, dropout, subword prefixes, added tokens that strip
whitespace, a pre-tokenizer other than the GPT-2 regex or one ``Split`` regex followed by a
regex-free ``ByteLevel``, a vocabulary whose ids do not follow its merge order) gives None, and
the caller keeps HF ``tokenizers``. Token ids are the one truth the gateway and the engine must
share, so :class:`~kvpool.protocol.chat.TextTokenizer` also compares both encoders on
:data:`PROBE` when it loads and keeps the fast one only if they agree (the parity tests compare
them on much more). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import tiktoken

#: ``tokenizers``' ByteLevel regex (GPT-2's), what ``use_regex: true`` splits words with.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Text both encoders must agree on before the fast one is used: words, contractions,
#: numbers, punctuation runs, whitespace runs and newlines, accents, CJK, emoji.
PROBE = (
    "Hello, world! It's 2026; we'll see: x=3.14159 + 42*y   (tabs\tand\n\nnewlines)\r\n"
    "  indented {json: [1, 2, 3]} naïve café Ünïcödé 中文字符 日本語テキスト 🙂👍 -- __init__ "
    "don't STOP   trailing   \n"
)


def _bytes_to_unicode() -> dict[str, int]:
    """ByteLevel's printable stand-in for each byte (GPT-2's table), inverted: char -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _pattern(pre: Mapping[str, Any] | None) -> str | None:
    """The regex ``pre`` splits words with, when it is one tiktoken can apply alone."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or "Regex" not in (split.get("pattern") or {})
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space")
    ):
        return None
    return str(split["pattern"]["Regex"])


def _merge_ids(model: Mapping[str, Any]) -> list[int] | None:
    """The id of each merge's product, in merge order (None if a merge is malformed)."""
    vocab: Mapping[str, int] = model["vocab"]
    ids = []
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        product = vocab.get(left + right)
        if product is None:
            return None
        ids.append(product)
    return ids


def tiktoken_encoding(tokenizer_json: str, name: str = "kvpool") -> tiktoken.Encoding | None:
    """tiktoken's equivalent of the tokenizer serialized as ``tokenizer_json`` (HF
    ``Tokenizer.to_str()``), or None when some part of it has no exact equivalent there."""
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or spec.get("normalizer") is not None
        or model.get("dropout")
        or model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return None
    pattern = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    specials = {str(t["content"]): int(t["id"]) for t in added}
    merge_ids = _merge_ids(model)
    # tiktoken merges the adjacent pair whose product has the lowest id; HF the pair listed
    # first among the merges: the same order only when ids grow with the merge list
    if merge_ids is None or any(a >= b for a, b in pairwise(merge_ids)):
        return None
    to_byte = _bytes_to_unicode()
    ranks: dict[bytes, int] = {}
    for text, token_id in model["vocab"].items():
        if text in specials:
            continue
        if any(c not in to_byte for c in text):
            return None
        ranks[bytes(to_byte[c] for c in text)] = int(token_id)
    if (
        len(set(ranks.values())) != len(ranks)
        or set(ranks.values()) & set(specials.values())
        or any(bytes([b]) not in ranks for b in range(256))  # every byte must encode
    ):
        return None
    try:
        return tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
    except ValueError:  # a pattern fancy-regex cannot compile, ids it refuses
        return None
