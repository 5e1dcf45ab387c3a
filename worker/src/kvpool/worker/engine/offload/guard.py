"""The integrity guard carried inside every stored KV chunk.

Why this module exists: LMCache 0.5.6 moves chunk bytes to disk, Redis and Mooncake without any
checksum. A truncated file is read with ``readinto`` into a buffer that keeps stale bytes, and a
flipped byte in Redis comes back as-is: both would become wrong KV, silently. kvpool asks
LMCache for chunks a few elements wider per row (``[2, L, T, H*D + G]``) but does not use them
row-wise: the chunk's bytes are the payload as a dense ``KV_2LTD`` tensor ``[2, L, T, H*D]``
(contiguous, so copies stay fast) followed by the spare bytes, whose first 16 hold the guard:

====== ====== ==========================================================================
offset size   content
====== ====== ==========================================================================
0      4      magic ``KVPG`` (little-endian u32)
4      4      number of tokens in the chunk
8      8      blake3 digest (first 8 bytes) of the chunk's token ids and every other byte
====== ====== ==========================================================================

The guard travels with the bytes through every tier, so a second process can verify what the
first one wrote. Pure: no I/O, only bytes in and a verdict out.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import blake3
import torch

GUARD_BYTES = 16
MAGIC = 0x4750564B  # b"KVPG" little-endian
_HEADER = struct.Struct("<II8s")


def guard_elems(dtype: torch.dtype) -> int:
    """Guard elements appended to every row so the first row holds ``GUARD_BYTES``."""
    return math.ceil(GUARD_BYTES / torch.empty((), dtype=dtype).element_size())


def stored_row_width(hidden: int, dtype: torch.dtype) -> int:
    """Width of one stored row as LMCache sizes it: the KV hidden size plus the spare."""
    return hidden + guard_elems(dtype)


def payload(chunk: torch.Tensor, hidden: int) -> torch.Tensor:
    """The dense ``[2, L, T, hidden]`` payload at the start of ``chunk`` ``[2, L, T, W]``."""
    two, layers, tokens, _ = chunk.shape
    return chunk.view(-1)[: two * layers * tokens * hidden].view(two, layers, tokens, hidden)


def _digest(raw: memoryview, guard_off: int, token_ids: Sequence[int]) -> bytes:
    h = blake3.blake3(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(raw[:guard_off])
    h.update(raw[guard_off + GUARD_BYTES :])
    return h.digest(length=8)


def _raw(chunk: torch.Tensor) -> memoryview:
    if not chunk.is_contiguous() or chunk.device.type != "cpu":
        raise ValueError("a stored chunk must be a contiguous CPU tensor")
    array: Any = chunk.view(torch.uint8).reshape(-1).numpy()
    return memoryview(array)


def _guard_offset(chunk: torch.Tensor, hidden: int) -> int:
    two, layers, tokens, _ = chunk.shape
    return two * layers * tokens * hidden * chunk.element_size()


def seal(chunk: torch.Tensor, hidden: int, token_ids: Sequence[int]) -> None:
    """Write the guard of ``chunk`` (shape ``[2, L, T, hidden + G]``) for ``token_ids``."""
    raw = _raw(chunk)
    off = _guard_offset(chunk, hidden)
    digest = _digest(raw, off, token_ids)
    raw[off : off + GUARD_BYTES] = _HEADER.pack(MAGIC, len(token_ids), digest)


def verify(chunk: torch.Tensor, hidden: int, token_ids: Sequence[int]) -> bool:
    """True when ``chunk`` carries a valid guard for exactly these ``token_ids``."""
    if chunk.dim() != 4 or chunk.size(2) != len(token_ids) or chunk.size(3) <= hidden:
        return False
    raw = _raw(chunk)
    off = _guard_offset(chunk, hidden)
    magic, ntokens, digest = _HEADER.unpack(bytes(raw[off : off + GUARD_BYTES]))
    if magic != MAGIC or ntokens != len(token_ids):
        return False
    return bool(digest == _digest(raw, off, token_ids))
