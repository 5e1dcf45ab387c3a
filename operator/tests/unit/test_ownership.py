"""Keys and flags kvpool owns are derived from what it renders, and refused as overrides.

Every example is rendered; each top-level key of every rendered LMCache config must be refused
in ``lmcacheOverrides`` (so ``lmcache_worker_heartbeat_time: 999`` can no longer replace the
pool's heartbeat while the controller purges after 60 s), and each flag on every rendered worker
command must be refused in ``engine.args``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from op_builders import EXAMPLES, merge, p2p, pool

from kvpool.operator.api import P2PGroup, PDPair
from kvpool.operator.derive.instances import engines
from kvpool.operator.derive.ownership import owned_engine_flags, owned_lmcache_keys
from kvpool.operator.loader import load_text
from kvpool.operator.render import lmcache_configs, render_domain
from kvpool.operator.validation import errors, validate_domain

FILES = sorted(EXAMPLES.glob("*.yaml"))


def _domains(path: Path) -> list[Any]:
    loaded = load_text(path.read_text(), path.name)
    domains = loaded.domains()
    assert not loaded.errors
    return domains


def _with_engine(member: P2PGroup | PDPair, **engine: Any) -> P2PGroup | PDPair:
    doc = member.model_dump(by_alias=True, exclude_none=True)
    if isinstance(member, P2PGroup):
        doc = merge(doc, {"spec": {"engine": engine}})
        return P2PGroup.model_validate(doc)
    doc = merge(doc, {"spec": {"prefill": {"engine": engine}}})
    return PDPair.model_validate(doc)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_rendered_lmcache_key_is_refused_as_an_override(path: Path) -> None:
    for domain in _domains(path):
        for member in domain.members:
            emitted = {k for cfg in lmcache_configs(domain.pool, member).values() for k in cfg}
            assert emitted <= owned_lmcache_keys()
            for key in sorted(emitted):
                bad = _with_engine(member, lmcacheOverrides={key: 999})
                others = [m for m in domain.members if m is not member]
                refused = [
                    p
                    for p in errors(validate_domain(domain.pool, [bad, *others]))
                    if p.path.endswith(f"lmcacheOverrides.{key}")
                ]
                assert refused, f"{path.name}: override of {key} was accepted"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_rendered_worker_flag_is_refused_in_engine_args(path: Path) -> None:
    for domain in _domains(path):
        objects = render_domain(domain.pool, domain.members)
        flags: set[str] = set()
        for obj in objects:
            if obj["kind"] != "StatefulSet":
                continue
            command = obj["spec"]["template"]["spec"]["containers"][0]["command"]
            head = command[: command.index("--")] if "--" in command else command
            flags |= {a for a in head if a.startswith("--")}
        sim = any(e.sim is not None for m in domain.members for _, e, _ in engines(m))
        assert flags and flags <= owned_engine_flags(sim=sim)
        member = domain.members[0]
        for flag in sorted(flags):
            bad = _with_engine(member, args=[f"{flag}=1"])
            refused = [p for p in errors(validate_domain(domain.pool, [bad])) if flag in p.message]
            assert refused, f"{path.name}: {flag} in engine.args was accepted"


def test_heartbeat_override_is_refused_and_never_rendered() -> None:
    group = p2p(engine={"lmcacheOverrides": {"lmcache_worker_heartbeat_time": 999}})
    (problem,) = [p for p in validate_domain(pool(), [group]) if p.code == "override"]
    assert problem.path == (
        "P2PGroup/grp: spec.engine.lmcacheOverrides.lmcache_worker_heartbeat_time"
    )
    assert "derived by kvpool" in problem.message
    cfg = lmcache_configs(pool(), group)["grp-0"]
    assert cfg["lmcache_worker_heartbeat_time"] == 10


def test_an_unowned_upstream_key_is_applied() -> None:
    group = p2p(engine={"lmcacheOverrides": {"min_retrieve_tokens": 64}})
    assert not [p for p in validate_domain(pool(), [group]) if p.code == "override"]
    assert lmcache_configs(pool(), group)["grp-0"]["min_retrieve_tokens"] == 64


def test_owned_keys_cover_every_branch_of_the_builders() -> None:
    """Keys only some configurations emit are owned too (a disk tier, Mooncake, PD pull)."""
    owned = owned_lmcache_keys()
    for key in (
        "local_disk",
        "remote_url",
        "remote_serde",
        "pd_pull_done_port",
        "pd_cpu_buffer_size",
        "p2p_npu_buffer_size",
        "lmcache_worker_heartbeat_time",
        "extra_config",
        "nixl_backends",
    ):
        assert key in owned, key
    assert {"--lmcache-rpc-port", "--kv-transfer-config", "--dtype"} <= owned_engine_flags()
