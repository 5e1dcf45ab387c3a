"""Block manager: which fixed-size KV blocks of the paged cache belong to which sequence.

Why this module exists: the paged cache is shared by all running requests; a request owns a
list of block ids (its block table), grows it one block at a time while decoding and gives
it back when it finishes, is aborted or is preempted. Running out of blocks is an ordinary
event the scheduler handles (wait or preempt), so allocation reports it instead of raising.
"""

from __future__ import annotations

import math


class BlockManager:
    """A free list of block ids ``0 .. num_blocks-1`` (LIFO, so hot blocks are reused)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` free blocks, or None (nothing taken) when fewer are free."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(count)]
        self._owned.update(taken)
        return taken

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend ``block_table`` in place to hold ``num_tokens``; False if out of blocks."""
        missing = self.blocks_for(num_tokens) - len(block_table)
        if missing <= 0:
            return True
        new = self.allocate(missing)
        if new is None:
            return False
        block_table.extend(new)
        return True

    def free(self, block_table: list[int]) -> None:
        """Return a sequence's blocks and empty its table (idempotent per block)."""
        for block in reversed(block_table):
            if block not in self._owned:
                raise ValueError(f"block {block} freed twice or never allocated")
            self._owned.discard(block)
            self._free.append(block)
        block_table.clear()
