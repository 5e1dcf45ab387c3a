"""The shared decoder math (full prefill path) against transformers, and the attention masks.

The blend path is only as right as the per-layer forward it shares with full prefill, so the
full prefill here is compared with the transformers model's forward (hidden states, logits
and the post-RoPE KV cache) for Llama, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, the
worker's reference-engine family).
"""

import pytest
import torch

from kvpool.kernels.blend import DecoderWeights, MaskKind, full_prefill, logits
from kvpool.kernels.blend.model import attend, causal_mask
from kvpool.kernels.blend.synthetic import TinyModelSpec, build_hf_model, single_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    with single_thread():
        yield


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_full_prefill_matches_transformers_forward(family: str) -> None:
    model = build_hf_model(TinyModelSpec(family=family, layers=3, seed=11))  # type: ignore[arg-type]
    w = DecoderWeights.from_hf(model)
    assert (w.layers[0].q_norm is not None) == (family == "qwen3")
    assert (w.layers[0].q_b is not None) == (family == "qwen2")
    tokens = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(tokens[None], output_hidden_states=True, use_cache=True)
        ours = full_prefill(w, tokens)
    torch.testing.assert_close(ours.hidden, out.hidden_states[-1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits(w, ours.hidden), out.logits[0], rtol=1e-4, atol=1e-4)
    cache = out.past_key_values
    for layer in range(w.n_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)
        hf_v = cache.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(ours.kv.k[layer], hf_k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.kv.v[layer], hf_v, rtol=1e-4, atol=1e-4)


def test_from_hf_rejects_what_blending_cannot_rerotate() -> None:
    model = build_hf_model(TinyModelSpec(layers=1))
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type"):
        DecoderWeights.from_hf(model)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    model.config.use_sliding_window = True
    with pytest.raises(ValueError, match="sliding"):
        DecoderWeights.from_hf(model)
    model.config.use_sliding_window = False
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        DecoderWeights.from_hf(model)


def _loop_attention(q, k, v, q_pos, k_pos):  # type: ignore[no-untyped-def]
    """Per-query softmax written out, with GQA by head repetition."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    rows = []
    for i in range(q.shape[0]):
        vis = k_pos <= q_pos[i]
        s = torch.einsum("hd,khd->hk", q[i], k[vis]) / q.shape[-1] ** 0.5
        rows.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[vis]).flatten())
    return torch.stack(rows)


def test_attend_exact_mask_matches_a_per_query_loop() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(40, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(40, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(40, 2, 16, generator=g, dtype=torch.float64)
    pos = torch.arange(40) + 7
    full = attend(q, k, v, pos, pos)  # fused is_causal path
    torch.testing.assert_close(full, _loop_attention(q, k, v, pos, pos), rtol=0, atol=1e-12)
    sel = torch.tensor([0, 3, 4, 20, 21, 39])
    part = attend(q[sel], k, v, pos[sel], pos)  # explicit exact mask
    torch.testing.assert_close(part, full[sel], rtol=0, atol=1e-12)
    wrong = attend(q[sel], k, v, pos[sel], pos, MaskKind.BOTTOM_RIGHT)
    assert (wrong[:-1] - full[sel][:-1]).abs().max() > 1e-3  # earlier rows see the future
    torch.testing.assert_close(wrong[-1], full[-1], rtol=0, atol=1e-12)  # the last row is right


def test_bottom_right_mask_is_exact_only_for_a_contiguous_tail() -> None:
    pos = torch.arange(10)
    tail = torch.arange(6, 10)
    assert torch.equal(
        causal_mask(tail, pos, MaskKind.BOTTOM_RIGHT), causal_mask(tail, pos, MaskKind.EXACT)
    )
    sel = torch.tensor([1, 5, 9])
    exact = causal_mask(sel, pos, MaskKind.EXACT)
    assert exact.sum(1).tolist() == [2, 6, 10]
    assert causal_mask(sel, pos, MaskKind.BOTTOM_RIGHT).sum(1).tolist() == [8, 9, 10]


def test_attend_blocked_exact_mask_equals_full_causal_rows() -> None:
    """Over 256 selected queries, attention runs in blocks that cut the invisible keys."""
    g = torch.Generator().manual_seed(1)
    n = 700
    q = torch.randn(n, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(n, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(n, 2, 16, generator=g, dtype=torch.float64)
    pos = torch.arange(n) + 3
    sel = torch.sort(torch.randperm(n, generator=g)[:300]).values
    full = attend(q, k, v, pos, pos)
    torch.testing.assert_close(attend(q[sel], k, v, pos[sel], pos), full[sel], rtol=0, atol=1e-12)
