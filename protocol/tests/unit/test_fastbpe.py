"""tiktoken's mirror of a byte-level BPE gives exactly ``tokenizers``' ids, or is not used.

The gateway and the engine must agree on every token id (every chunk hash follows from them),
so the fast encoder is checked against HF ``tokenizers`` itself: on the reference tokenizer the
worker serves with, on a Qwen2-style tokenizer (a ``Split`` regex, then a regex-free
``ByteLevel``) trained here, on generated text with special tokens, whitespace runs and any
Unicode; and every tokenizer shape it cannot mirror keeps ``tokenizers``.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, TextTokenizer, load_tokenizer
from kvpool.protocol.fastbpe import PROBE, tiktoken_encoding

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "a", "river", "42", "3.14", "don't", "I'll", "we're", "x_y", "__init__",
         "{json}", "[1,2]", "naïve", "café", "中文", "日本", "🙂", "STOP", "-", "--", "...", "!?",
         "\t", "\n", "\n\n", "", ""]  # fmt: skip


def _corpus(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) + rng.choice(["", " ", "  ", "\n"]) for _ in range(40))
            for _ in range(n)]  # fmt: skip


REFERENCE = load_tokenizer(REFERENCE_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def reference() -> TextTokenizer:
    return REFERENCE


@pytest.fixture(scope="module")
def qwen_style() -> TextTokenizer:
    """A small BPE with Qwen2's pre-tokenizer, trained on generated text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(1, 400), trainer=trainer)
    return TextTokenizer(tok, {})


def _slow(t: TextTokenizer, text: str) -> list[int]:
    return list(t._tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("which", ["reference", "qwen_style"])
def test_the_fast_encoder_is_used_and_agrees_on_generated_text(
    which: str, request: pytest.FixtureRequest
) -> None:
    t: TextTokenizer = request.getfixturevalue(which)
    assert t.encoder_name == "tiktoken"
    for text in [PROBE, *_corpus(7, 200)]:
        with_specials = f"{SPECIALS[1]}user\n{text}{SPECIALS[2]}\n<|im_end|>{text}"
        for sample in (text, with_specials):
            assert t.encode(sample) == _slow(t, sample)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.sampled_from(["", "<|im_start|>", "<|im_end|>", "<|eos|>"]))
def test_any_unicode_text_gives_the_same_ids(text: str, special: str) -> None:
    t = REFERENCE
    sample = text[: len(text) // 2] + special + text[len(text) // 2 :]
    assert t.encode(sample) == _slow(t, sample)


def test_chat_token_ids_are_unchanged_by_the_fast_path(reference: TextTokenizer) -> None:
    from kvpool.protocol.chat import ChatMessage

    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", " ".join(_corpus(3, 50)))]
    text = reference.apply_chat_template(msgs)
    assert reference.chat_token_ids(msgs) == _slow(reference, text)


def _spec(t: TextTokenizer) -> dict[str, object]:
    spec: dict[str, object] = json.loads(t._tok.to_str())
    return spec


def _refused(spec: dict[str, object]) -> bool:
    return tiktoken_encoding(json.dumps(spec)) is None


def test_shapes_it_cannot_mirror_keep_tokenizers(reference: TextTokenizer) -> None:
    base = _spec(reference)
    assert not _refused(base)
    model = dict(base["model"])  # type: ignore[call-overload]
    assert _refused({**base, "normalizer": {"type": "NFC"}})
    assert _refused({**base, "model": {**model, "byte_fallback": True}})
    assert _refused({**base, "model": {**model, "dropout": 0.1}})
    assert _refused({**base, "pre_tokenizer": {"type": "Whitespace"}})
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}
    assert _refused({**base, "pre_tokenizer": byte_level})
    added = [dict(a, lstrip=True) for a in base["added_tokens"]]  # type: ignore[attr-defined]
    assert _refused({**base, "added_tokens": added})
    merges = list(model["merges"])
    swapped = [merges[1], merges[0], *merges[2:]]  # ids no longer follow the merge order
    assert _refused({**base, "model": {**model, "merges": swapped}})


def test_a_tokenizer_with_a_normalizer_encodes_with_tokenizers() -> None:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(2, 50), trainer=trainer)
    t = TextTokenizer(tok, {})
    assert t.encoder_name == "tokenizers"
    assert t.encode("ﬁne café") == _slow(t, "ﬁne café")
