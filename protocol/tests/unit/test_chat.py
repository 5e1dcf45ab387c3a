"""Chat rendering equals HF transformers' apply_chat_template (what vLLM renders chats with).

A small BPE tokenizer is trained here (no hub access) and wrapped twice: by kvpool.protocol.chat
and by transformers' PreTrainedTokenizerFast with the same tokenizer_config facts. Text and ids
must agree for several real template shapes (ChatML, whitespace control, a system-prompt
default with raise_exception, namespace, loop controls and tojson) and random messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvpool.protocol.chat import (
    ChatError,
    ChatMessage,
    TextTokenizer,
    content_text,
    load_tokenizer,
)

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Whitespace control matters here: HF compiles with trim_blocks and lstrip_blocks.
INDENTED = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] | trim }}<</SYS>>
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""
FANCY = """{%- set ns = namespace(system=false) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = true -%}{%- endif -%}
{%- endfor -%}
{%- if not ns.system -%}<|im_start|>system
You are helpful.<|im_end|>
{% endif -%}
{%- for m in messages -%}
  {%- if m.role not in ['system', 'user', 'assistant'] -%}
    {{- raise_exception('unknown role ' + m.role) -}}
  {%- endif -%}
  {%- if loop.index0 > 50 -%}{%- break -%}{%- endif -%}
<|im_start|>{{ m.role }}
{% generation %}{{ m.content }}{% endgeneration %}<|im_end|>
{{ {'n': loop.index, 'text': 'é<b>'} | tojson }}
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
TEMPLATES = {"chatml": CHATML, "indented": INDENTED, "fancy": FANCY}


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["the quick brown fox jumps over the lazy dog"] * 20 + ["héllo wörld 日本 ✓"] * 5
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    return tok


def _config(template: str) -> dict[str, Any]:
    return {
        "bos_token": "<|bos|>",
        "eos_token": {"content": "<|eos|>", "special": True},  # HF's AddedToken form
        "pad_token": "<|pad|>",
        "chat_template": template,
    }


def _pair(raw: Tokenizer, template: str) -> tuple[TextTokenizer, Any]:
    from transformers import PreTrainedTokenizerFast

    ours = TextTokenizer(raw, _config(template))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=template,
    )
    return ours, hf


CONVERSATION = [
    ChatMessage("system", "  Be brief.  "),
    ChatMessage("user", "the quick brown fox?\nsecond line"),
    ChatMessage("assistant", "jumps over the lazy dog"),
    ChatMessage("user", "<|im_end|> is literal here ✓"),
]


def _hf(hf: Any, messages: list[ChatMessage], gen: bool, tokenize: bool) -> Any:
    return hf.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=gen,
        tokenize=tokenize,
        return_dict=False,
    )


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("gen", [True, False])
def test_rendering_equals_transformers(raw_tokenizer: Tokenizer, name: str, gen: bool) -> None:
    ours, hf = _pair(raw_tokenizer, TEMPLATES[name])
    text = ours.apply_chat_template(CONVERSATION, add_generation_prompt=gen)
    assert text == _hf(hf, CONVERSATION, gen, tokenize=False)
    assert ours.chat_token_ids(CONVERSATION, add_generation_prompt=gen) == list(
        _hf(hf, CONVERSATION, gen, tokenize=True)
    )


pieces_st = st.sampled_from([*"the quick fox\n\t {}%#<|>é日✓", *SPECIALS])
messages_st = st.lists(
    st.builds(
        ChatMessage,
        st.sampled_from(["system", "user", "assistant"]),
        st.lists(pieces_st, max_size=30).map("".join),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(messages=messages_st, gen=st.booleans())
def test_random_conversations_equal_transformers(
    raw_tokenizer: Tokenizer, messages: list[ChatMessage], gen: bool
) -> None:
    for template in (CHATML, INDENTED):
        ours, hf = _pair(raw_tokenizer, template)
        assert ours.chat_token_ids(messages, add_generation_prompt=gen) == list(
            _hf(hf, messages, gen, tokenize=True)
        )


def test_a_template_that_raises_names_messages(raw_tokenizer: Tokenizer) -> None:
    ours, _ = _pair(raw_tokenizer, FANCY)
    with pytest.raises(ChatError, match="unknown role tool") as info:
        ours.chat_token_ids([ChatMessage("tool", "x")])
    assert info.value.param == "messages"


def test_no_template_is_a_chat_error(raw_tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatError, match="no chat_template"):
        TextTokenizer(raw_tokenizer, {}).chat_token_ids([ChatMessage("user", "hi")])


def test_special_ids_and_text_encoding(raw_tokenizer: Tokenizer) -> None:
    ours, hf = _pair(raw_tokenizer, CHATML)
    assert ours.eos_token_id == raw_tokenizer.token_to_id("<|eos|>")
    assert ours.chat_stop_token_ids() == (raw_tokenizer.token_to_id("<|im_end|>"),)
    assert ours.special_token_ids() == {raw_tokenizer.token_to_id(t) for t in SPECIALS}
    text = "the lazy dog<|im_end|> ✓"
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode("the quick fox")) == "the quick fox"


def test_content_parts() -> None:
    assert content_text(None) == ""
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(ChatError, match="only text content parts"):
        content_text([{"type": "image_url", "image_url": {"url": "x"}}])


def test_load_tokenizer_from_a_directory_and_its_errors(
    raw_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    raw_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(_config(CHATML)))
    loaded = load_tokenizer(tmp_path)
    assert loaded.chat_token_ids(CONVERSATION) == TextTokenizer(
        raw_tokenizer, _config(CHATML)
    ).chat_token_ids(CONVERSATION)
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="not a tokenizers JSON file"):
        load_tokenizer(tmp_path / "bad.json")


def test_an_encode_memo_returns_the_same_ids_and_stays_bounded() -> None:
    """A long text encoded again comes from the memo (a fresh list, equal ids); short texts and
    a tokenizer without a memo always encode."""
    from kvpool.protocol.chat import MEMO_MIN_CHARS, REFERENCE_TOKENIZER_DIR

    plain = load_tokenizer(REFERENCE_TOKENIZER_DIR)
    memo = load_tokenizer(REFERENCE_TOKENIZER_DIR, memo=2)
    texts = [f" word{i}" * (MEMO_MIN_CHARS // 4) for i in range(3)]
    for text in texts + texts:
        got = memo.encode(text)
        assert got == plain.encode(text)
        got.append(-1)  # the caller's list: the memo is not changed through it
    assert memo.encode(texts[2]) == plain.encode(texts[2])
    assert len(memo._memo) == 2 and not plain._memo
    assert memo.encode("short") == plain.encode("short") and "short" not in memo._memo
