"""CacheBlend prefill properties (reference §6.5) on a small random-weight Llama.

Real model math (transformers weights, our shared per-layer forward), no mocks. The exactness
properties run in float64 so "exact" means ~1e-10; the quality properties average over seeds
with fixed generators, so they are deterministic and have a wide margin (see the numbers in
kernels/README.md).
"""

import itertools

import pytest
import torch

from kvpool.kernels.blend import (
    BlendConfig,
    CachedSegment,
    CheckStep,
    DecoderWeights,
    KVCache,
    MaskKind,
    Selector,
    blend_forward,
    blend_prefill,
    full_prefill,
    load_segments,
    reposition_keys,
    rerope,
)
from kvpool.kernels.blend.select import deviation
from kvpool.kernels.blend.synthetic import (
    TinyModelSpec,
    build_hf_model,
    quality,
    rag_prompt,
    single_thread,
)

RAG = {"n_chunks": 4, "chunk_len": 32, "sys_len": 8, "question_len": 8}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    with single_thread():
        yield


@pytest.fixture(scope="module")
def w64() -> DecoderWeights:
    return DecoderWeights.from_hf(build_hf_model(TinyModelSpec(dtype=torch.float64)))


@pytest.fixture(scope="module")
def w32() -> DecoderWeights:
    return DecoderWeights.from_hf(build_hf_model(TinyModelSpec(seed=5)))


def _exact_cache_prompt(w: DecoderWeights):  # type: ignore[no-untyped-def]
    """Segments cut out of a full prefill of the same sequence, each chunk re-rotated so that it
    looks cached at positions 0.. (as if computed elsewhere); the 6-token question is uncached."""
    tokens = torch.randint(0, 512, (134,), generator=torch.Generator().manual_seed(3))
    full = full_prefill(w, tokens)
    segs = [
        CachedSegment(0, tokens[:8], KVCache(full.kv.k[:, :8], full.kv.v[:, :8], torch.arange(8)))
    ]
    for a in (8, 48, 88):
        b, old = a + 40, torch.arange(40)
        k = rerope(full.kv.k[:, a:b], full.kv.positions[a:b], old, w.rope)
        segs.append(CachedSegment(a, tokens[a:b], KVCache(k, full.kv.v[:, a:b], old)))
    return tokens, segs, full


def _is_contiguous_tail(selected: torch.Tensor, n: int) -> bool:
    return torch.equal(selected, torch.arange(n - selected.shape[0], n))


@pytest.mark.parametrize("check_layer", [1, 2])
def test_exact_cache_gives_exact_output_at_any_ratio(w64: DecoderWeights, check_layer: int) -> None:
    tokens, segs, full = _exact_cache_prompt(w64)
    n = tokens.shape[0]
    for ratio in (0.0, 0.1, 0.3):
        res = blend_prefill(w64, tokens, segs, BlendConfig.single(ratio, check_layer=check_layer))
        assert res.selected[-1] == n - 1
        torch.testing.assert_close(res.hidden, full.hidden[res.selected], rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    "cfg",
    [
        BlendConfig.single(0.15, selector=Selector.V_DEVIATION),
        BlendConfig(checks=(CheckStep(1, 0.4), CheckStep(2, 0.1))),
        BlendConfig.single(0.15, selector=Selector.RANDOM, seed=3),
    ],
    ids=["v-deviation", "gradual", "random"],
)
def test_exact_cache_is_exact_for_any_selector_and_schedule(
    w64: DecoderWeights, cfg: BlendConfig
) -> None:
    tokens, segs, full = _exact_cache_prompt(w64)
    res = blend_prefill(w64, tokens, segs, cfg)
    torch.testing.assert_close(res.hidden, full.hidden[res.selected], rtol=0, atol=1e-9)


