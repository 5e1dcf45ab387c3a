"""vllm.utils.hashing stand-in: the hash functions vLLM resolves by name."""

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import cbor2


def sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def get_hash_fn_by_name(name: str) -> Callable[[Any], bytes]:
    if name == "sha256":
        return sha256
    if name == "sha256_cbor":
        return sha256_cbor
    raise ValueError(f"Unsupported hash function: {name}")
