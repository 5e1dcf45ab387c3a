"""kvpool's paged connector behind LMCache's ``GPUConnectorInterface``, for host-memory KV.

Why this module exists: LMCache 0.5.6 has no connector that copies on CPU (its vLLM paged
connector builds CUDA streams; the mock copies nothing), so the reference engine's paged KV
reaches LMCache through this one. It is the shape of the NPU connector: the device specifics
live in ``kvpool.kernels.layouts`` (gather/scatter), not here.

Rules it keeps:
- KV cache tensors are taken from the call's kwargs every time (``kvcaches``) and never cached:
  upstream caches pointers per device and a retrieve can then write into the wrong cache.
- Stored chunks are ``[2, L, T, H*D + G]`` to LMCache; their bytes are the dense payload
  ``[2, L, T, H*D]`` followed by the integrity guard (:mod:`.guard`). A chunk served from
  this process's local CPU tier is trusted (it was sealed here or verified on its way in);
  any other chunk (read back from disk or a remote tier) is
  verified before a single byte reaches the paged cache, and the first bad chunk ends the
  retrieve there. Trust is by tier, not by memory object: LMCache reuses memory objects.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj

from kvpool.kernels import hostcopy
from kvpool.kernels.layouts import PagedLayout, chunks_to_paged, paged_to_chunks
from kvpool.worker.engine.offload import guard

logger = logging.getLogger(__name__)

# kwargs keys kvpool passes through LMCache's store/retrieve down to this connector.
TOKENS_KW = "kvpool_tokens"
REPORT_KW = "kvpool_report"


@dataclass
class RetrieveReport:
    """What one retrieve really wrote into the paged cache (filled in by the connector)."""

    trusted_starts: set[int] = field(default_factory=set)  # chunks served by local CPU
    verified_end: int | None = None  # token index where verified chunks stop; None: all good
    bad_chunk_starts: list[int] = field(default_factory=list)
    verified_chunks: int = 0  # chunks checked (not trusted on arrival)


class CPUPagedConnector(GPUConnectorInterface):  # type: ignore[misc]
    """Gather/scatter between paged caches ``[2, NB, BS, H, D]`` per layer and LMCache chunks."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        layout: PagedLayout = "flash_nhd",
    ) -> None:
        self.num_layers = num_layers
        self.hidden = num_kv_heads * head_dim
        self.dtype = dtype
        self.layout: PagedLayout = layout
        self.row_width = guard.stored_row_width(self.hidden, dtype)
        hostcopy.warm_up()  # the first retrieve must not wait for numba

    def check_caches(
        self, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, block_size: int
    ) -> None:
        """ValueError naming what is wrong when the engine's caches do not fit this connector."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches: expected {self.num_layers} layers, got {len(kv_caches)}")
        shape = tuple(kv_caches[0].shape)
        want = (block_size, self.hidden)
        if len(shape) != 5 or shape[0] != 2 or (shape[2], shape[3] * shape[4]) != want:
            raise ValueError(
                f"kv_caches: expected [2, num_blocks, {block_size}, heads, head_dim] per layer "
                f"(vLLM flash NHD, heads x head_dim = {self.hidden}), got {list(shape)}"
            )
        if kv_caches[0].dtype != self.dtype:
            raise ValueError(f"kv_caches: dtype {kv_caches[0].dtype} != {self.dtype}")
        if slot_mapping.dim() != 1:
            raise ValueError("slot_mapping must be 1-D (one slot per token)")

    # --- LMCache interface -----------------------------------------------------------------
    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.row_width])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(
        self,
        memory_objs: Sequence[MemoryObj],
        starts: Sequence[int],
        ends: Sequence[int],
        **kwargs: Any,
    ) -> None:
        """Gather every chunk of a store in one copy plan, then seal each chunk."""
        kv_caches, slot_mapping, tokens = _store_args(kwargs)
        chunks = [_tensor(m) for m in memory_objs]
        paged_to_chunks(
            kv_caches,
            _concat_slots(slot_mapping, starts, ends),
            [guard.payload(c, self.hidden) for c in chunks],
            layout=self.layout,
        )
        for chunk, start, end in zip(chunks, starts, ends, strict=True):
            guard.seal(chunk, self.hidden, tokens[start:end])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Sequence[MemoryObj] | None = None,
        starts: Sequence[int] | None = None,
        ends: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise ValueError("CPUPagedConnector is not layerwise: pass memory objects")
        kv_caches, slot_mapping, tokens = _store_args(kwargs)
        report = kwargs.get(REPORT_KW)
        if not isinstance(report, RetrieveReport):
            report = RetrieveReport()  # nothing trusted: verify every chunk
        good: list[tuple[torch.Tensor, int, int]] = []
        # Chunks arrive in token order; verify all before writing any.
        for memory_obj, start, end in sorted(
            zip(memory_objs, starts, ends, strict=True), key=lambda x: x[1]
        ):
            if start not in report.trusted_starts:
                report.verified_chunks += 1
                if not self.check(memory_obj, tokens[start:end]):
                    report.verified_end = start
                    report.bad_chunk_starts.append(start)
                    break
            good.append((_tensor(memory_obj), start, end))
        if good:  # one copy plan for every chunk of the retrieve
            chunks_to_paged(
                [guard.payload(chunk, self.hidden) for chunk, _, _ in good],
                kv_caches,
                _concat_slots(slot_mapping, [s for _, s, _ in good], [e for _, _, e in good]),
                layout=self.layout,
            )

    # --- integrity --------------------------------------------------------------------------
    def check(self, memory_obj: MemoryObj, token_ids: Sequence[int]) -> bool:
        """The chunk carries a valid guard for exactly ``token_ids``."""
        if guard.verify(_tensor(memory_obj), self.hidden, token_ids):
            return True
        logger.warning(
            "KV chunk failed its integrity check (%d tokens): treating it as a miss",
            len(token_ids),
        )
        return False


def _tensor(memory_obj: MemoryObj) -> torch.Tensor:
    t = memory_obj.tensor
    if t is None:
        raise ValueError("LMCache memory object has no tensor")
    assert isinstance(t, torch.Tensor)
    return t


def _concat_slots(
    slot_mapping: torch.Tensor, starts: Sequence[int], ends: Sequence[int]
) -> torch.Tensor:
    """The slots of the chunks ``[start, end)``, in their order, as one tensor."""
    if len(starts) == 1:
        return slot_mapping[starts[0] : ends[0]]
    return torch.cat([slot_mapping[s:e] for s, e in zip(starts, ends, strict=True)])


def _store_args(kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    try:
        kv_caches = kwargs["kvcaches"]
        slot_mapping = kwargs["slot_mapping"]
        tokens = kwargs[TOKENS_KW]
    except KeyError as e:
        raise ValueError(f"CPUPagedConnector needs the {e.args[0]!r} keyword argument") from e
    return list(kv_caches), slot_mapping, tokens
