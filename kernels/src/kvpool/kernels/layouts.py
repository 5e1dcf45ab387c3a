"""Paged KV gather/scatter between inference-engine layouts and LMCache chunk formats.

Why this module exists: an engine keeps KV in paged blocks addressed by a slot mapping
(``slot = block_id * block_size + offset``), LMCache stores it as dense per-chunk tensors. Every
store copies paged → chunk ("gather"), every retrieve copies chunk → paged ("scatter"). LMCache
does this with CUDA/AscendC kernels; its CPU fallback rejects HND layouts and caches raw
pointers. This is kvpool's device-agnostic version (CPU, CUDA, NPU via plain aten ops) with the
semantics of LMCache's ``multi_layer_kv_transfer``:

- ``slot < 0`` (vLLM's PAD_SLOT_ID) is skipped in both directions; the destination row keeps
  its old contents (it is not zeroed).
- A scatter with duplicate slots is rejected (on CUDA it is a race; here it would be
  last-writer-wins, which silently hides an engine bug).
- Copies are bit-exact for every dtype (fp32, fp16, bf16, fp8 stored as uint8): only indexing,
  never arithmetic.

Engine layouts (per layer, one tensor each; ``H`` KV heads, ``D`` head dim, ``NB`` blocks,
``BS`` block size):

=================  =========================  ===============================
name               shape                       used by
=================  =========================  ===============================
``flash_nhd``      ``[2, NB, BS, H, D]``       vLLM flash-attn (default)
``flash_hnd``      ``[2, NB, H, BS, D]``       flash-attn, HND stride order
``flashinfer_nhd`` ``[NB, 2, BS, H, D]``       vLLM flashinfer
``flashinfer_hnd`` ``[NB, 2, H, BS, D]``       flashinfer, HND
``mla``            ``[NB, BS, D]``             vLLM MLA (one latent plane)
=================  =========================  ===============================

Chunk formats (LMCache ``MemoryFormat``): ``KV_2LTD`` ``[2, L, T, H*D]`` (all layers),
``KV_2TD`` ``[2, T, H*D]`` (one layer: layerwise mode and blending), ``KV_MLA_FMT``
``[1, L, T, D]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvpool.kernels import device, hostcopy

PagedLayout = Literal["flash_nhd", "flash_hnd", "flashinfer_nhd", "flashinfer_hnd", "mla"]
ChunkFormat = Literal["KV_2LTD", "KV_2TD", "KV_MLA_FMT"]

# How to permute each physical layout into the logical [2, NB, BS, H, D] view.
_TO_LOGICAL: dict[str, tuple[int, ...]] = {
    "flash_nhd": (0, 1, 2, 3, 4),
    "flash_hnd": (0, 1, 3, 2, 4),
    "flashinfer_nhd": (1, 0, 2, 3, 4),
    "flashinfer_hnd": (1, 0, 3, 2, 4),
}


class LayoutError(ValueError):
    """Shapes, dtypes, devices or slots that do not fit the requested layout and format."""


def slot_mapping_from_block_table(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """vLLM's slot math: ``slot = block_table[pos // BS] * BS + pos % BS`` (int64)."""
    pos = positions.to(torch.long)
    return block_table.to(torch.long)[pos // block_size] * block_size + pos % block_size


def _logical(cache: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """View of one layer's cache as [2, NB*BS, H*D] if the layout allows a free view, else as
    the logical [2, NB, BS, H, D] (strided) view."""
    if layout == "mla":
        if cache.dim() != 3:
            raise LayoutError(f"layout mla expects [NB, BS, D] per layer, got {list(cache.shape)}")
        return cache
    if cache.dim() != 5:
        raise LayoutError(
            f"layout {layout} expects a 5-D tensor per layer, got {list(cache.shape)}"
        )
    view = cache.permute(*_TO_LOGICAL[layout])
    if view.size(0) != 2:
        raise LayoutError(
            f"layout {layout}: K/V dimension must be 2, got shape {list(cache.shape)}"
        )
    if layout == "flash_nhd" and cache.is_contiguous():
        two, nb, bs, h, d = view.shape
        return view.view(two, nb * bs, h * d)
    return view


def _check(
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    layout: PagedLayout,
    fmt: ChunkFormat,
) -> None:
    if not kv_caches:
        raise LayoutError("kv_caches is empty: pass one tensor per layer")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise LayoutError(
            f"slot_mapping must be a 1-D int64/int32 tensor, got {slot_mapping.dtype} "
            f"with shape {list(slot_mapping.shape)}"
        )
    first = kv_caches[0]
    for i, c in enumerate(kv_caches):
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise LayoutError(f"kv_caches[{i}] differs in shape/dtype/device from kv_caches[0]")
    if chunk.dtype != first.dtype:
        raise LayoutError(f"chunk dtype {chunk.dtype} != kv cache dtype {first.dtype}")
    if (fmt == "KV_MLA_FMT") != (layout == "mla"):
        raise LayoutError(f"format {fmt} does not go with layout {layout}: MLA needs both")
    n_layers = len(kv_caches)
    t = slot_mapping.numel()
    if layout == "mla":
        nb, bs, d = first.shape
        want: tuple[int, ...] = (1, n_layers, t, d)
    else:
        logical = first.permute(*_TO_LOGICAL[layout])
        _, nb, bs, h, d = logical.shape
        want = (2, t, h * d) if fmt == "KV_2TD" else (2, n_layers, t, h * d)
        if fmt == "KV_2TD" and n_layers != 1:
            raise LayoutError(f"format KV_2TD holds one layer, got {n_layers} kv caches")
    if tuple(chunk.shape) != want:
        raise LayoutError(f"chunk shape {list(chunk.shape)} != expected {list(want)} for {fmt}")
    if t and int(slot_mapping.max()) >= nb * bs:
        raise LayoutError(
            f"slot {int(slot_mapping.max())} is out of range: the cache has {nb * bs} slots"
        )


def _per_layer_chunks(chunk: torch.Tensor, fmt: ChunkFormat) -> list[torch.Tensor]:
    """Views of the chunk, one per layer, each [2, T, X] (or [1, T, D] for MLA)."""
    if fmt == "KV_2TD":
        return [chunk]
    return [chunk[:, layer] for layer in range(chunk.size(1))]


def _split(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(valid slots, token positions of the valid slots or None when all are valid)."""
    slots = slots.to(torch.long)
    valid = slots >= 0
    if bool(valid.all()):
        return slots, None
    pos = valid.nonzero().squeeze(1)
    return slots[pos], pos


def paged_to_chunk(
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    *,
    layout: PagedLayout = "flash_nhd",
    fmt: ChunkFormat = "KV_2LTD",
) -> None:
    """Gather the tokens at ``slot_mapping`` from every layer's paged cache into ``out``.

    ``out[..., t, :]`` is left untouched where ``slot_mapping[t] < 0``.
    """
    _check(kv_caches, slot_mapping, out, layout, fmt)
    fast = device.accelerated("paged_to_chunk", out)
    if fast is not None:
        fast(kv_caches, slot_mapping, out, layout=layout, fmt=fmt)
        return
    slots, pos = _split(slot_mapping.to(kv_caches[0].device))
    if slots.numel() == 0:
        return
    bs_flat = _block_size(kv_caches[0], layout)
    blocks = _whole_blocks(slots, bs_flat) if pos is None else None
    for cache, dst in zip(kv_caches, _per_layer_chunks(out, fmt), strict=True):
        src = _logical(cache, layout)
        if layout == "mla":
            rows = src.view(-1, src.size(-1)) if src.is_contiguous() else None
            got = (
                rows.index_select(0, slots)
                if rows is not None
                else src[slots // src.size(1), slots % src.size(1)]
            )
            _put_tokens(dst[0], pos, got)
            continue
        if src.dim() == 3:  # contiguous flash_nhd: [2, NB*BS, H*D]
            for kv in range(2):
                rows, idx = _rows(src[kv], slots, blocks, bs_flat)
                target = _as_dtype(dst[kv], rows.dtype) if pos is None else None
                if target is not None and target.is_contiguous():
                    torch.index_select(rows, 0, idx, out=target.view(-1, rows.size(1)))
                else:  # masked tokens, or an output that cannot take the word view
                    _put_tokens(dst[kv], pos, src[kv].index_select(0, slots))
            continue
        bs = src.size(2)
        got = src[:, slots // bs, slots % bs]  # [2, T', H, D]
        for kv in range(2):
            _put_tokens(dst[kv], pos, got[kv].reshape(got.size(1), -1))


def _block_size(cache: torch.Tensor, layout: PagedLayout) -> int:
    return (
        int(cache.size(1)) if layout == "mla" else int(cache.permute(*_TO_LOGICAL[layout]).size(2))
    )


def _whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids if the slots are whole blocks in order (the common case: a chunk of a request
    whose blocks are full), else None. Whole-block copies move block_size rows per index."""
    t = slots.numel()
    if t % block_size:
        return None
    grid = slots.view(-1, block_size)
    first = grid[:, :1]
    if bool((first % block_size).any()) or not bool(
        (grid - first == torch.arange(block_size, device=slots.device)).all()
    ):
        return None
    return (first.squeeze(1) // block_size).contiguous()


def _words(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a contiguous tensor as 16- or 8-byte words when its rows allow. aten's
    index copies move one element per inner step, so wider elements copy faster on CPU
    (LMCache's kernels move 8-byte words for the same reason). complex128 is only a 16-byte
    container here: values are moved, never computed on, so every bit pattern survives (the
    layout tests compare bits with random payloads, NaNs included)."""
    row_bytes = t.size(-1) * t.element_size()
    for dtype, width in ((torch.complex128, 16), (torch.int64, 8)):
        if row_bytes % width == 0:
            try:
                return t.view(dtype)
            except RuntimeError:
                continue
    return t


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` reinterpreted as ``dtype`` (the word type chosen for the cache side), or None
    when its storage offset or strides do not allow it."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def _rows(
    flat: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 2-D view of one contiguous [slots, X] plane, the row indices into it): whole blocks
    when possible, 8-byte words when possible."""
    words = _words(flat)
    if blocks is not None:
        return words.view(-1, block_size * words.size(1)), blocks
    return words, slots


def _put_tokens(dst: torch.Tensor, pos: torch.Tensor | None, rows: torch.Tensor) -> None:
    if pos is None:
        dst.copy_(rows)
    else:
        dst.index_copy_(0, pos, rows)


def chunk_to_paged(
    chunk: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    layout: PagedLayout = "flash_nhd",
    fmt: ChunkFormat = "KV_2LTD",
) -> None:
    """Scatter ``chunk`` into every layer's paged cache at ``slot_mapping``.

    Tokens with ``slot < 0`` are skipped (their cache rows keep their contents). Duplicate
    non-negative slots raise :class:`LayoutError`.
    """
    _check(kv_caches, slot_mapping, chunk, layout, fmt)
    fast = device.accelerated("chunk_to_paged", chunk)
    if fast is not None:
        fast(chunk, kv_caches, slot_mapping, layout=layout, fmt=fmt)
        return
    slots, pos = _split(slot_mapping.to(kv_caches[0].device))
    if slots.numel() == 0:
        return
    if torch.unique(slots).numel() != slots.numel():
        raise LayoutError("slot_mapping has duplicate slots: a scatter would race; fix the engine")
    bs_flat = _block_size(kv_caches[0], layout)
    blocks = _whole_blocks(slots, bs_flat) if pos is None else None
    for cache, src in zip(kv_caches, _per_layer_chunks(chunk, fmt), strict=True):
        dst = _logical(cache, layout)

        def rows_of(t: torch.Tensor) -> torch.Tensor:
            return t if pos is None else t.index_select(0, pos)

        if layout == "mla":
            if dst.is_contiguous():
                dst.view(-1, dst.size(-1)).index_copy_(0, slots, rows_of(src[0]))
            else:
                dst[slots // dst.size(1), slots % dst.size(1)] = rows_of(src[0])
            continue
        if dst.dim() == 3:  # contiguous flash_nhd
            for kv in range(2):
                rows, idx = _rows(dst[kv], slots, blocks, bs_flat)
                tokens = rows_of(src[kv]).contiguous()
                words = _as_dtype(tokens, rows.dtype)
                if words is None:  # an unaligned chunk view: a fresh copy is aligned
                    words = tokens.clone().view(rows.dtype)
                rows.index_copy_(0, idx, words.view(-1, rows.size(1)))
            continue
        bs, h, d = dst.size(2), dst.size(3), dst.size(4)
        for kv in range(2):
            dst[kv][slots // bs, slots % bs] = rows_of(src[kv]).reshape(-1, h, d)


# --- many chunks in one call ------------------------------------------------------------------
def chunks_to_paged(
    chunks: Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    layout: PagedLayout = "flash_nhd",
    fmt: ChunkFormat = "KV_2LTD",
    threads: int | None = None,
) -> None:
    """Scatter several chunks in one call: chunk ``i`` holds the tokens
    ``slot_mapping[o_i : o_i + T_i]`` (``o_i`` the tokens of the chunks before it).

    Same semantics as :func:`chunk_to_paged` chunk by chunk (negative slots skipped,
    duplicate slots across all chunks rejected). Host tensors in the flash NHD layout and
    ``KV_2LTD`` take one copy plan run by :mod:`kvpool.kernels.hostcopy` on up to
    ``threads`` threads (default: the cores); anything else falls back to one
    :func:`chunk_to_paged` per chunk.
    """
    spans = _spans(chunks, slot_mapping, fmt)
    plan = _host_plan(chunks, kv_caches, slot_mapping, layout, fmt, "chunk_to_paged")
    if plan is None:
        for chunk, (a, b) in zip(chunks, spans, strict=True):
            chunk_to_paged(chunk, kv_caches, slot_mapping[a:b], layout=layout, fmt=fmt)
        return
    chunk_addr, cache_addr, nbytes, slots = plan
    valid = slots[slots >= 0]
    if valid.numel() > 1:
        ordered = valid.sort().values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise LayoutError(
                "slot_mapping has duplicate slots: a scatter would race; fix the engine"
            )
    hostcopy.run(chunk_addr, cache_addr, nbytes, threads=threads)


def paged_to_chunks(
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    outs: Sequence[torch.Tensor],
    *,
    layout: PagedLayout = "flash_nhd",
    fmt: ChunkFormat = "KV_2LTD",
    threads: int | None = None,
) -> None:
    """Gather into several chunks in one call (the reverse of :func:`chunks_to_paged`):
    ``outs[i]`` receives the tokens ``slot_mapping[o_i : o_i + T_i]``; rows of negative
    slots are left untouched."""
    spans = _spans(outs, slot_mapping, fmt)
    plan = _host_plan(outs, kv_caches, slot_mapping, layout, fmt, "paged_to_chunk")
    if plan is None:
        for out, (a, b) in zip(outs, spans, strict=True):
            paged_to_chunk(kv_caches, slot_mapping[a:b], out, layout=layout, fmt=fmt)
        return
    chunk_addr, cache_addr, nbytes, _ = plan
    hostcopy.run(cache_addr, chunk_addr, nbytes, threads=threads)


def _spans(
    chunks: Sequence[torch.Tensor], slot_mapping: torch.Tensor, fmt: ChunkFormat
) -> list[tuple[int, int]]:
    """Token range of each chunk in ``slot_mapping``; their sum must be its length."""
    axis = 1 if fmt == "KV_2TD" else 2
    spans: list[tuple[int, int]] = []
    start = 0
    for i, chunk in enumerate(chunks):
        if chunk.dim() <= axis:
            raise LayoutError(f"chunks[{i}] has shape {list(chunk.shape)}, not {fmt}")
        spans.append((start, start + int(chunk.size(axis))))
        start += int(chunk.size(axis))
    if slot_mapping.dim() != 1 or start != slot_mapping.numel():
        raise LayoutError(
            f"the chunks hold {start} tokens but slot_mapping has shape "
            f"{list(slot_mapping.shape)}: pass the chunks' slots concatenated"
        )
    return spans


_Plan = tuple[hostcopy.I64, hostcopy.I64, hostcopy.I64, torch.Tensor]


def _host_plan(
    chunks: Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    layout: PagedLayout,
    fmt: ChunkFormat,
    op: str,
) -> _Plan | None:
    """(chunk-side addresses, cache-side addresses, bytes, slots) of every copy, one per run
    of consecutive slots per layer and K/V; None when the tensors do not allow raw host
    copies (another device or layout, a non-contiguous tensor, a registered device op).
    Every shape, dtype and slot bound is checked before an address is computed."""
    if not chunks or not kv_caches or layout != "flash_nhd" or fmt != "KV_2LTD":
        return None
    first = kv_caches[0]
    tensors = [*kv_caches, *chunks]
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    if device.accelerated(op, chunks[0]) is not None:
        return None
    if first.dim() != 5 or first.size(0) != 2:
        raise LayoutError(f"layout {layout} expects [2, NB, BS, H, D], got {list(first.shape)}")
    layers = len(kv_caches)
    _, nb, bs, h, d = first.shape
    for i, c in enumerate(kv_caches):
        if c.shape != first.shape or c.dtype != first.dtype:
            raise LayoutError(f"kv_caches[{i}] differs in shape/dtype from kv_caches[0]")
    for i, c in enumerate(chunks):
        if c.dtype != first.dtype:
            raise LayoutError(f"chunks[{i}] dtype {c.dtype} != kv cache dtype {first.dtype}")
        if c.dim() != 4 or (c.size(0), c.size(1), c.size(3)) != (2, layers, h * d):
            raise LayoutError(
                f"chunks[{i}] shape {list(c.shape)} != expected [2, {layers}, T, {h * d}] for {fmt}"
            )
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise LayoutError(f"slot_mapping must be int64/int32, got {slot_mapping.dtype}")
    slots = slot_mapping.to(device="cpu", dtype=torch.long)
    n = slots.numel()
    if n and int(slots.max()) >= nb * bs:
        raise LayoutError(f"slot {int(slots.max())} is out of range: the cache has {nb * bs} slots")
    row = h * d * first.element_size()
    tokens = torch.tensor([int(c.size(2)) for c in chunks], dtype=torch.long)
    # chunk index of every token; not repeat_interleave, whose 2-thread CPU kernel waited
    # 10-30 ms for its second thread on the busy box (cumsum of chunk starts takes 10 us)
    firsts = torch.cumsum(tokens, 0) - tokens
    later = firsts[1:]
    chunk_of = torch.cumsum(torch.bincount(later[later < n], minlength=n)[:n], 0)
    t_in = torch.arange(n) - firsts[chunk_of]
    valid = slots >= 0
    follows = torch.zeros(n, dtype=torch.bool)
    if n > 1:
        follows[1:] = valid[:-1] & (slots[1:] == slots[:-1] + 1) & (chunk_of[1:] == chunk_of[:-1])
    starts = (valid & ~follows).nonzero().squeeze(1)
    run_of = torch.cumsum((valid & ~follows).to(torch.long), 0) - 1
    lengths = torch.bincount(run_of[valid], minlength=starts.numel())
    c = chunk_of[starts].view(-1, 1, 1)
    kv = torch.arange(2).view(1, 2, 1)
    layer = torch.arange(layers).view(1, 1, layers)
    chunk_base = torch.tensor([t.data_ptr() for t in chunks], dtype=torch.long)
    cache_base = torch.tensor([t.data_ptr() for t in kv_caches], dtype=torch.long)
    chunk_addr = (
        chunk_base[c] + ((kv * layers + layer) * tokens[c] + t_in[starts].view(-1, 1, 1)) * row
    )
    cache_addr = cache_base.view(1, 1, -1) + (kv * (nb * bs) + slots[starts].view(-1, 1, 1)) * row
    nbytes = (lengths * row).view(-1, 1, 1).expand(-1, 2, layers)
    return (
        chunk_addr.reshape(-1).numpy(),
        cache_addr.reshape(-1).numpy(),
        nbytes.reshape(-1).numpy(),
        slots,
    )
