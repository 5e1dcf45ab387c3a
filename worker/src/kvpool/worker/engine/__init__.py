"""The reference engine: a small transformer with real prefill/decode on CPU, paged KV in the
vLLM layout, continuous batching, and its KV offloaded through ``offload_api.KVOffload``.

Why this package exists: vLLM does not run on CPU, yet every end-to-end test, benchmark and
the demo need an engine whose KV is real. ``ReferenceEngine`` implements
``engine_api.Engine``; ``engine.offload`` (LMCache) implements ``offload_api.KVOffload``.
"""

from kvpool.worker.engine.core import ABORT_TOKEN_ID, ReferenceEngine

__all__ = ["ABORT_TOKEN_ID", "ReferenceEngine"]
