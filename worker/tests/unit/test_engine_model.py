"""The reference engine's own forward over paged KV equals the transformers model's forward.

Real model math on both sides: a Qwen3-style model with seeded random weights; our varlen
attention reads and writes K/V through slot mappings in the vLLM flash NHD layout.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvpool.worker.engine.model import (
    PagedModel,
    SeqChunk,
    load_hf_model,
    model_shape,
    slot_mapping,
)
from kvpool.worker.engine_api import EngineError, ReferenceEngineOptions

TINY = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256}
BLOCK = 16


@pytest.fixture(scope="module")
def model() -> PagedModel:
    hf, config = load_hf_model(ReferenceEngineOptions(weights_seed=7), **TINY)
    return PagedModel(hf, config)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def shuffled_table(n_blocks: int, total: int, seed: int = 0) -> list[int]:
    """A non-contiguous block table, so a wrong slot mapping cannot pass by accident."""
    return random.Random(seed).sample(range(total), n_blocks)


def hf_logits(model: PagedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = model.hf_model(torch.tensor([ids]))
    logits: torch.Tensor = out.logits[0].float()
    return logits


def test_prefill_logits_equal_transformers_forward(model: PagedModel) -> None:
    ids = prompt(150)
    caches = model.allocate_kv_caches(64, BLOCK)
    table = shuffled_table(10, 64)
    ours = model.forward([SeqChunk(ids, 0, table)], caches)
    ref = hf_logits(model, ids)[-1]
    assert ours.shape == (1, 8192)
    torch.testing.assert_close(ours[0], ref, atol=1e-4, rtol=1e-4)


def test_kv_lands_at_slot_mapping_in_nhd_layout(model: PagedModel) -> None:
    ids = prompt(40, seed=1)
    caches = model.allocate_kv_caches(32, BLOCK)
    table = shuffled_table(3, 32, seed=1)
    model.forward([SeqChunk(ids, 0, table)], caches)
    with torch.inference_mode():
        out = model.hf_model(torch.tensor([ids]), use_cache=True)
    slots = slot_mapping(table, BLOCK, 0, len(ids))
    s = model.shape
    for layer, kv in enumerate(caches):
        assert kv.shape == (2, 32, BLOCK, s.num_kv_heads, s.head_dim)
        hf_k = out.past_key_values.layers[layer].keys[0].transpose(0, 1)  # [T, kv_heads, D]
        hf_v = out.past_key_values.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(kv[0].view(-1, s.num_kv_heads, s.head_dim)[slots], hf_k)
        torch.testing.assert_close(kv[1].view(-1, s.num_kv_heads, s.head_dim)[slots], hf_v)
    untouched = torch.ones(32 * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert caches[0][0].view(-1, s.num_kv_heads, s.head_dim)[untouched].abs().sum() == 0


def test_chunked_prefill_and_decode_equal_full_recompute(model: PagedModel) -> None:
    ids = prompt(100, seed=2)
    caches = model.allocate_kv_caches(64, BLOCK)
    table = shuffled_table(8, 64, seed=2)
    model.forward([SeqChunk(ids[:37], 0, table, want_logits=False)], caches)  # ends mid-block
    logits = model.forward([SeqChunk(ids[37:90], 37, table)], caches)
    torch.testing.assert_close(logits[0], hf_logits(model, ids[:90])[-1], atol=1e-4, rtol=1e-4)
    for pos in range(90, 95):  # decode one token at a time against the paged cache
        step = model.forward([SeqChunk([ids[pos]], pos, table)], caches)
        ref = hf_logits(model, ids[: pos + 1])[-1]
        torch.testing.assert_close(step[0], ref, atol=1e-4, rtol=1e-4)


def test_batched_sequences_do_not_see_each_other(model: PagedModel) -> None:
    a, b = prompt(30, seed=3), prompt(45, seed=4)
    caches = model.allocate_kv_caches(32, BLOCK)
    table_a, table_b = [5, 9], [1, 30, 7]
    model.forward([SeqChunk(a[:20], 0, table_a, want_logits=False)], caches)
    logits = model.forward(
        [SeqChunk(a[20:], 20, table_a), SeqChunk(b, 0, table_b, want_logits=True)], caches
    )
    torch.testing.assert_close(logits[0], hf_logits(model, a)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(model, b)[-1], atol=1e-4, rtol=1e-4)


def test_weights_follow_the_seed_only() -> None:
    opts = ReferenceEngineOptions(weights_seed=3)
    one, _ = load_hf_model(opts, **TINY)
    two, _ = load_hf_model(opts, **TINY)
    other, _ = load_hf_model(ReferenceEngineOptions(weights_seed=4), **TINY)
    w1 = one.model.layers[0].self_attn.k_proj.weight
    assert torch.equal(w1, two.model.layers[0].self_attn.k_proj.weight)
    assert not torch.equal(w1, other.model.layers[0].self_attn.k_proj.weight)


def test_unknown_dtype_and_missing_model_dir_are_clear_errors(tmp_path: object) -> None:
    with pytest.raises(EngineError, match="dtype 'float8'"):
        load_hf_model(ReferenceEngineOptions(dtype="float8"), **TINY)
    with pytest.raises(EngineError, match="not a local HF model directory"):
        load_hf_model(ReferenceEngineOptions(model_dir=str(tmp_path)))


def test_local_model_dir_loads_without_a_hub(model: PagedModel, tmp_path: object) -> None:
    model.hf_model.save_pretrained(str(tmp_path))
    hf, config = load_hf_model(ReferenceEngineOptions(model_dir=str(tmp_path)))
    loaded = PagedModel(hf, config)
    ids = prompt(20, seed=5)
    a = model.forward([SeqChunk(ids, 0, [0, 1])], model.allocate_kv_caches(4, BLOCK))
    b = loaded.forward([SeqChunk(ids, 0, [0, 1])], loaded.allocate_kv_caches(4, BLOCK))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_other_families_from_a_local_dir_match_transformers(family: str, tmp_path: Any) -> None:
    """Llama (no q/k norm) and Qwen2 (q/k/v bias) checkpoints saved locally, then served."""
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if family == "llama" else Qwen2Config
    config = cls(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    hf, loaded_config = load_hf_model(ReferenceEngineOptions(model_dir=str(tmp_path)))
    model = PagedModel(hf, loaded_config)
    ids = [random.Random(1).randrange(512) for _ in range(50)]
    caches = model.allocate_kv_caches(8, BLOCK)
    model.forward([SeqChunk(ids[:30], 0, [3, 1, 6, 0], want_logits=False)], caches)
    ours = model.forward([SeqChunk(ids[30:], 30, [3, 1, 6, 0])], caches)
    torch.testing.assert_close(ours[0], hf_logits(model, ids)[-1], atol=1e-4, rtol=1e-4)


def test_unsupported_families_are_refused_by_name(tmp_path: Any) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(str(tmp_path))
    with pytest.raises(EngineError, match="model_type 'gpt2'"):
        load_hf_model(ReferenceEngineOptions(model_dir=str(tmp_path)))


def test_model_shape_without_weights_matches_the_built_model(
    model: PagedModel, tmp_path: Any
) -> None:
    assert model_shape(ReferenceEngineOptions(weights_seed=7), **TINY) == model.shape
    model.hf_model.save_pretrained(str(tmp_path))
    assert model_shape(ReferenceEngineOptions(model_dir=str(tmp_path))) == model.shape
    default = model_shape(ReferenceEngineOptions())
    assert (default.num_layers, default.num_kv_heads, default.head_dim) == (4, 2, 64)
    assert default.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4
