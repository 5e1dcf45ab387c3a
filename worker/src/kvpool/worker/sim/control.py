"""The answers of a worker's REP socket to the controller's commands, as LMCache 0.5.6 gives them.

Why this module exists: kvpool-controller's orchestration API (``/clear``, ``/pin``,
``/compress``, ``/move``, ``/health``) sends ``*WorkerMsg`` requests to every worker of an
instance and combines their answers; a simulated worker must answer each exactly as
``LMCacheWorker.handle_request`` (``cache_controller/worker.py``) does, errors included:

- ``ClearWorkerMsg`` clears the location (LocalCPUBackend: every chunk that is not pinned, each
  an evict event; LocalDiskBackend and unknown locations: 0) → tokens removed;
- ``PinWorkerMsg`` is a pinned lookup in one location: the contiguous prefix held there, pinned
  for good (LMCache never releases these pins) and refreshed in its LRU → tokens;
- ``Compress``/``DecompressWorkerMsg``: any method but ``cachegen`` → 0; with ``cachegen`` the
  prefix's chunks are removed and put back (an evict then an admit each) → tokens; no tokens →
  LMCache's bare ``AssertionError``;
- ``MoveWorkerMsg`` to a location other than LocalCPUBackend → "Only support moving to cpu for
  now."; a hit has to be pushed to a peer over P2P, which the simulated engine has no channel for
  (without P2P LMCache fails on the missing ``'P2PBackend'``, and so does the sim);
- ``HealthWorkerMsg`` → 0 (every allocator's memcheck passes);
- anything else (``CheckFinishWorkerMsg`` included) → ``ErrorMsg("Unknown message: <repr>")``;
- an exception → ``ErrorMsg("Worker error: <exception>")``.

Pure: :func:`reply_to` maps a decoded request to its reply over a :class:`ControlTarget`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from kvpool.protocol import lmcache_wire as w

CPU = "LocalCPUBackend"
DISK = "LocalDiskBackend"


class ControlTarget(Protocol):
    """What the controller's commands act on (the simulated engine's caches)."""

    @property
    def has_p2p(self) -> bool: ...

    @property
    def internal_url(self) -> str:
        """``*:<lmcache_worker_port>``: a move to it is LMCache's intra-node move."""
        ...

    def lookup_pinned(self, tokens: Sequence[int], location: str) -> int:
        """Tokens of the contiguous prefix held in ``location``; those chunks are pinned for
        good and become the most recently used (chunk 0 last)."""
        ...

    def clear_location(self, location: str) -> int:
        """Remove every unpinned chunk of ``location``; tokens removed."""
        ...

    def recompress(self, tokens: Sequence[int], location: str) -> int:
        """Remove the prefix's chunks held in ``location`` and put them back; tokens."""
        ...


def reply_to(request: object, target: ControlTarget) -> msgspec.Struct:
    """The reply LMCache's worker sends to ``request``."""
    try:
        return _answer(request, target)
    except Exception as exc:
        return w.ErrorMsg(error=f"Worker error: {exc}")


def _tokens(tokens: list[int] | None) -> list[int]:
    if tokens is None:
        raise AssertionError  # LMCache's lookup asserts it has tokens: "Worker error: "
    return tokens


def _answer(req: object, target: ControlTarget) -> msgspec.Struct:
    if isinstance(req, w.MoveWorkerMsg):
        if req.new_position[0] == target.internal_url:
            # LMCache 0.5.6 asserts old_position[1] == "LocalDiskBackend" on a str (its second
            # character), then refuses intra-node moves anyway.
            if req.old_position[1] != DISK or req.new_position[1] != CPU or not req.copy:
                raise AssertionError
            raise NotImplementedError("Prefetch from controller is not implemented yet.")
        if req.new_position[1] != CPU:
            raise AssertionError("Only support moving to cpu for now.")
        if not target.lookup_pinned(_tokens(req.tokens), req.old_position):
            return w.MoveWorkerRetMsg(num_tokens=0)
        if not target.has_p2p:
            raise KeyError("P2PBackend")
        raise RuntimeError(
            "the simulated engine moves no KV between instances (it has no transfer channel)"
        )
    if isinstance(req, w.CompressWorkerMsg | w.DecompressWorkerMsg):
        cachegen = req.method == "cachegen"  # LMCache compresses with nothing else
        n = target.recompress(_tokens(req.tokens), req.location) if cachegen else 0
        if isinstance(req, w.CompressWorkerMsg):
            return w.CompressWorkerRetMsg(num_tokens=n)
        return w.DecompressWorkerRetMsg(num_tokens=n)
    if isinstance(req, w.PinWorkerMsg):
        return w.PinWorkerRetMsg(num_tokens=target.lookup_pinned(req.tokens, req.location))
    if isinstance(req, w.ClearWorkerMsg):
        return w.ClearWorkerRetMsg(num_tokens=target.clear_location(req.location))
    if isinstance(req, w.HealthWorkerMsg):
        return w.HealthWorkerRetMsg(error_code=0)
    return w.ErrorMsg(error=f"Unknown message: {req}")
