"""Every LMCache config kvpool renders for cuda/cpu is accepted by lmcache 0.5.6's own loader.

Why: LMCache only *logs* an unknown key ("Unknown configuration key: ...") and carries on, so
a misspelt or wrong-version key would silently do nothing. This test renders every cuda/cpu
example, writes each instance's YAML to a file, loads it with
``LMCacheEngineConfig.from_file`` (the path LMCACHE_CONFIG_FILE takes), fails on any unknown
key it logs, runs LMCache's own ``validate()``, and compares every value read back. Ascend
configs carry LMCache-Ascend keys that stock LMCache does not know; they are checked against
kvpool's explicit Ascend key list instead. No mocks: the real lmcache package.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from lmcache.v1.config import _CONFIG_DEFINITIONS, LMCacheEngineConfig

from kvpool.operator.derive.lmcache_config import ASCEND_ONLY_KEYS, UPSTREAM_KEYS
from kvpool.operator.loader import load_text
from kvpool.operator.render import lmcache_configs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _rendered(platforms: set[str]) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        loaded = load_text(path.read_text(), path.name)
        assert not loaded.errors, loaded.errors
        for domain in loaded.domains():
            for member in domain.members:
                engine = (
                    member.spec.engine if member.kind == "P2PGroup" else member.spec.prefill.engine  # type: ignore[union-attr]
                )
                if engine.platform not in platforms:
                    continue
                for instance, cfg in lmcache_configs(domain.pool, member).items():
                    out.append((path.name, instance, cfg))
    return out


UPSTREAM = _rendered({"cuda", "cpu"})
ASCEND = _rendered({"ascend"})


def test_examples_cover_cpu_cuda_and_ascend() -> None:
    assert len(UPSTREAM) >= 6
    assert len(ASCEND) >= 10


def test_kvpool_upstream_key_list_matches_installed_lmcache() -> None:
    missing = sorted(UPSTREAM_KEYS - set(_CONFIG_DEFINITIONS))
    assert missing == [], f"keys kvpool thinks LMCache 0.5.6 has, but it does not: {missing}"
    clash = sorted(ASCEND_ONLY_KEYS & set(_CONFIG_DEFINITIONS))
    assert clash == [], f"'Ascend-only' keys that upstream LMCache defines: {clash}"


@pytest.mark.parametrize(("example", "instance", "cfg"), UPSTREAM, ids=[i for _, i, _ in UPSTREAM])
def test_lmcache_loads_rendered_config_without_unknown_keys(
    example: str,
    instance: str,
    cfg: dict[str, Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    caplog.set_level(logging.WARNING)
    # lmcache's logger does not propagate to the root logger; attach caplog's handler to it.
    lm_logger = logging.getLogger("lmcache")
    lm_logger.addHandler(caplog.handler)
    try:
        config = LMCacheEngineConfig.from_file(str(path))
        config.validate()
    finally:
        lm_logger.removeHandler(caplog.handler)
    unknown = [r.getMessage() for r in caplog.records if "nknown config" in r.getMessage()]
    assert unknown == []
    assert set(cfg) <= set(_CONFIG_DEFINITIONS), sorted(set(cfg) - set(_CONFIG_DEFINITIONS))
    for key, value in cfg.items():
        assert getattr(config, key) == value, key
    assert config.lmcache_instance_id.startswith(f"{instance}~")


def test_an_unknown_key_is_caught_by_this_test_s_own_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The detector above must be able to fail: a misspelt key is logged and seen."""
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 256, "p2p_pull_pending_ttl": 60}))
    lm_logger = logging.getLogger("lmcache")
    lm_logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    try:
        LMCacheEngineConfig.from_file(str(path))
    finally:
        lm_logger.removeHandler(caplog.handler)
    assert any("p2p_pull_pending_ttl" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("example", "instance", "cfg"), ASCEND, ids=[i for _, i, _ in ASCEND])
def test_ascend_configs_use_only_upstream_or_listed_ascend_keys(
    example: str, instance: str, cfg: dict[str, Any]
) -> None:
    extra = set(cfg) - set(_CONFIG_DEFINITIONS)
    assert extra <= ASCEND_ONLY_KEYS, sorted(extra - ASCEND_ONLY_KEYS)
    assert "p2p_pull_pending_ttl" not in cfg  # rule 6: only under extra_config


def test_upstream_configs_carry_no_ascend_keys() -> None:
    for _, instance, cfg in UPSTREAM:
        assert not set(cfg) & ASCEND_ONLY_KEYS, instance
