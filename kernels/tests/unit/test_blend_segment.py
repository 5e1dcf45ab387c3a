"""Separator segmentation and position-independent keys (reference §6.5.8), and the whole
CacheBlend flow from a key-value store of independently cached segments."""

import pytest
import torch

from kvpool.kernels.blend import (
    BlendConfig,
    CachedSegment,
    DecoderWeights,
    blend_prefill,
    full_prefill,
)
from kvpool.kernels.blend.segment import segment_key, split_segments
from kvpool.kernels.blend.synthetic import TinyModelSpec, build_hf_model, single_thread

SEP = torch.tensor([7, 7, 9])


def _t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_split_excludes_separators_and_drops_empty_pieces() -> None:
    toks = _t(1, 2, 7, 7, 9, 3, 4, 5, 7, 7, 9, 7, 7, 9, 6)
    segs = split_segments(toks, SEP)
    assert [(s.start, s.end) for s in segs] == [(0, 2), (5, 8), (14, 15)]
    for s in segs:
        assert s.key == segment_key(toks[s.start : s.end])
    assert split_segments(_t(7, 7, 9, 1, 7, 7, 9), SEP)[0].start == 3


def test_overlapping_matches_are_taken_left_to_right() -> None:
    segs = split_segments(_t(1, 5, 5, 5, 2), _t(5, 5))
    assert [(s.start, s.end) for s in segs] == [(0, 1), (3, 5)]


@pytest.mark.parametrize(
    ("tokens", "sep"), [(_t(1, 2, 3), _t()), (_t(7, 7), SEP), (_t(1, 2, 3, 4), SEP)]
)
def test_no_separator_gives_one_segment(tokens: torch.Tensor, sep: torch.Tensor) -> None:
    segs = split_segments(tokens, sep)
    assert [(s.start, s.end) for s in segs] == [(0, tokens.shape[0])]


def test_key_depends_on_tokens_only() -> None:
    chunk = _t(10, 11, 12)
    a = torch.cat((_t(1), SEP, chunk, SEP, _t(2)))
    b = torch.cat((_t(3, 4, 5), SEP, _t(8), SEP, chunk))
    ka = {s.key for s in split_segments(a, SEP)}
    kb = {s.key for s in split_segments(b, SEP)}
    assert segment_key(chunk) in ka & kb
    assert segment_key(chunk) != segment_key(_t(10, 11)) != segment_key(_t(11, 10))
    assert segment_key(chunk.to(torch.int32)) == segment_key(chunk)
    with pytest.raises(ValueError, match="1-D"):
        split_segments(chunk[None], SEP)


def test_store_of_segments_reused_in_another_order() -> None:
    """Cache every segment on its own under its key, then serve a request that orders the chunks
    differently: every chunk hits, separators are recomputed, and r=1 reproduces full prefill."""
    with single_thread(), torch.no_grad():
        w = DecoderWeights.from_hf(build_hf_model(TinyModelSpec(layers=3, dtype=torch.float64)))
        g = torch.Generator().manual_seed(0)
        sys_p, c1, c2, c3, q = (
            torch.randint(20, 512, (n,), generator=g) for n in (6, 20, 25, 15, 5)
        )
        store = {}
        for part in (sys_p, c1, c2, c3):
            store[segment_key(part)] = full_prefill(w, part).kv  # positions 0.. each
        tokens = torch.cat((sys_p, SEP, c3, SEP, c1, SEP, c2, SEP, q))
        hits = []
        for seg in split_segments(tokens, SEP):
            if seg.key in store:
                hits.append(CachedSegment(seg.start, tokens[seg.start : seg.end], store[seg.key]))
        assert len(hits) == 4  # the question is not cached
        full = full_prefill(w, tokens)
        res = blend_prefill(w, tokens, hits, BlendConfig.single(1.0))
        torch.testing.assert_close(res.hidden, full.hidden, rtol=0, atol=1e-10)
        sep_rows = [
            i
            for i in range(tokens.shape[0] - 5)
            if not any(h.start <= i < h.start + h.kv.n_tokens for h in hits)
        ]
        assert len(sep_rows) == 4 * SEP.shape[0] and bool(res.forced[sep_rows].all())
        partial = blend_prefill(w, tokens, hits, BlendConfig.single(0.1))
        assert set(sep_rows) <= set(partial.selected.tolist())
