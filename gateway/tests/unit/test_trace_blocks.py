"""The block prompt builder (kvpool.gateway.traces.blocks): hash ids to text and token ids.

Equal hash ids give equal token ids and equal text; the tokenizer encodes the text to exactly
the concatenated ids (the reference tokenizer, and a word-level tokenizer.json built here: any
tokenizer.json whose single-token words compose); the last block is cut to input_length; a
tokenizer that merges across words, or has too few single-token words, is refused saying why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvpool.gateway.traces import BlockPromptBuilder, PromptError, TokenizerError, Vocabulary
from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, TextTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return load_tokenizer(REFERENCE_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def vocab(tok: TextTokenizer) -> Vocabulary:
    return Vocabulary.from_tokenizer(tok)


def test_vocabulary_words_are_single_tokens(tok: TextTokenizer, vocab: Vocabulary) -> None:
    assert len(vocab.ids) >= 1000
    for text, token_id in list(zip(vocab.texts, vocab.ids, strict=True))[::97]:
        assert text.startswith(" ") and text[1:].isalpha()
        assert tok.encode(text) == [token_id]


def test_equal_hash_ids_equal_ids_and_text(vocab: Vocabulary) -> None:
    a = BlockPromptBuilder(vocab)
    b = BlockPromptBuilder(vocab, cache_blocks=1)  # another instance, nothing shared but seed
    assert a.token_ids([7, 8, 9], 1300) == b.token_ids([7, 8, 9], 1300)
    assert a.text([7, 8, 9], 1300) == b.text([7, 8, 9], 1300)
    # a shared prefix of hash ids is a shared prefix of tokens, and of text
    x, y = a.token_ids([7, 8, 9], 1536), a.token_ids([7, 8, 10], 1536)
    assert x[:1024] == y[:1024] and x[1024:] != y[1024:]
    assert a.text([7, 8, 10], 1536).startswith(a.block_text(7) + a.block_text(8))
    # the same id means the same block wherever it appears
    assert a.token_ids([3, 7], 1024)[512:] == list(a.block_ids(7))
    assert a.block_ids(1) != a.block_ids(2)
    assert BlockPromptBuilder(vocab, seed=1).block_ids(7) != a.block_ids(7)


@pytest.mark.parametrize("block", [512, 64, 13, 8, 1])
def test_text_encodes_to_exactly_the_ids_last_block_cut(
    tok: TextTokenizer, vocab: Vocabulary, block: int
) -> None:
    builder = BlockPromptBuilder(vocab, block_size=block)
    for length in sorted(
        n for n in {1, block - 1, block, block + 1, 3 * block - 5, 3 * block} if n > 0
    ):
        ids = [5, 6, 7][: -(-length // block)]
        got = builder.token_ids(ids, length)
        assert len(got) == length
        assert got == [t for h in ids for t in builder.block_ids(h)][:length]
        assert tok.encode(builder.text(ids, length)) == got


def test_blocks_not_covering_the_length_are_refused(vocab: Vocabulary) -> None:
    builder = BlockPromptBuilder(vocab)
    with pytest.raises(PromptError, match=r"input_length 1025 needs 3 block\(s\) of 512 tokens, "
                                          "hash_ids has 2"):  # fmt: skip
        builder.token_ids([1, 2], 1025)
    with pytest.raises(PromptError, match="hash_ids has 3"):
        builder.text([1, 2, 3], 1024)
    with pytest.raises(PromptError, match="input_length must be >= 1, got 0"):
        builder.token_ids([], 0)


def test_cache_is_bounded(vocab: Vocabulary) -> None:
    builder = BlockPromptBuilder(vocab, cache_blocks=4)
    first = builder.block_ids(0)
    for h in range(1, 20):
        builder.block_text(h)
    assert len(builder._cache) == 4
    assert builder.block_ids(0) == first  # rebuilt the same
    assert builder.misses == 21 and builder.hits == 0
    builder.block_ids(0)
    assert builder.hits == 1


def _save(tokenizer: Tokenizer, tmp_path: Path) -> TextTokenizer:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return load_tokenizer(path)


def test_any_compositional_tokenizer_json_works(tmp_path: Path) -> None:
    words = [a + b for a in "abcdefgh" for b in "ijklmnop"]  # 64 two-letter words
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tokenizer.add_special_tokens(["[UNK]"])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = _save(tokenizer, tmp_path)
    vocab = Vocabulary.from_tokenizer(tok)
    assert len(vocab.ids) == 64
    builder = BlockPromptBuilder(vocab, block_size=16)
    assert tok.encode(builder.text([1, 2, 3], 40)) == builder.token_ids([1, 2, 3], 40)


def test_tokenizer_merging_across_words_is_refused(tmp_path: Path) -> None:
    # BPE without a pre-tokenizer: " xy" is one token, but the merge "y " (ranked first) joins
    # a word's last letter to the next word's space, so " ab ab" is not [" ab", " ab"]
    letters = "abcdefgh"
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = [(y, " ") for y in letters]
    merges += [(" ", x) for x in letters]
    merges += [(" " + x, y) for x in letters for y in letters]
    for token in [" ", *letters, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    tok = _save(Tokenizer(models.BPE(vocab, merges)), tmp_path)
    assert tok.encode(" ab") == [vocab[" ab"]]
    with pytest.raises(TokenizerError, match="not compositional on single-token words"):
        Vocabulary.from_tokenizer(tok)


def test_tokenizer_with_too_few_single_token_words_is_refused(tmp_path: Path) -> None:
    tokenizer = Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(TokenizerError, match=r"only 1 tokens .* \(need 64\)"):
        Vocabulary.from_tokenizer(_save(tokenizer, tmp_path))
