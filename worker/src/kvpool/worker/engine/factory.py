"""Build the reference engine's compute side from its options: model, paged caches, offload.

Why this module exists: ``ReferenceEngine.start`` runs this on its compute thread (loading
weights and LMCache blocks for seconds); keeping construction apart from the request
lifecycle keeps both readable. When the caller passes no offload but the options name an
LMCache config file, the real LMCache offload is built here for the model's KV shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvpool.worker.engine.model import ModelShape, PagedModel, load_hf_model
from kvpool.worker.engine.runner import ModelRunner
from kvpool.worker.engine_api import EngineError, ReferenceEngineOptions
from kvpool.worker.offload_api import KVOffload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Built:
    model: PagedModel
    runner: ModelRunner
    eos_ids: frozenset[int]


def build(
    options: ReferenceEngineOptions,
    offload: KVOffload | None,
    model_overrides: dict[str, Any],
    num_threads: int | None = None,
) -> Built:
    hf_model, config = load_hf_model(options, **model_overrides)
    model = PagedModel(hf_model, config)
    eos_ids = {options.eos_token_id}
    if options.model_dir is not None:  # a real model also stops on its own EOS ids
        eos = getattr(config, "eos_token_id", None)
        eos_ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    caches = model.allocate_kv_caches(options.num_kv_blocks, options.block_size)
    if offload is None and options.lmcache_config_file is not None:
        offload = build_lmcache(options, model.shape)
    runner = ModelRunner(model, caches, options.block_size, offload, num_threads)
    return Built(model=model, runner=runner, eos_ids=frozenset(eos_ids))


def build_lmcache(options: ReferenceEngineOptions, shape: ModelShape) -> KVOffload:
    """The real LMCache offload from ``options.lmcache_config_file`` (imported lazily: an
    engine without LMCache never loads it)."""
    from kvpool.worker.engine.offload import (  # noqa: PLC0415 (lazy: heavy import)
        LMCacheOffload,
        OffloadConfigError,
    )

    try:
        offload = LMCacheOffload(
            options.lmcache_config_file or "",
            instance_id=options.lmcache_instance_id,
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=options.block_size,
            dtype=shape.dtype,
            model_name=options.model_name,
        )
    except OffloadConfigError as exc:
        raise EngineError(f"lmcache_config_file {options.lmcache_config_file!r}: {exc}") from exc
    logger.info("reference engine %s offloads KV through LMCache", options.model_name)
    return offload
