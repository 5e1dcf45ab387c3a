"""Token ids → LMCache chunk hashes, bit-identical to lmcache 0.5.6's ``ChunkedTokenDatabase``.

Why this module exists: the controller's index is keyed by the chunk hashes LMCache workers
report; the gateway (routing), the controller (``/lookup`` by tokens) and ``kvpool-gateway
hashes`` (diagnosis) must compute exactly the same integers from a prompt's token ids, or every
lookup silently misses. What LMCache computes depends on the *regime* a worker runs in:

- ``chunk_size`` tokens per chunk; with ``save_unfull_chunk`` the trailing partial chunk gets a
  hash too (LMCache's config default is ``False``; a ``ChunkedTokenDatabase()`` built without a
  config, as LMCache's own controller does, and PD senders use ``True``).
- Each chunk hash is ``H((prefix, tuple(chunk), ()))`` chained from ``NONE_HASH``, where ``H``
  and ``NONE_HASH`` depend on whether vLLM is importable in the engine process:

  ========  ==============  ==================================  ==============================
  vLLM      algorithm       H                                   NONE_HASH
  ========  ==============  ==================================  ==============================
  absent    any             Python's builtin ``hash``           ``0``
  present   ``builtin``     Python's builtin ``hash``           ``hash(PYTHONHASHSEED string)``
  present   ``sha256_cbor`` first 8 bytes (big-endian) of       same ``H`` of the
                            sha256 of canonical CBOR            ``PYTHONHASHSEED`` string
  ========  ==============  ==================================  ==============================

  Without vLLM, LMCache cannot load vLLM's hash functions and falls back to the builtin hash for
  *every* algorithm: a CPU domain configured ``sha256_cbor`` hashes like ``builtin``. With vLLM,
  vLLM's ``init_none_hash`` seeds the chain from the ``PYTHONHASHSEED`` string (vLLM 0.10.2+:
  ``vllm.utils.hashing``; ``builtin`` is not one of vLLM's names, so LMCache falls back to
  Python's ``hash`` but still lets vLLM derive ``NONE_HASH`` with it).

Python's builtin hash of a tuple of ints does not depend on ``PYTHONHASHSEED`` (int hashes are
unkeyed and the tuple combiner has no secret), so it is computed here with the local ``hash``.
The hash of a *string* is keyed by the seed: :func:`python_str_hash` reproduces CPython's
SipHash-1-3 under a given seed (CPython ≥ 3.11, 64-bit little-endian, as every engine image
is), so the vLLM-seeded ``NONE_HASH`` does not depend on the seed of the process computing it.
The canonical CBOR encoder covers exactly what is hashed (ints, tuples, strings, bytes) with
cbor2's canonical output (what vLLM uses).

Pure: no I/O, no environment reads — the caller says which regime applies.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

from kvpool.protocol.domain import MAX_HASH_SEED, is_valid_hash_seed

#: The hash algorithms the operator can render as ``pre_caching_hash_algorithm``.
HashAlgorithm = Literal["builtin", "sha256_cbor"]
HASH_ALGORITHMS: Final[tuple[str, ...]] = get_args(HashAlgorithm)
#: LMCache's defaults when the config omits a key.
DEFAULT_CHUNK_SIZE: Final = 256
DEFAULT_HASH_ALGORITHM: Final = "builtin"
#: ``NONE_HASH`` when vLLM is absent (lmcache.v1.token_database.NONE_HASH).
LMCACHE_NONE_HASH: Final = 0

_MASK64 = (1 << 64) - 1


class HashConfigError(ValueError):
    """A hashing regime that LMCache cannot run, or that nobody can reproduce."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field  # the HashConfig field to fix
        self.reason = reason  # what is wrong with it (callers name the field their own way)


