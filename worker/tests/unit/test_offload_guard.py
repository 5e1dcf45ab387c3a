"""The chunk integrity guard: a sealed chunk verifies; any changed byte, token or length fails."""

from __future__ import annotations

import pytest
import torch

from kvpool.worker.engine.offload import guard


def _sealed(dtype: torch.dtype, tokens: list[int], hidden: int = 8) -> torch.Tensor:
    g = guard.guard_elems(dtype)
    chunk = torch.randn(2, 3, len(tokens), hidden + g).to(dtype)
    guard.seal(chunk, hidden, tokens)
    return chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_guard_fits_in_first_row(dtype: torch.dtype) -> None:
    g = guard.guard_elems(dtype)
    assert g * torch.empty((), dtype=dtype).element_size() >= guard.GUARD_BYTES
    chunk = _sealed(dtype, list(range(5)))
    assert guard.verify(chunk, 8, list(range(5)))


def test_any_flipped_payload_byte_fails() -> None:
    tokens = list(range(100, 116))
    chunk = _sealed(torch.float32, tokens)
    raw = chunk.view(torch.uint8).reshape(-1)
    for pos in (0, 31, raw.numel() // 2, raw.numel() - 1):
        bad = chunk.clone()
        bad.view(torch.uint8).reshape(-1)[pos] ^= 0x01
        assert not guard.verify(bad, 8, tokens), pos


def test_wrong_tokens_or_truncation_or_zeroes_fail() -> None:
    tokens = list(range(16))
    chunk = _sealed(torch.float32, tokens)
    assert not guard.verify(chunk, 8, [*tokens[:-1], 99])
    assert not guard.verify(chunk[:, :, :8].contiguous(), 8, tokens[:8])
    assert not guard.verify(chunk[:, :, :, :10].contiguous(), 8, tokens)
    assert not guard.verify(torch.zeros_like(chunk), 8, tokens)


def test_seal_refuses_non_contiguous() -> None:
    chunk = torch.zeros(2, 2, 4, 12)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        guard.seal(chunk, 4, [1, 2, 3, 4])


def test_payload_is_a_dense_prefix_of_the_chunk() -> None:
    chunk = torch.zeros(2, 3, 5, 8 + guard.guard_elems(torch.float32))
    view = guard.payload(chunk, 8)
    assert view.shape == (2, 3, 5, 8) and view.is_contiguous()
    view.fill_(1.0)
    assert int(chunk.count_nonzero()) == 2 * 3 * 5 * 8
    guard.seal(chunk, 8, list(range(5)))
    assert torch.equal(view, torch.ones(2, 3, 5, 8))  # the guard lives after the payload
