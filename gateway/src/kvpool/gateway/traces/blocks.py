"""Prompts for hash-id traces: equal hash ids give equal text and equal token ids.

Why this module exists: a Mooncake-format trace gives each request's prompt only as block hash
ids (512 tokens a block) and a length. To replay it against a real engine, each block must
become text whose tokens are the same wherever the block appears, so that a prefix shared in
the trace is a prefix shared in KV (and so in LMCache's chunk hashes). Text is not naturally
compositional — a BPE tokenizer may merge across the boundary of two strings — so the builder
makes it so: it makes each block's 512 tokens of words that are one token each with a leading
space (`` the``, `` market``: taken from the tokenizer's own vocabulary), in phrases of eight
drawn deterministically from the hash id and a seed (a phrase, not a word, per draw: eight
times fewer draws, which is most of the cost), and checks at start that encoding a
concatenation of such words gives exactly the concatenation of their ids. A tokenizer where
that fails is refused with the reason. The last block is cut to ``input_length`` (a cut at a
word is a cut at a token).

Pure: no I/O (the tokenizer is passed in), no clock, no global random state. The fleet
simulator uses :meth:`BlockPromptBuilder.token_ids` without sending anything.
"""

from __future__ import annotations

import hashlib
import operator
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kvpool.gateway.traces.mooncake import MOONCAKE_BLOCK_TOKENS

#: fewer candidate words than this and blocks would repeat themselves too visibly
MIN_WORDS = 64
_MAX_WORD_CHARS = 16
T = TypeVar("T")
#: a block is made of phrases of this many words, drawn from this many (fixed by the seed)
PHRASE_WORDS = 8
PHRASES = 4096
_DRAWS = 1 << 16  # phrases are drawn as 16-bit values


class TokenizerLike(Protocol):
    """What the builder needs of a tokenizer (:class:`kvpool.protocol.chat.TextTokenizer`)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TokenizerError(ValueError):
    """A tokenizer whose tokenization of block text is not the blocks' token ids; says why."""


class PromptError(ValueError):
    """A request whose hash ids do not cover its ``input_length`` at this block size."""


def check_blocks(hash_ids: Sequence[int], input_length: int, block_size: int) -> None:
    """PromptError unless ``hash_ids`` are exactly the blocks ``input_length`` tokens fill
    (the replay's prompts and the fleet simulator's chunk keys both need it)."""
    if input_length < 1:
        raise PromptError(f"input_length must be >= 1, got {input_length}")
    need = -(-input_length // block_size)
    if len(hash_ids) != need:
        raise PromptError(
            f"input_length {input_length} needs {need} block(s) of {block_size} tokens, "
            f"hash_ids has {len(hash_ids)} (a trace of another block size?)"
        )


@dataclass(frozen=True)
class Vocabulary:
    """Words that are exactly one token each: ``texts[i]`` (with its leading space) is
    ``ids[i]``, and any concatenation of texts encodes to the concatenation of ids."""

    texts: tuple[str, ...]
    ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: TokenizerLike, *, min_words: int = MIN_WORDS) -> Vocabulary:
        """The tokenizer's lowercase ASCII words that encode, with a leading space, to their own
        single id; checked for compositionality. Raises TokenizerError naming why."""
        texts: list[str] = []
        ids: list[int] = []
        seen: set[str] = set()
        for token_id in range(tokenizer.vocab_size):
            word = tokenizer.decode([token_id]).strip()
            if not (2 <= len(word) <= _MAX_WORD_CHARS and word.isascii() and word.isalpha()):
                continue
            if not word.islower() or word in seen:
                continue
            text = " " + word
            if tokenizer.encode(text) == [token_id]:
                seen.add(word)
                texts.append(text)
                ids.append(token_id)
        if len(texts) < min_words:
            raise TokenizerError(
                f"only {len(texts)} tokens of this tokenizer are a lowercase ASCII word that "
                f"encodes, with a leading space, to that one token (need {min_words}): block "
                "text could not be made of single-token words"
            )
        vocab = cls(tuple(texts), tuple(ids))
        vocab.check_compositional(tokenizer)
        return vocab

    def check_compositional(self, tokenizer: TokenizerLike, *, rounds: int = 3) -> None:
        """Encode every word in several orders (each at the start of a text once) and compare
        with the concatenated ids; TokenizerError names the first place they differ."""
        rng = random.Random(0)
        order = list(range(len(self.texts)))
        for k in range(rounds):
            if k:
                rng.shuffle(order)
            for start in range(0, len(order), 512):
                part = order[start : start + 512]
                text = "".join(self.texts[i] for i in part)
                want = [self.ids[i] for i in part]
                got = tokenizer.encode(text)
                if got != want:
                    raise TokenizerError(_first_difference(got, want, text))


def _first_difference(got: list[int], want: list[int], text: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
              min(len(got), len(want)))  # fmt: skip
    return (
        f"this tokenizer is not compositional on single-token words: a text of {len(want)} "
        f"such words encodes to {len(got)} tokens, first differing at token {at} "
        f"(expected {want[at : at + 3]}, got {got[at : at + 3]}; text {text[:60]!r}...): it "
        "merges across words or adds a prefix, so equal hash ids would not give equal token ids"
    )


class _Entry:
    """A cached block: its phrase draws (16-bit values, as bytes), ids and text once asked."""

    __slots__ = ("draws", "ids", "text")

    def __init__(self, draws: bytes) -> None:
        self.draws = draws
        self.ids: tuple[int, ...] | None = None
        self.text: str | None = None


