"""CacheBlend prefill: reuse independently cached chunks, recompute only the HKVD rows.

Why this exists: a RAG prompt is several retrieved chunks plus a question. Each chunk's KV was
cached on its own (at its own positions, without attention to the other chunks), so plain
concatenation loses the cross-chunk attention. CacheBlend loads the cached KV, re-rotates K to
the chunk's new positions, fully computes the layers up to a check layer, picks the rows whose
KV deviates most (HKVD) and from then on recomputes only those rows, writing their fresh K/V
over the loaded ones.

Semantics implemented (reference §3.5; differences from upstream are deliberate):
- Layers before the first check layer compute every row and persist the fresh K/V (the original
  CacheBlend; LMCache keeps the loaded KV there).
- At a check layer every row that is still being computed is scored, its fresh K/V is written
  into the cache (so at the first check layer attention sees fully fresh K/V), and only the
  selection continues. Several check layers give gradual filtering; each selection is a subset
  of the previous one.
- Rows no segment covers (gaps, the uncached question) and the last token are always selected.
- Selected queries attend with the exact causal mask ``pos_k[j] <= pos_q[i]`` (LMCache #1152
  uses a bottom-right mask; ``MaskKind.BOTTOM_RIGHT`` reproduces it for comparison only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf

from kvpool.kernels.blend.model import (
    DecoderWeights,
    KVCache,
    MaskKind,
    attend,
    final_norm,
    finish_layer,
    project_qkv,
)
from kvpool.kernels.blend.rope import rerope, rope_cos_sin
from kvpool.kernels.blend.select import Selector, deviation, select_rows, target_count

__all__ = [
    "BlendConfig",
    "BlendResult",
    "CachedSegment",
    "CheckStep",
    "LoadedCache",
    "blend_forward",
    "blend_prefill",
    "load_segments",
    "reposition_keys",
]


@dataclass(frozen=True)
class CheckStep:
    """Select at ``layer``: keep ``floor(ratio * N)`` rows plus the forced ones."""

    layer: int
    ratio: float


@dataclass(frozen=True)
class BlendConfig:
    """Check layers and ratios (one step = LMCache's single check layer; more = gradual)."""

    checks: tuple[CheckStep, ...] = (CheckStep(layer=1, ratio=0.15),)
    selector: Selector = Selector.K_DEVIATION
    mask: MaskKind = MaskKind.EXACT
    seed: int = 0  # only for Selector.RANDOM

    def __post_init__(self) -> None:
        if not self.checks:
            raise ValueError("BlendConfig.checks must name at least one (layer, ratio) step")
        for prev, step in zip(self.checks, self.checks[1:], strict=False):
            if step.layer <= prev.layer:
                raise ValueError(
                    f"BlendConfig.checks layers must strictly increase, got {prev.layer} then "
                    f"{step.layer}"
                )
            if step.ratio > prev.ratio:
                raise ValueError(
                    f"BlendConfig.checks ratios must not increase (each selection is a subset "
                    f"of the previous), got {prev.ratio} then {step.ratio}"
                )
        for step in self.checks:
            if not 0.0 <= step.ratio <= 1.0:
                raise ValueError(f"BlendConfig.checks ratio must be in [0, 1], got {step.ratio}")
            if step.layer < 0:
                raise ValueError(f"BlendConfig.checks layer must be >= 0, got {step.layer}")

    @classmethod
    def single(
        cls,
        ratio: float,
        check_layer: int = 1,
        selector: Selector = Selector.K_DEVIATION,
        mask: MaskKind = MaskKind.EXACT,
        seed: int = 0,
    ) -> BlendConfig:
        """One check layer, as LMCache and the original CacheBlend do."""
        step = CheckStep(layer=check_layer, ratio=ratio)
        return cls(checks=(step,), selector=selector, mask=mask, seed=seed)


@dataclass(frozen=True)
class CachedSegment:
    """A chunk's cached KV (``kv.positions`` = where it was computed) placed at ``start``."""

    start: int
    tokens: torch.Tensor
    kv: KVCache


@dataclass(frozen=True)
class LoadedCache:
    """The request's KV buffer and which rows a segment covered.

    ``kv.positions`` are the request's (new) positions; ``rotated_at[N]`` are the positions the
    rows of ``kv.k`` are currently rotated at (equal to ``kv.positions`` once repositioned).
    """

    kv: KVCache
    covered: torch.Tensor  # bool [N]
    rotated_at: torch.Tensor

    @property
    def repositioned(self) -> bool:
        return bool(torch.equal(self.rotated_at, self.kv.positions))


@dataclass(frozen=True)
class BlendResult:
    """Final-normed hidden states of the selected rows and the blended cache."""

    hidden: torch.Tensor  # [|S|, hidden], rows in ``selected`` order
    selected: torch.Tensor  # sorted absolute token indices S of the last check step
    selections: tuple[torch.Tensor, ...]  # S after each check step (each a subset of the last)
    kv: KVCache  # blended K/V at the new positions, every layer
    forced: torch.Tensor  # bool [N]: gaps, uncached rows and the last token


def load_segments(
    w: DecoderWeights,
    tokens: torch.Tensor,
    segments: Sequence[CachedSegment],
    positions: torch.Tensor | None = None,
    *,
    reposition: bool = True,
) -> LoadedCache:
    """Copy the segments into one ``[L, N, Hkv, D]`` buffer on the model's device, then re-rotate
    every segment's K from its cached positions to the new ones (fused delta form).

    Uncovered rows are zero and marked uncovered. ``reposition=False`` skips the re-rotation
    (the bench times the two stages apart).
    """
    if tokens.dim() != 1 or tokens.shape[0] == 0:
        raise ValueError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
    n = int(tokens.shape[0])
    if positions is not None and (
        positions.shape != (n,)
        or positions.is_floating_point()
        or (n > 1 and not bool((positions[1:] > positions[:-1]).all()))
    ):
        raise ValueError(
            f"positions must be {n} strictly increasing integers (one per token), "
            f"got shape {tuple(positions.shape)} dtype {positions.dtype}"
        )
    dev, dt = w.embed.device, w.embed.dtype
    shape = (w.n_layers, n, w.n_kv_heads, w.head_dim)
    k = torch.zeros(shape, dtype=dt, device=dev)
    v = torch.zeros(shape, dtype=dt, device=dev)
    new_pos = torch.arange(n, device=dev) if positions is None else positions.to(dev)
    old_pos = new_pos.clone()
    covered = torch.zeros(n, dtype=torch.bool, device=dev)
    for i, seg in enumerate(segments):
        m = seg.kv.n_tokens
        end = seg.start + m
        if seg.start < 0 or end > n:
            raise ValueError(
                f"segments[{i}] spans [{seg.start}, {end}) outside the prompt [0, {n})"
            )
        if tuple(seg.kv.k.shape[0:1] + seg.kv.k.shape[2:]) != (shape[0], *shape[2:]):
            raise ValueError(
                f"segments[{i}].kv is {tuple(seg.kv.k.shape)}; this model needs "
                f"[{shape[0]}, n, {shape[2]}, {shape[3]}]"
            )
        if bool(covered[seg.start : end].any()):
            raise ValueError(f"segments[{i}] overlaps an earlier segment at [{seg.start}, {end})")
        if not torch.equal(seg.tokens.to(tokens.device), tokens[seg.start : end]):
            raise ValueError(f"segments[{i}].tokens differ from the prompt at [{seg.start}, {end})")
        k[:, seg.start : end] = seg.kv.k
        v[:, seg.start : end] = seg.kv.v
        old_pos[seg.start : end] = seg.kv.positions
        covered[seg.start : end] = True
    loaded = LoadedCache(kv=KVCache(k, v, new_pos), covered=covered, rotated_at=old_pos)
    return reposition_keys(w, loaded) if reposition else loaded


def reposition_keys(w: DecoderWeights, loaded: LoadedCache) -> LoadedCache:
    """Re-rotate the loaded K from the cached positions to the request's (fused delta form)."""
    kv = loaded.kv
    k = rerope(kv.k, loaded.rotated_at, kv.positions, w.rope)
    return LoadedCache(KVCache(k, kv.v, kv.positions), loaded.covered, kv.positions)


def blend_forward(
    w: DecoderWeights,
    tokens: torch.Tensor,
    loaded: LoadedCache,
    cfg: BlendConfig,
    *,
    copy: bool = True,
) -> BlendResult:
    """Run the blend from a loaded (already re-rotated) cache.

    Fresh rows are written into a copy of ``loaded`` (into ``loaded`` itself with ``copy=False``).
    """
    n = int(tokens.shape[0])
    if loaded.kv.n_tokens != n:
        raise ValueError(f"loaded cache has {loaded.kv.n_tokens} tokens, the prompt has {n}")
    if not loaded.repositioned:
        raise ValueError("loaded cache K is still at the cached positions: call reposition_keys")
    last = cfg.checks[-1].layer
    if last >= w.n_layers:
        raise ValueError(
            f"BlendConfig.checks layer {last} does not exist: the model has {w.n_layers} layers"
        )
    steps = {s.layer: s.ratio for s in cfg.checks}
    first = cfg.checks[0].layer
    k_buf, v_buf, pos = loaded.kv.k, loaded.kv.v, loaded.kv.positions
    if copy:
        k_buf, v_buf = k_buf.clone(), v_buf.clone()
    forced = ~loaded.covered
    forced[-1] = True
    rows = torch.arange(n, device=pos.device)  # absolute indices of the rows being computed
    hidden = nnf.embedding(tokens, w.embed)
    cos, sin = rope_cos_sin(pos, w.rope, hidden)
    selections: list[torch.Tensor] = []
    for layer, lw in enumerate(w.layers):
        all_rows = layer <= first
        cos_sin = (cos, sin) if all_rows else (cos[rows], sin[rows])
        q, k, v = project_qkv(w, lw, hidden, cos_sin)
        if layer in steps:
            scores = _scores(cfg, layer, k, v, k_buf[layer, rows], v_buf[layer, rows])
            chosen = select_rows(rows, scores, forced[rows], target_count(steps[layer], n))
            k_buf[layer, rows], v_buf[layer, rows] = k, v
            keep = torch.searchsorted(rows, chosen)
            q, hidden, rows = q[keep], hidden[keep], chosen
            selections.append(chosen)
        elif all_rows:
            k_buf[layer], v_buf[layer] = k, v
        else:
            k_buf[layer, rows], v_buf[layer, rows] = k, v
        out = attend(q, k_buf[layer], v_buf[layer], pos[rows], pos, cfg.mask)
        hidden = finish_layer(w, lw, hidden, out)
    return BlendResult(
        hidden=final_norm(w, hidden),
        selected=rows,
        selections=tuple(selections),
        kv=KVCache(k_buf, v_buf, pos),
        forced=forced,
    )


def _scores(
    cfg: BlendConfig,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    k_old: torch.Tensor,
    v_old: torch.Tensor,
) -> torch.Tensor:
    if cfg.selector is Selector.K_DEVIATION:
        return deviation(k, k_old)
    if cfg.selector is Selector.V_DEVIATION:
        return deviation(v, v_old)
    gen = torch.Generator().manual_seed(cfg.seed * 1009 + layer)
    return torch.rand(k.shape[0], generator=gen).to(k.device)


def blend_prefill(
    w: DecoderWeights,
    tokens: torch.Tensor,
    segments: Sequence[CachedSegment],
    cfg: BlendConfig,
    positions: torch.Tensor | None = None,
) -> BlendResult:
    """Load + re-rotate + selectively recompute: the whole CacheBlend prefill."""
    loaded = load_segments(w, tokens, segments, positions)
    return blend_forward(w, tokens, loaded, cfg, copy=False)