@pytest.mark.parametrize("check_layer", [1, 2])
def test_bottom_right_mask_fails_the_exact_cache_property(
    w64: DecoderWeights, check_layer: int
) -> None:
    """LMCache #1152: with >= check layer + 2 layers the last token's output goes wrong."""
    tokens, segs, full = _exact_cache_prompt(w64)
    assert w64.n_layers >= check_layer + 2
    cfg = BlendConfig.single(0.15, check_layer=check_layer, mask=MaskKind.BOTTOM_RIGHT)
    res = blend_prefill(w64, tokens, segs, cfg)
    assert not _is_contiguous_tail(res.selected, tokens.shape[0])  # else the masks coincide
    assert (res.hidden[-1] - full.hidden[-1]).abs().max() > 1e-3


def test_bottom_right_mask_is_invisible_when_the_check_layer_is_last(w64: DecoderWeights) -> None:
    """Why the model needs >= c + 2 layers: at c = L-1 the wrong rows never reach the last one."""
    tokens, segs, full = _exact_cache_prompt(w64)
    cfg = BlendConfig.single(0.15, check_layer=w64.n_layers - 1, mask=MaskKind.BOTTOM_RIGHT)
    res = blend_prefill(w64, tokens, segs, cfg)
    torch.testing.assert_close(res.hidden[-1], full.hidden[-1], rtol=0, atol=1e-9)
    assert (res.hidden[:-1] - full.hidden[res.selected[:-1]]).abs().max() > 1e-3


@pytest.mark.parametrize("checks", [((0, 1.0),), ((1, 1.0),), ((3, 1.0),), ((1, 1.0), (2, 1.0))])
def test_ratio_one_equals_full_prefill(
    w64: DecoderWeights, checks: tuple[tuple[int, float], ...]
) -> None:
    p = rag_prompt(w64, seed=0, **RAG)
    full = full_prefill(w64, p.tokens)
    cfg = BlendConfig(checks=tuple(CheckStep(c, r) for c, r in checks))
    res = blend_prefill(w64, p.tokens, p.segments, cfg)
    assert torch.equal(res.selected, torch.arange(p.tokens.shape[0]))
    torch.testing.assert_close(res.hidden, full.hidden, rtol=0, atol=1e-10)
    # fresh-write-back semantics: the blended cache is the full-prefill cache in every layer
    torch.testing.assert_close(res.kv.k, full.kv.k, rtol=0, atol=1e-10)
    torch.testing.assert_close(res.kv.v, full.kv.v, rtol=0, atol=1e-10)


@pytest.mark.parametrize("selector", [Selector.K_DEVIATION, Selector.V_DEVIATION])
def test_selection_contract_and_state_propagation(w64: DecoderWeights, selector: Selector) -> None:
    p = rag_prompt(w64, seed=1, **RAG)
    n, c, ratio = p.tokens.shape[0], 1, 0.2
    loaded = load_segments(w64, p.tokens, p.segments)
    res = blend_forward(w64, p.tokens, loaded, BlendConfig.single(ratio, c, selector=selector))
    full = full_prefill(w64, p.tokens)

    # loading re-rotated K only: V is the cached bytes, K is the fused re-rotation of them
    for seg in p.segments:
        rows = slice(seg.start, seg.start + seg.kv.n_tokens)
        assert torch.equal(loaded.kv.v[:, rows], seg.kv.v)
        new = torch.arange(rows.start, rows.stop)
        assert torch.equal(loaded.kv.k[:, rows], rerope(seg.kv.k, seg.kv.positions, new, w64.rope))

    # forced: the uncached question and the last token; |S| = floor(r*N) + forced
    forced = torch.zeros(n, dtype=torch.bool)
    forced[p.question_start :] = True
    assert torch.equal(res.forced, forced)
    s = res.selected
    assert torch.equal(s, torch.unique(s)) and s.shape[0] == int(ratio * n) + int(forced.sum())
    assert bool(forced[s].sum() == forced.sum())

    # S is the top-k of the deviation at the check layer, computed independently: every layer
    # up to c is a full forward, so the fresh K/V at c are the full prefill's
    fresh, old = (
        (full.kv.k, loaded.kv.k) if selector is Selector.K_DEVIATION else (full.kv.v, loaded.kv.v)
    )
    score = deviation(fresh[c], old[c]).masked_fill(forced, -1.0)
    top = torch.argsort(score, descending=True, stable=True)[: int(ratio * n)]
    assert torch.equal(s, torch.sort(torch.cat((top, forced.nonzero()[:, 0]))).values)

    # layers <= c: fully fresh; later layers: K/V[~S] are the loaded bytes, K/V[S] recomputed
    torch.testing.assert_close(res.kv.k[: c + 1], full.kv.k[: c + 1], rtol=0, atol=1e-10)
    rest = torch.ones(n, dtype=torch.bool)
    rest[s] = False
    for layer in range(c + 1, w64.n_layers):
        assert torch.equal(res.kv.k[layer][rest], loaded.kv.k[layer][rest])
        assert torch.equal(res.kv.v[layer][rest], loaded.kv.v[layer][rest])
        assert not torch.allclose(res.kv.k[layer][s], loaded.kv.k[layer][s])
    assert res.hidden.shape == (s.shape[0], 256)


