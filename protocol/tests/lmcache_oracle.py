"""Answers chunk-hash questions with lmcache 0.5.6's own ChunkedTokenDatabase, one JSON line each.

Run as a subprocess by the parity tests, with the PYTHONHASHSEED of the domain under test (and,
for the vLLM regimes, tests/vllm_standin on PYTHONPATH): the test process itself runs with a
different seed, so a match also shows that kvpool.protocol.hashing does not depend on the seed of
the process computing it. Request: {"chunk_size", "hash_algorithm", "save_unfull_chunk",
"tokens"}; reply: {"hashes": [...], "spans": [[start, end], ...]} or {"error": "..."}.
"""

import importlib.util
import json
import logging
import sys

logging.disable(logging.CRITICAL)

from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: E402


def answer(request: dict) -> dict:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=request["chunk_size"],
        pre_caching_hash_algorithm=request["hash_algorithm"],
        save_unfull_chunk=request["save_unfull_chunk"],
    )
    db = ChunkedTokenDatabase(config)
    rows = list(db.process_tokens(tokens=request["tokens"], make_key=False))
    return {"hashes": [h for _, _, h in rows], "spans": [[s, e] for s, e, _ in rows]}


def main() -> None:
    vllm = importlib.util.find_spec("vllm") is not None
    print(json.dumps({"ready": True, "vllm": vllm}), flush=True)
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
        except Exception as exc:  # the test shows lmcache's own error
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
