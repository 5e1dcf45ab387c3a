"""Loading the LMCache configuration and the KV dtype for ``LMCacheOffload``, with errors that
name the field and the fix.

Why this module exists: the config arrives as the operator-rendered YAML file
(``LMCACHE_CONFIG_FILE``) or as a dict (tests, the benchmark); a bad one must fail at startup
with a sentence a person can act on, never a stack trace from deep inside LMCache.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.config import LMCacheEngineConfig

from kvpool.protocol.domain import REFERENCE_ENGINE_KV_DTYPES

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in REFERENCE_ENGINE_KV_DTYPES
}


class OffloadConfigError(ValueError):
    """The LMCache configuration or the KV shape cannot be used; the message names the fix."""


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> LMCacheEngineConfig:
    """An LMCache engine config from a YAML file path or a dict, with a clear error."""
    try:
        if isinstance(source, Mapping):
            cfg = LMCacheEngineConfig.from_dict(dict(source))
        else:
            path = Path(source)
            if not path.is_file():
                raise OffloadConfigError(
                    f"LMCache config file {str(path)!r} does not exist: set LMCACHE_CONFIG_FILE "
                    "to the rendered config"
                )
            cfg = LMCacheEngineConfig.from_file(str(path))
        # Neither loader runs LMCache's own validate(), which also forces save_unfull_chunk
        # for PD: without it a decoder never looks up a prompt's partial last chunk.
        cfg.validate()
        return cfg
    except OffloadConfigError:
        raise
    except Exception as e:  # LMCache raises ValueError/KeyError/yaml errors
        raise OffloadConfigError(f"invalid LMCache config ({source!r}): {e}") from e


def kv_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise OffloadConfigError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}") from None


def refuse_unsupported(cfg: LMCacheEngineConfig, dims: tuple[int, int, int, int]) -> None:
    """An ``OffloadConfigError`` naming the fix for what the CPU reference engine cannot run."""
    if min(dims) <= 0:
        raise OffloadConfigError("num_layers, num_kv_heads, head_dim, block_size must be > 0")
    if cfg.use_layerwise or cfg.enable_blending:
        raise OffloadConfigError(
            "use_layerwise and enable_blending are not supported by the CPU reference "
            "engine: set them to false"
        )
    if cfg.enable_p2p and not cfg.enable_async_loading:
        raise OffloadConfigError(
            "enable_p2p needs enable_async_loading: true (LMCache's P2P backend answers "
            "lookups only asynchronously; a synchronous lookup never sees a peer)"
        )