def test_gradual_filtering_selects_nested_subsets(w64: DecoderWeights) -> None:
    p = rag_prompt(w64, seed=2, **RAG)
    n = p.tokens.shape[0]
    res = blend_prefill(
        w64, p.tokens, p.segments, BlendConfig(checks=(CheckStep(1, 0.5), CheckStep(2, 0.2)))
    )
    first, second = res.selections
    assert set(second.tolist()) <= set(first.tolist())
    n_forced = int(res.forced.sum())
    assert (first.shape[0], second.shape[0]) == (int(0.5 * n) + n_forced, int(0.2 * n) + n_forced)
    assert torch.equal(res.selected, second)
    # an unchanged ratio at the next check layer keeps the same selection
    same = blend_prefill(
        w64, p.tokens, p.segments, BlendConfig(checks=(CheckStep(1, 0.3), CheckStep(2, 0.3)))
    )
    assert torch.equal(same.selections[0], same.selections[1])


def test_gap_rows_are_forced_and_recomputed(w64: DecoderWeights) -> None:
    p = rag_prompt(w64, seed=3, **RAG)
    dropped = p.segments[2]
    segs = [s for s in p.segments if s is not dropped]
    gap = torch.arange(dropped.start, dropped.start + dropped.kv.n_tokens)
    res = blend_prefill(w64, p.tokens, segs, BlendConfig.single(0.1))
    assert bool(res.forced[gap].all())
    assert set(gap.tolist()) <= set(res.selected.tolist())
    assert bool((res.kv.k[:, gap].abs().sum(dim=(-1, -2)) > 0).all())  # never the zero fill
    assert bool(torch.isfinite(res.hidden).all())


def test_error_does_not_increase_with_the_ratio(w32: DecoderWeights) -> None:
    ratios = (0.0, 0.1, 0.2, 0.4, 1.0)
    errors = {r: 0.0 for r in ratios}
    for seed in range(3):
        p = rag_prompt(w32, seed=seed, **RAG)
        ref = full_prefill(w32, p.tokens).hidden[p.question_start :]
        for r in ratios:
            res = blend_prefill(w32, p.tokens, p.segments, BlendConfig.single(r))
            q = quality(w32, ref, res.hidden[-RAG["question_len"] :])
            errors[r] += q["hidden_rel_error"] / 3
    values = [errors[r] for r in ratios]
    assert values[0] > 0.05  # the reused chunks really are stale (cross-chunk attention missing)
    assert all(b < a for a, b in itertools.pairwise(values)), errors
    assert values[-1] < 1e-5


