"""kvpool.protocol.hashing agrees with lmcache 0.5.6's own ChunkedTokenDatabase, regime by regime.

Each regime's oracle is a long-lived subprocess (tests/lmcache_oracle.py) running lmcache's real
class under the domain's PYTHONHASHSEED, while this test process runs under its own (normally
random) seed; test_hashing.py separately shows our result does not depend on that seed.
Hypothesis draws the token sequences, chunk sizes, algorithms and save_unfull_chunk; every
example is one round trip.

The regime without vLLM (kvpool's reference engine) runs its oracle with this process's python,
the project's .venv, where vLLM is not installed. The vLLM regimes run theirs with
.kvpool/vllm-venv's python (tests/vllm_venv.py builds it; the test runner does so before these
tests): lmcache 0.5.6 next to the real vLLM 0.33.0, so lmcache takes vLLM's hash functions and
vLLM's own init_none_hash seeds NONE_HASH, which lmcache logs and the tests check. Without that
venv the vLLM-regime tests fail and say what to run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.protocol.hashing import HashConfig, iter_chunk_hashes, none_hash

TESTS = Path(__file__).resolve().parent.parent
ORACLE = TESTS / "lmcache_oracle.py"


def _load_installer() -> ModuleType:
    """tests/vllm_venv.py (not on sys.path under --import-mode=importlib): where the venv is."""
    spec = importlib.util.spec_from_file_location("kvpool_tests_vllm_venv", TESTS / "vllm_venv.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VLLM_VENV = _load_installer()
VLLM_VERSION = VLLM_VENV.VLLM.partition("==")[2]
LMCACHE_VERSION = VLLM_VENV.LMCACHE.partition("==")[2]

# (vLLM importable in the engine, the domain's PYTHONHASHSEED); 0 disables hash randomization.
# Without vLLM the seed changes nothing; with vLLM it is the start of every chain.
REGIMES = [(False, "123"), (True, "0"), (True, "1234567"), (True, "4294967295")]
VLLM_SEEDS = [seed for vllm, seed in REGIMES if vllm]
#: The first answer of a vLLM oracle imports torch, transformers, lmcache and vLLM: allow a slow
#: start with all oracles starting at once on a loaded 2-core box.
REPLY_TIMEOUT_S = 300


class Oracle:
    """One lmcache process of one regime; a vLLM one needs the built vLLM venv."""

    def __init__(self, vllm: bool, seed: str) -> None:
        self.vllm, self.seed = vllm, seed
        self.hello: dict[str, Any] | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.unavailable = VLLM_VENV.problem() if vllm else None
        if self.unavailable is not None:
            return
        env = {**os.environ, "PYTHONHASHSEED": seed, "LMCACHE_TRACK_USAGE": "false"}
        env.pop("PYTHONPATH", None)
        python = str(VLLM_VENV.PYTHON) if vllm else sys.executable
        self.proc = subprocess.Popen(
            [python, str(ORACLE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )

    def _line(self) -> dict[str, Any]:
        """The oracle's next reply; a dead or stuck oracle fails the test instead of hanging."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        assert ready, f"lmcache oracle {self.vllm=} {self.seed=} did not answer"
        line = self.proc.stdout.readline()
        assert line, f"lmcache oracle {self.vllm=} {self.seed=} exited ({self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.unavailable is not None:
            pytest.fail(
                f"the vLLM-regime parity oracle (PYTHONHASHSEED={self.seed}) runs lmcache with "
                f"the real vLLM in its own venv, which is not ready: {self.unavailable}",
                pytrace=False,
            )
        assert self.proc is not None and self.proc.stdin is not None
        if self.hello is None:
            self.hello = self._line()
            assert self.hello["lmcache"] == LMCACHE_VERSION, self.hello
            # the project's .venv stays vLLM-free; the vLLM venv has the pinned release
            assert self.hello["vllm"] == (VLLM_VERSION if self.vllm else None), self.hello
            assert self.hello["seed"] == self.seed, self.hello
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._line()
        assert "error" not in reply, reply
        return reply

    def close(self) -> None:
        """Stop the oracle now: it holds no state, and LMCache's threads slow a clean exit."""
        if self.proc is None:
            return
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
    assert theirs["none_hash"] == none_hash(cfg)
    assert [c.hash for c in ours] == theirs["hashes"]
    assert [[c.start, c.end] for c in ours] == theirs["spans"]


@pytest.mark.parametrize(("vllm", "seed"), REGIMES, ids=lambda v: str(v))
def test_lmcache_takes_none_hash_from_vllm_only_with_vllm(
    oracles: dict[tuple[bool, str], Oracle], vllm: bool, seed: str
) -> None:
    """What lmcache itself logs: with the real vLLM, vLLM's init_none_hash seeded the chain (and
    with sha256_cbor vLLM's hash function hashes); without vLLM, NONE_HASH is 0 and the builtin
    hash is used whatever the algorithm."""
    for algorithm in ("builtin", "sha256_cbor"):
        log = oracles[(vllm, seed)].ask(
            {"chunk_size": 4, "hash_algorithm": algorithm, "save_unfull_chunk": True, "tokens": []}
        )["log"]
        cfg = HashConfig(4, algorithm, seed, True, vllm)
        if vllm:
            assert f"Initialized NONE_HASH={none_hash(cfg)} from vLLM (>= PR#20511)" in log, log
        else:
            assert "Using default NONE_HASH=0 (vLLM not available)" in log, log
            assert none_hash(cfg) == 0
        from_vllm = f"Loaded '{algorithm}' from vllm.utils.hashing" in log
        fell_back = any(m.startswith(f"Could not load '{algorithm}' from vLLM") for m in log)
        assert (from_vllm, fell_back) == (
            (True, False) if cfg.effective_algorithm == "sha256_cbor" else (False, True)
        ), log


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
    assert len(seen) == 1 + len(VLLM_SEEDS) * 2
