"""kvpool.protocol.hashing agrees with lmcache 0.5.6's own ChunkedTokenDatabase, regime by regime.

Each regime's oracle is a long-lived subprocess (tests/lmcache_oracle.py) running lmcache's real
class under the domain's PYTHONHASHSEED, while this test process runs under its own (normally
random) seed; test_hashing.py separately shows our result does not depend on that seed.
Hypothesis draws the token sequences, chunk sizes, algorithms and save_unfull_chunk; every
example is one round trip.

The vLLM regimes put tests/vllm_standin on the oracle's PYTHONPATH: vLLM itself cannot be
installed here (CUDA/NPU builds pinning another torch), so the stand-in carries the few lines of
vLLM that lmcache calls (see its docstring); everything else is lmcache's own code.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.protocol.hashing import HashConfig, iter_chunk_hashes

TESTS = Path(__file__).resolve().parent.parent
ORACLE = TESTS / "lmcache_oracle.py"
STANDIN = TESTS / "vllm_standin"

# (vLLM importable in the engine, the domain's PYTHONHASHSEED); 0 disables hash randomization.
REGIMES = [(False, "123"), (True, "0"), (True, "4294967295")]
#: lmcache imports torch and transformers first: allow a slow start on a loaded box.
REPLY_TIMEOUT_S = 120


class Oracle:
    def __init__(self, vllm: bool, seed: str) -> None:
        env = {**os.environ, "PYTHONHASHSEED": seed, "LMCACHE_TRACK_USAGE": "false"}
        env.pop("PYTHONPATH", None)
        if vllm:
            env["PYTHONPATH"] = str(STANDIN)
        self.proc = subprocess.Popen(
            [sys.executable, str(ORACLE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.vllm, self.seed = vllm, seed
        self.hello: dict[str, Any] | None = None

    def _line(self) -> dict[str, Any]:
        """The oracle's next reply; a dead or stuck oracle fails the test instead of hanging."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        assert ready, f"lmcache oracle {self.vllm=} {self.seed=} did not answer"
        line = self.proc.stdout.readline()
        assert line, f"lmcache oracle {self.vllm=} {self.seed=} exited ({self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        if self.hello is None:
            self.hello = self._line()
        assert self.hello["vllm"] is self.vllm, self.hello
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._line()
        assert "error" not in reply, reply
        return reply

    def close(self) -> None:
        """Stop the oracle now: it holds no state, and LMCache's threads slow a clean exit."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def oracles() -> Iterator[dict[tuple[bool, str], Oracle]]:
    started = {regime: Oracle(*regime) for regime in REGIMES}  # start together: imports overlap
    try:
        yield started
    finally:
        for oracle in started.values():
            oracle.close()


tokens_st = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=70)
configs_st = st.tuples(
    st.sampled_from([1, 3, 16, 256]),
    st.sampled_from(["builtin", "sha256_cbor"]),
    st.booleans(),
)


@pytest.mark.parametrize(("vllm", "seed"), REGIMES, ids=lambda v: str(v))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tokens=tokens_st, config=configs_st)
def test_chunk_hashes_equal_lmcache(
    oracles: dict[tuple[bool, str], Oracle],
    vllm: bool,
    seed: str,
    tokens: list[int],
    config: tuple[int, str, bool],
) -> None:
    chunk_size, algorithm, unfull = config
    theirs = oracles[(vllm, seed)].ask(
        {
            "chunk_size": chunk_size,
            "hash_algorithm": algorithm,
            "save_unfull_chunk": unfull,
            "tokens": tokens,
        }
    )
    cfg = HashConfig(chunk_size, algorithm, seed, unfull, vllm)
    ours = list(iter_chunk_hashes(tokens, cfg))
    assert [c.hash for c in ours] == theirs["hashes"]
    assert [[c.start, c.end] for c in ours] == theirs["spans"]


@pytest.mark.parametrize(("vllm", "seed"), REGIMES, ids=lambda v: str(v))
def test_a_long_prompt_with_a_partial_chunk(
    oracles: dict[tuple[bool, str], Oracle], vllm: bool, seed: str
) -> None:
    """4 full 256-token chunks and 17 tokens more, at the top of a 150k vocabulary."""
    tokens = [151_000 - (i * 7919) % 150_000 for i in range(4 * 256 + 17)]
    for algorithm in ("builtin", "sha256_cbor"):
        for unfull in (False, True):
            theirs = oracles[(vllm, seed)].ask(
                {
                    "chunk_size": 256,
                    "hash_algorithm": algorithm,
                    "save_unfull_chunk": unfull,
                    "tokens": tokens,
                }
            )
            cfg = HashConfig(256, algorithm, seed, unfull, vllm)
            ours = [c.hash for c in iter_chunk_hashes(tokens, cfg)]
            assert len(ours) == (5 if unfull else 4)
            assert ours == theirs["hashes"]


def test_regimes_really_differ(oracles: dict[tuple[bool, str], Oracle]) -> None:
    """The regimes are distinct: a test that mixed them up would fail here."""
    tokens = list(range(40))
    seen = set()
    for vllm, seed in REGIMES:
        for algorithm in ("builtin", "sha256_cbor"):
            req = {"chunk_size": 16, "hash_algorithm": algorithm, "save_unfull_chunk": True}
            seen.add(tuple(oracles[(vllm, seed)].ask({**req, "tokens": tokens})["hashes"]))
    # without vLLM both algorithms hash alike; with vLLM each (seed, algorithm) differs
    assert len(seen) == 1 + 2 * 2
