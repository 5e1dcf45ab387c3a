"""Answers chunk-hash questions with lmcache 0.5.6's own ChunkedTokenDatabase, one JSON line each.

Run as a subprocess by the parity tests with the PYTHONHASHSEED of the domain under test, by the
project's .venv python (no vLLM) or by .kvpool/vllm-venv's (the real vLLM, tests/vllm_venv.py):
the test process itself runs with a different seed, so a match also shows that
kvpool.protocol.hashing does not depend on the seed of the process computing it.

First line: {"ready": true, "python", "lmcache", "vllm" (its version, or null), "seed"}.
Request: {"chunk_size", "hash_algorithm", "save_unfull_chunk", "tokens"}; reply: {"hashes": [...],
"spans": [[start, end], ...], "none_hash": lmcache's NONE_HASH after building the database,
"log": [what lmcache's token database logged meanwhile]} or {"error": "..."}. The log says
where lmcache took NONE_HASH from ("Initialized NONE_HASH=... from vLLM" when vLLM's
init_none_hash seeded it).
"""

import importlib.metadata
import json
import logging
import os
import sys
from typing import Any

# Quiet imports: lmcache reads its level at import, vLLM when it configures its loggers.
os.environ["LMCACHE_LOG_LEVEL"] = "ERROR"
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"

from lmcache.v1 import token_database
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.token_database import ChunkedTokenDatabase


class Recorder(logging.Handler):
    """Keeps the messages of lmcache's token database instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


RECORDER = Recorder()
_logger = logging.getLogger(token_database.__name__)
_logger.handlers = [RECORDER]
_logger.setLevel(logging.INFO)


def answer(request: dict[str, Any]) -> dict[str, Any]:
    RECORDER.messages = []
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=request["chunk_size"],
        pre_caching_hash_algorithm=request["hash_algorithm"],
        save_unfull_chunk=request["save_unfull_chunk"],
    )
    db = ChunkedTokenDatabase(config)
    rows = list(db.process_tokens(tokens=request["tokens"], make_key=False))
    return {
        "hashes": [h for _, _, h in rows],
        "spans": [[s, e] for s, e, _ in rows],
        "none_hash": token_database.NONE_HASH,
        "log": RECORDER.messages,
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    # lmcache imports vLLM on its first database: do it now, so that oracles started together
    # import together instead of one after the other on their first question.
    answer({"chunk_size": 1, "hash_algorithm": "builtin", "save_unfull_chunk": True, "tokens": []})
    hello = {
        "ready": True,
        "python": sys.executable,
        "lmcache": _version("lmcache"),
        "vllm": _version("vllm"),
        "seed": os.environ.get("PYTHONHASHSEED"),
    }
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
        except Exception as exc:  # the test shows lmcache's own error
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
