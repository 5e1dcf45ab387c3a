"""vllm.v1.core.kv_cache_utils stand-in: NONE_HASH seeded from PYTHONHASHSEED."""

import os
from collections.abc import Callable
from typing import Any

NONE_HASH: Any = None


def init_none_hash(hash_fn: Callable[[Any], Any]) -> None:
    global NONE_HASH  # noqa: PLW0603 -- vLLM's contract: lmcache reads the module global
    seed = os.getenv("PYTHONHASHSEED")
    NONE_HASH = os.urandom(32) if seed is None else hash_fn(seed)
