"""A trace row's LMCache chunk hashes, computed from its block hash ids, without its tokens.

Why this module exists: the replay builds each prompt from its hash ids (equal ids at the same
position give equal tokens; a block's token at offset ``k`` depends only on that block's id;
the last block is cut to ``input_length``), so two prompts share their first ``T`` tokens
exactly when they share the hash ids of the blocks those tokens fall in. Their LMCache chunk
hashes are then equal exactly as far as these keys are: chunk ``j`` is keyed by the previous
chunk's key, the ids of the blocks its tokens fall in and its length. A simulator of a
thousand instances cannot afford the tokens (twelve thousand per request) and does not need
them: it needs the same equalities. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.gateway.traces.blocks import check_blocks

__all__ = ["chunk_keys"]


def chunk_keys(
    hash_ids: Sequence[int],
    input_length: int,
    *,
    chunk_size: int,
    block_tokens: int,
    save_unfull_chunk: bool = False,
) -> tuple[int, ...]:
    """One key per chunk LMCache would hash: the full chunks of the prompt, then the partial
    last chunk when ``save_unfull_chunk``. PromptError (a ValueError) when the ids do not
    cover the prompt."""
    check_blocks(hash_ids, input_length, block_tokens)
    full, rest = divmod(input_length, chunk_size)
    count = full + (1 if save_unfull_chunk and rest else 0)
    keys: list[int] = []
    prev = 0
    for j in range(count):
        start = j * chunk_size
        end = min(start + chunk_size, input_length)
        blocks = tuple(hash_ids[start // block_tokens : (end - 1) // block_tokens + 1])
        prev = hash((prev, blocks, end - start))
        keys.append(prev)
    return tuple(keys)
