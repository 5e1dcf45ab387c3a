"""Admit and evict events batched per LMCache location, exactly as LMCache 0.5.6 batches them.

Why this module exists: the controller's index is built from these batches and checks their
sequence numbers per (worker, location); a simulated worker must produce the same frames a
real one does. LMCache's ``BatchedMessageSender`` (one per ``LocalCPUBackend`` /
``LocalDiskBackend``) queues ``KVOpEvent(op, chunk_hash)``; its consumer wakes every
``kv_msg_batch_timeout`` (10 ms) or as soon as ``kv_msg_batch_size`` (50) are queued, drains
*everything* queued into one ``BatchedKVOperationMsg`` and numbers the operations at drain
time, consecutively from 0 for the life of the process (never reset: not on re-registration,
not on a full sync). Admits and evicts share one queue, so their order is kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvpool.protocol import lmcache_wire as w

OPS = {"admit": w.OpType.ADMIT, "evict": w.OpType.EVICT}


class KvOpBatcher:
    """One location's queue; ``send`` receives each batch (the worker's PUSH outbox)."""

    def __init__(
        self,
        instance_id: str,
        worker_id: int,
        location: str,
        send: Callable[[w.BatchedKVOperationMsg], None],
        *,
        batch_size: int = 50,
        timeout_s: float = 0.01,
    ) -> None:
        self.instance_id = instance_id
        self.worker_id = worker_id
        self.location = location
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self._send = send
        self._pending: list[tuple[w.OpType, int]] = []
        self._timer: asyncio.Handle | None = None
        self.next_seq = 0
        self.sent_ops = 0

    def add(self, op: str, key: int) -> None:
        """Queue one operation (``admit`` or ``evict``); it leaves within the batch timeout."""
        self._pending.append((OPS[op], key))
        loop = asyncio.get_running_loop()
        if len(self._pending) >= self.batch_size:
            # LMCache's producer notifies its consumer, which drains what is queued by the
            # time it runs: here, at the end of this loop turn (the whole step's events).
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_soon(self.flush)
        elif self._timer is None:
            self._timer = loop.call_later(self.timeout_s, self.flush)

    def flush(self) -> None:
        """Drain everything queued into one batch, numbered from ``next_seq``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        ops = [
            w.KVOpEvent(op_type=op, key=key, seq_num=self.next_seq + i)
            for i, (op, key) in enumerate(self._pending)
        ]
        self.next_seq += len(ops)
        self.sent_ops += len(ops)
        self._pending.clear()
        self._send(
            w.BatchedKVOperationMsg(
                instance_id=self.instance_id,
                worker_id=self.worker_id,
                location=self.location,
                operations=ops,
            )
        )

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Stop the timer without sending (LMCache loses what is queued at close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