@dataclass(frozen=True)
class HashConfig:
    """Which of LMCache's hashing regimes a domain's workers run in.

    ``hash_seed`` is the domain's ``PYTHONHASHSEED`` (a decimal string, as in the environment);
    it only matters when ``vllm`` is true. ``vllm``: whether vLLM is importable in the engine
    processes (vLLM and vLLM-Ascend workers: true; kvpool's reference engine: false).
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    hash_seed: str | None = None
    save_unfull_chunk: bool = False
    vllm: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise HashConfigError("chunk_size", f"must be an integer, got {self.chunk_size!r}")
        if self.chunk_size <= 0:
            raise HashConfigError("chunk_size", f"must be positive, got {self.chunk_size}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise HashConfigError(
                "hash_algorithm",
                f"{self.hash_algorithm!r} is not one of {', '.join(HASH_ALGORITHMS)}",
            )
        if self.hash_seed is not None and not is_valid_hash_seed(self.hash_seed):
            raise HashConfigError(
                "hash_seed",
                f"{self.hash_seed!r} is not a PYTHONHASHSEED (an integer in 0..{MAX_HASH_SEED})",
            )
        if self.vllm and self.hash_seed is None:
            raise HashConfigError(
                "hash_seed",
                "is required with vLLM: without PYTHONHASHSEED vLLM seeds NONE_HASH from "
                "os.urandom, so no two processes (and nobody else) can reproduce the hashes; "
                "set the domain's seed",
            )

    @property
    def effective_algorithm(self) -> str:
        """The algorithm LMCache really uses (``builtin`` whenever vLLM is absent)."""
        return self.hash_algorithm if self.vllm else "builtin"


@dataclass(frozen=True)
class ChunkHash:
    """One chunk: tokens ``[start, end)`` and its chained hash (LMCache's ``process_tokens``)."""

    start: int
    end: int
    hash: int


def none_hash(config: HashConfig) -> int:
    """The ``NONE_HASH`` the chain starts from in ``config``'s regime."""
    if not config.vllm:
        return LMCACHE_NONE_HASH
    assert config.hash_seed is not None  # enforced by HashConfig
    if config.hash_algorithm == "sha256_cbor":
        return sha256_cbor_64(config.hash_seed)
    return python_str_hash(config.hash_seed, int(config.hash_seed))


def iter_chunk_hashes(tokens: Sequence[int], config: HashConfig) -> Iterator[ChunkHash]:
    """Every chunk of ``tokens`` with its hash, as ``process_tokens(make_key=False)`` yields."""
    size = config.chunk_size
    total = len(tokens)
    end = total if config.save_unfull_chunk else total - total % size
    cbor = config.effective_algorithm == "sha256_cbor"
    prefix = none_hash(config)
    for start in range(0, end, size):
        # The builtin hash of a tuple only sees its items' hashes, and an integer-valued
        # item (int, bool, numpy integer) hashes as its int: the slice is hashed as it is
        # (no Python step per token); CBOR encodes by type, so it gets ints.
        part = tokens[start : start + size]
        chunk = tuple(map(int, part)) if cbor else tuple(part)
        key = (prefix, chunk, ())
        prefix = sha256_cbor_64(key) if cbor else hash(key)
        yield ChunkHash(start, min(start + size, total), prefix)


def chunk_hashes(tokens: Sequence[int], config: HashConfig) -> list[int]:
    """The chained chunk hashes of ``tokens`` in ``config``'s regime."""
    return [c.hash for c in iter_chunk_hashes(tokens, config)]


# ---------------------------------------------------------------- vLLM's sha256_cbor


def sha256_cbor_64(value: object) -> int:
    """vLLM's ``sha256_cbor`` folded to an int the way LMCache folds it (first 8 bytes, BE)."""
    digest = hashlib.sha256(canonical_cbor(value)).digest()
    return int.from_bytes(digest[:8], "big")


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise AssertionError("unreachable: callers pass n < 2**64")


def canonical_cbor(value: object) -> bytes:
    """RFC 8949 canonical CBOR of ints, strings, bytes, tuples and lists (cbor2's output).

    Integers beyond 64 bits become bignums (tags 2 and 3) with minimal big-endian bytes.
    """
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        major, n = (0, value) if value >= 0 else (1, -1 - value)
        if n <= _MASK64:
            return _cbor_head(major, n)
        raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
        return _cbor_head(6, 2 + major) + _cbor_head(2, len(raw)) + raw
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, tuple | list):
        return _cbor_head(4, len(value)) + b"".join(canonical_cbor(v) for v in value)
    raise TypeError(f"canonical_cbor: {type(value).__name__} is not part of a chunk hash")


# ---------------------------------------------------------------- CPython's str hash


def _hash_secret(seed: int) -> tuple[int, int]:
    """SipHash keys of CPython's ``_Py_HashSecret`` for ``PYTHONHASHSEED=seed``.

    Seed 0 disables randomization (all-zero secret); any other seed fills the secret with
    CPython's ``lcg_urandom`` (x = x * 214013 + 2531011 mod 2**32, byte = x >> 16 & 0xff).
    """
    if seed == 0:
        return 0, 0
    x = seed
    out = bytearray()
    for _ in range(16):
        x = (x * 214013 + 2531011) & 0xFFFFFFFF
        out.append((x >> 16) & 0xFF)
    return int.from_bytes(out[:8], "little"), int.from_bytes(out[8:16], "little")


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK64


def _sip_round(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    v0 = (v0 + v1) & _MASK64
    v2 = (v2 + v3) & _MASK64
    v1 = _rotl(v1, 13) ^ v0
    v3 = _rotl(v3, 16) ^ v2
    v0 = _rotl(v0, 32)
    v2 = (v2 + v1) & _MASK64
    v0 = (v0 + v3) & _MASK64
    v1 = _rotl(v1, 17) ^ v2
    v3 = _rotl(v3, 21) ^ v0
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def _siphash13(k0: int, k1: int, data: bytes) -> int:
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    whole = len(data) - len(data) % 8
    for i in range(0, whole, 8):
        m = int.from_bytes(data[i : i + 8], "little")
        v3 ^= m
        v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
        v0 ^= m
    b = (len(data) & 0xFF) << 56 | int.from_bytes(data[whole:], "little")
    v3 ^= b
    v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
    v0 ^= b
    v2 ^= 0xFF
    for _ in range(3):
        v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
    return (v0 ^ v1) ^ (v2 ^ v3)


def python_str_hash(text: str, seed: int) -> int:
    """``hash(text)`` in a CPython ≥ 3.11 process started with ``PYTHONHASHSEED=seed``."""
    if not 0 <= seed <= MAX_HASH_SEED:
        raise ValueError(f"seed must be in 0..{MAX_HASH_SEED}, got {seed}")
    if not text:
        return 0
    width = max((1, 2, 4)[(ord(c) > 0xFF) + (ord(c) > 0xFFFF)] for c in text)
    data = text.encode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[width])
    x = _siphash13(*_hash_secret(seed), data)
    if x >= 1 << 63:
        x -= 1 << 64
    return -2 if x == -1 else x