def test_hkvd_beats_random_selection(w32: DecoderWeights) -> None:
    ratio, qlen = 0.2, RAG["question_len"]
    err = {"k": 0.0, "v": 0.0, "random": 0.0}
    for seed in range(3):
        p = rag_prompt(w32, seed=seed, **RAG)
        ref = full_prefill(w32, p.tokens).hidden[p.question_start :]
        for sel in (Selector.K_DEVIATION, Selector.V_DEVIATION):
            res = blend_prefill(w32, p.tokens, p.segments, BlendConfig.single(ratio, selector=sel))
            err[sel.value] += quality(w32, ref, res.hidden[-qlen:])["hidden_rel_error"]
        for rs in range(2):
            cfg = BlendConfig.single(ratio, selector=Selector.RANDOM, seed=rs)
            res = blend_prefill(w32, p.tokens, p.segments, cfg)
            err["random"] += quality(w32, ref, res.hidden[-qlen:])["hidden_rel_error"] / 2
    assert err["k"] < 0.95 * err["random"], err
    assert err["v"] < 0.95 * err["random"], err


def test_bad_segments_and_configs_are_rejected(w64: DecoderWeights) -> None:
    p = rag_prompt(w64, seed=0, **RAG)
    seg = p.segments[1]
    with pytest.raises(ValueError, match="overlaps"):
        load_segments(w64, p.tokens, [seg, seg])
    with pytest.raises(ValueError, match="differ from the prompt"):
        load_segments(w64, p.tokens, [CachedSegment(seg.start + 1, seg.tokens, seg.kv)])
    with pytest.raises(ValueError, match="outside the prompt"):
        load_segments(w64, p.tokens[:20], [seg])
    short = KVCache(seg.kv.k[:2], seg.kv.v[:2], seg.kv.positions)
    with pytest.raises(ValueError, match="this model needs"):
        load_segments(w64, p.tokens, [CachedSegment(seg.start, seg.tokens, short)])
    with pytest.raises(ValueError, match="strictly increasing"):
        load_segments(w64, p.tokens, p.segments, positions=torch.arange(p.tokens.shape[0]).flip(0))
    with pytest.raises(ValueError, match="non-empty"):
        load_segments(w64, p.tokens[:0], [])
    raw = load_segments(w64, p.tokens, p.segments, reposition=False)
    with pytest.raises(ValueError, match="reposition_keys"):
        blend_forward(w64, p.tokens, raw, BlendConfig.single(0.1))
    assert torch.equal(
        reposition_keys(w64, raw).kv.k, load_segments(w64, p.tokens, p.segments).kv.k
    )
    with pytest.raises(ValueError, match="does not exist"):
        blend_prefill(w64, p.tokens, p.segments, BlendConfig.single(0.1, check_layer=4))
    with pytest.raises(ValueError, match="strictly increase"):
        BlendConfig(checks=(CheckStep(2, 0.3), CheckStep(1, 0.2)))
    with pytest.raises(ValueError, match="must not increase"):
        BlendConfig(checks=(CheckStep(1, 0.2), CheckStep(2, 0.3)))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        BlendConfig.single(1.5)


def test_request_positions_need_not_start_at_zero(w64: DecoderWeights) -> None:
    """A blend placed after 1000 earlier tokens: queries and keys use absolute positions (LMCache
    starts its blend positions at 0 whatever the request's first position is)."""
    tokens, segs, _ = _exact_cache_prompt(w64)
    pos = torch.arange(1000, 1000 + tokens.shape[0])
    full = full_prefill(w64, tokens, pos)
    res = blend_prefill(w64, tokens, segs, BlendConfig.single(0.2), positions=pos)
    torch.testing.assert_close(res.hidden, full.hidden[res.selected], rtol=0, atol=1e-9)
    torch.testing.assert_close(res.kv.k, full.kv.k, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_ratio_one_is_bitwise_full_prefill(dtype: torch.dtype) -> None:
    w = DecoderWeights.from_hf(build_hf_model(TinyModelSpec(layers=3, dtype=dtype)))
    p = rag_prompt(w, seed=0, **RAG)
    full = full_prefill(w, p.tokens)
    assert torch.equal(
        blend_prefill(w, p.tokens, p.segments, BlendConfig.single(1.0)).hidden, full.hidden
    )
    res = blend_prefill(w, p.tokens, p.segments, BlendConfig.single(0.2))
    assert res.hidden.dtype == res.kv.k.dtype == dtype
    assert bool(torch.isfinite(res.hidden).all())
