"""The rendered LMCache configs of every example satisfy the domain contract by construction:
per-rank lists of TP entries, unique instance ids, one fingerprint, PD/P2P never mixed,
p2p_pull_pending_ttl only under extra_config, Ascend keys only on ascend."""

from __future__ import annotations

from pathlib import Path

import pytest
from op_builders import EXAMPLES, pd, pool
from pydantic import ValidationError

from kvpool.operator.api import P2PGroup
from kvpool.operator.derive.lmcache_config import ASCEND_ONLY_KEYS
from kvpool.operator.loader import load_text
from kvpool.operator.render import lmcache_configs
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.protocol.pd import DEFAULT_UNCLAIMED_TTL_SECONDS, UNCLAIMED_TTL_KEY

PER_RANK = (
    "lmcache_worker_ports",
    "p2p_init_ports",
    "p2p_lookup_ports",
    "pd_peer_init_port",
    "pd_peer_alloc_port",
    "pd_pull_done_port",
)
FILES = sorted(EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_rendered_configs_keep_the_contract(path: Path) -> None:
    loaded = load_text(path.read_text(), path.name)
    for domain in loaded.domains():
        fingerprint = pool_fingerprint(domain.pool)
        ids: list[str] = []
        for member in domain.members:
            for instance, cfg in lmcache_configs(domain.pool, member).items():
                if isinstance(member, P2PGroup):
                    tp, platform = member.spec.tensor_parallel_size, member.spec.engine.platform
                else:
                    role = member.spec.prefill if "-prefill-" in instance else member.spec.decode
                    tp, platform = role.tensor_parallel_size, role.engine.platform
                for key in PER_RANK:
                    if key in cfg:
                        assert len(cfg[key]) == tp, (instance, key)
                ids.append(cfg["lmcache_instance_id"])
                assert cfg["lmcache_instance_id"] == f"{instance}~{fingerprint}"
                assert not (cfg.get("enable_p2p") and cfg.get("enable_pd"))
                assert cfg.get("use_layerwise") is False
                assert "p2p_pull_pending_ttl" not in cfg
                assert cfg["chunk_size"] == domain.pool.spec.chunk_size
                if platform != "ascend":
                    assert not set(cfg) & ASCEND_ONLY_KEYS
                if cfg.get("pd_role") == "sender":
                    assert cfg["save_unfull_chunk"] is True
                if cfg.get("p2p_delay_pull"):
                    assert cfg["p2p_pull_mode"] and cfg["p2p_use_npu"]
                if cfg.get("extra_config", {}).get("use_host_staging"):
                    assert cfg["transfer_channel"] == "hccl" and cfg["p2p_pull_mode"]
        assert len(ids) == len(set(ids))


def test_a_cpu_decoder_gets_the_unclaimed_transfer_ttl_the_reference_worker_reads() -> None:
    cpu = {"tensorParallelSize": 1, "engine": {"platform": "cpu"}}
    sides = {"prefill": cpu, "decode": cpu}
    configs = lmcache_configs(pool(), pd(**sides, transfer={"mode": "push"}))
    assert configs["pair-decode-0"]["extra_config"] == {
        UNCLAIMED_TTL_KEY: DEFAULT_UNCLAIMED_TTL_SECONDS
    }
    assert "extra_config" not in configs["pair-prefill-0"]  # a sender holds no transfers
    tuned = pd(**sides, transfer={"mode": "push", "unclaimedTTLSeconds": 12})
    assert lmcache_configs(pool(), tuned)["pair-decode-0"]["extra_config"][UNCLAIMED_TTL_KEY] == 12
    # vLLM's LMCache connector has no such TTL: nothing is rendered that it would not honour
    cuda = {"tensorParallelSize": 1, "engine": {"platform": "cuda"}}
    vllm = lmcache_configs(pool(), pd(prefill=cuda, decode=cuda, transfer={"mode": "push"}))
    assert UNCLAIMED_TTL_KEY not in vllm["pair-decode-0"].get("extra_config", {})
    with pytest.raises(ValidationError, match="unclaimedTTLSeconds"):
        pd(**sides, transfer={"mode": "push", "unclaimedTTLSeconds": 1})
