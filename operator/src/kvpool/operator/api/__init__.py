"""The kvpool.io/v1alpha1 API: pydantic models, the single source of truth for CRDs and schema.

Re-exported here so callers write ``from kvpool.operator import api`` then ``api.KVCachePool``.
"""

from kvpool.operator.api.chart import ChartValues
from kvpool.operator.api.common import (
    API_VERSION,
    GROUP,
    VERSION,
    Condition,
    InstanceStatus,
    MemoryBudget,
    ObjectMeta,
)
from kvpool.operator.api.members import (
    EngineSpec,
    Member,
    MemberStatus,
    P2PGroup,
    P2PGroupSpec,
    PDPair,
    PDPairSpec,
    SimEngineSpec,
)
from kvpool.operator.api.pool import DTYPE_BYTES, KVCachePool, KVCachePoolSpec, KVCachePoolStatus

P2PGroupStatus = MemberStatus
PDPairStatus = MemberStatus

__all__ = [
    "API_VERSION",
    "DTYPE_BYTES",
    "GROUP",
    "VERSION",
    "ChartValues",
    "Condition",
    "EngineSpec",
    "InstanceStatus",
    "KVCachePool",
    "KVCachePoolSpec",
    "KVCachePoolStatus",
    "Member",
    "MemberStatus",
    "MemoryBudget",
    "ObjectMeta",
    "P2PGroup",
    "P2PGroupSpec",
    "P2PGroupStatus",
    "PDPair",
    "PDPairSpec",
    "PDPairStatus",
    "SimEngineSpec",
]
