"""The API models: camelCase on the wire, unknown fields rejected, sizes parsed, defaults set."""

from __future__ import annotations

import pytest
from op_builders import P2P, merge, p2p, pool
from pydantic import ValidationError

from kvpool.operator.api import ChartValues, P2PGroup


def test_camel_case_wire_names_and_defaults() -> None:
    group = p2p()
    assert group.spec.transfer.use_npu is True  # wire name useNPU
    assert group.spec.transfer.pull_pending_ttl_seconds == 60.0
    dumped = group.model_dump(by_alias=True, exclude_none=True)
    assert "tensorParallelSize" in dumped["spec"]
    assert "useNPU" in dumped["spec"]["transfer"]
    assert dumped["spec"]["ports"]["base"] == 20000


def test_quantities_become_bytes() -> None:
    assert pool().spec.tiers.cpu.size == 16 * 2**30
    assert p2p().spec.transfer.host_staging.bytes == 8 * 2**30


def test_unknown_field_is_rejected_with_its_path() -> None:
    bad = merge(P2P, {"spec": {"transfer": {"delayPul": True}}})
    with pytest.raises(ValidationError) as info:
        P2PGroup.model_validate(bad)
    assert info.value.errors()[0]["loc"] == ("spec", "transfer", "delayPul")
    assert info.value.errors()[0]["type"] == "extra_forbidden"


def test_bad_quantity_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        pool(tiers={"cpu": {"size": "16 gigs"}})
    err = info.value.errors()[0]
    assert err["loc"] == ("spec", "tiers", "cpu", "size")
    assert "not a Kubernetes quantity" in err["msg"]


def test_hash_seed_must_be_auto_or_digits() -> None:
    with pytest.raises(ValidationError, match="hashSeed"):
        pool(hashSeed="random")


def test_chart_values_defaults() -> None:
    values = ChartValues()
    assert values.webhook.enabled is True
    assert values.image.repository == "ghcr.io/kvpool/operator"
