"""The kind table and the raw-body accessors (``kvpool.operator.api.kinds``): every place that
names a kind by its plural takes it from the table, and the accessors read what kopf hands over
(plain dicts, fields possibly missing or null) the one way."""

from __future__ import annotations

import pytest

from kvpool.operator import gen
from kvpool.operator.api import kinds
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.runtime import kube, plan


def test_the_table_names_each_kind_once_and_the_crds_and_client_use_it() -> None:
    assert [k.kind for k in kinds.KINDS.values()] == ["KVCachePool", "P2PGroup", "PDPair"]
    assert [k.plural for k in kinds.MEMBERS] == ["p2pgroups", "pdpairs"]
    for kind, plural, short, _spec, _status in gen.KINDS:
        entry = kinds.KINDS[kind]
        assert (plural, tuple(short)) == (entry.plural, entry.short_names)
        names = gen.crd(kind, plural, short, _spec, _status)["spec"]["names"]
        assert names["singular"] == entry.singular == kind.lower()
        assert kube.KINDS[kind].plural == plural


@pytest.mark.parametrize(
    ("body", "ref"),
    [
        ({"spec": {"poolRef": {"name": "demo"}}}, "demo"),
        ({"spec": {"poolRef": {}}}, ""),
        ({"spec": {"poolRef": None}}, ""),
        ({"spec": None}, ""),
        ({}, ""),
        (None, ""),
    ],
)
def test_pool_ref_reads_a_member_s_pool_or_nothing(
    body: dict[str, object] | None, ref: str
) -> None:
    assert kinds.pool_ref(body) == ref


def test_domain_of_is_a_pool_s_own_name_and_a_member_s_pool_ref() -> None:
    pool = {"kind": "KVCachePool", "metadata": {"name": "demo"}, "spec": {}}
    member = {"kind": "PDPair", "metadata": {"name": "pd"}, "spec": {"poolRef": {"name": "demo"}}}
    assert kinds.domain_of(pool) == kinds.domain_of(member) == "demo"


def test_the_stored_seed_round_trips_through_a_status_and_the_parsed_pool() -> None:
    assert kinds.stored_seed({"status": kinds.seed_status("42")}) == "42"
    assert kinds.stored_seed({"status": {"resolvedHashSeed": 7}}) == "7"
    assert kinds.stored_seed({"status": None}) is None
    assert kinds.stored_seed({}) is None
    body = {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {"model": {"name": "m", "numLayers": 2, "numKvHeads": 2, "headDim": 64}},
        "status": kinds.seed_status("1234"),
    }
    parsed = plan.parse_body(body, kinds.stored_seed(body))
    assert isinstance(parsed, KVCachePool) and parsed.status is not None
    assert parsed.status.resolved_hash_seed == "1234"