def _shake(key: str, n: int) -> list[int]:
    """``n`` 16-bit values of SHAKE-128 of ``key`` (stable across Python versions)."""
    return memoryview(hashlib.shake_128(key.encode()).digest(2 * n)).cast("H").tolist()


@dataclass
class BlockPromptBuilder:
    """Prompt text and token ids of hash-id requests (see the module docstring).

    The seed fixes :data:`PHRASES` phrases of :data:`PHRASE_WORDS` words each; a block is
    ``ceil(block_size / PHRASE_WORDS)`` phrases drawn by SHAKE-128 of (seed, block size, hash
    id), cut to ``block_size`` tokens. Blocks are kept in a bounded LRU of ``cache_blocks``
    (about 8 KB each at 512 tokens, ids and text).
    """

    vocabulary: Vocabulary
    block_size: int = MOONCAKE_BLOCK_TOKENS
    seed: int = 0
    cache_blocks: int = 8192
    hits: int = 0
    misses: int = 0
    _cache: OrderedDict[int, _Entry] = field(default_factory=OrderedDict, repr=False)
    _phrase_ids: list[tuple[int, ...]] = field(default_factory=list, repr=False)
    _phrase_text: list[str] = field(default_factory=list, repr=False)
    _word_text: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")
        if self.cache_blocks < 1:
            raise ValueError(f"cache_blocks must be >= 1, got {self.cache_blocks}")
        words = self.vocabulary
        n = len(words.ids)
        if n < 2:
            raise ValueError(f"the vocabulary needs at least 2 words, has {n}")
        picks = [v % n for v in _shake(f"kvpool-phrases:{self.seed}", PHRASES * PHRASE_WORDS)]
        phrases = [picks[i : i + PHRASE_WORDS] for i in range(0, len(picks), PHRASE_WORDS)]
        ids = [tuple(words.ids[w] for w in p) for p in phrases]
        texts = ["".join(words.texts[w] for w in p) for p in phrases]
        # indexed by a 16-bit draw directly: one gather per block, no modulo per draw
        self._phrase_ids = [ids[v % PHRASES] for v in range(_DRAWS)]
        self._phrase_text = [texts[v % PHRASES] for v in range(_DRAWS)]
        self._word_text = dict(zip(words.ids, words.texts, strict=True))

    def _entry(self, hash_id: int) -> _Entry:
        got = self._cache.get(hash_id)
        if got is not None:
            self.hits += 1
            self._cache.move_to_end(hash_id)
            return got
        self.misses += 1
        phrases = -(-self.block_size // PHRASE_WORDS)
        key = f"kvpool-block:{self.seed}:{self.block_size}:{hash_id}".encode()
        got = _Entry(hashlib.shake_128(key).digest(2 * phrases))
        self._cache[hash_id] = got
        if len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
        return got

    def _prefix_text(self, draws: bytes, tokens: int) -> str:
        """The text of the first ``tokens`` tokens of the phrases ``draws`` names."""
        full, rest = divmod(tokens, PHRASE_WORDS)
        values = memoryview(draws).cast("H").tolist()
        text = "".join(_gather(self._phrase_text, values[:full]))
        if rest:
            text += "".join(self._word_text[i] for i in self._phrase_ids[values[full]][:rest])
        return text

    def block_ids(self, hash_id: int) -> tuple[int, ...]:
        """The ``block_size`` token ids of ``hash_id``."""
        entry = self._entry(hash_id)
        if entry.ids is None:
            values = memoryview(entry.draws).cast("H").tolist()
            ids: list[int] = []
            for phrase in _gather(self._phrase_ids, values):
                ids += phrase  # the fastest concatenation in pure Python
            entry.ids = tuple(ids[: self.block_size])
        return entry.ids

    def block_text(self, hash_id: int) -> str:
        """The text of ``hash_id``'s block: it encodes to exactly :meth:`block_ids`."""
        entry = self._entry(hash_id)
        if entry.text is None:
            entry.text = self._prefix_text(entry.draws, self.block_size)
        return entry.text

    def check(self, hash_ids: Sequence[int], input_length: int) -> None:
        """PromptError unless ``hash_ids`` are exactly the blocks ``input_length`` tokens fill."""
        check_blocks(hash_ids, input_length, self.block_size)

    def token_ids(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        """The prompt's token ids: the blocks in order, the last cut to ``input_length``."""
        self.check(hash_ids, input_length)
        out: list[int] = []
        for h in hash_ids:
            out.extend(self.block_ids(h))
        del out[input_length:]
        return out

    def text(self, hash_ids: Sequence[int], input_length: int) -> str:
        """The prompt's text, which the tokenizer encodes to exactly :meth:`token_ids`."""
        self.check(hash_ids, input_length)
        parts = [self.block_text(h) for h in hash_ids[:-1]]
        keep = input_length - self.block_size * (len(hash_ids) - 1)
        if keep == self.block_size:
            parts.append(self.block_text(hash_ids[-1]))
        else:
            parts.append(self._prefix_text(self._entry(hash_ids[-1]).draws, keep))
        return "".join(parts)


def _gather(table: Sequence[T], values: list[int]) -> tuple[T, ...]:
    """``table[v]`` for each value (itemgetter: the fastest gather in pure Python)."""
    if not values:
        return ()
    got = operator.itemgetter(*values)(table)
    return got if len(values) > 1 else (got,)
