"""The one table of LMCache storage backends: each backend's tier, rank and routing weight.

Why this module exists: a worker reports where a chunk lives by LMCache's backend name
(``str(backend)``: ``LocalCPUBackend``, ``LocalDiskBackend``, ...). The controller's index
ranks those names to pick "the" location of a hit, the gateway weighs them to score a cached
prefix, the worker maps them to kvpool's tier names for its memory API and metrics, and the
simulated engine reports them like a real worker. Three tables used to disagree (PDBackend was
"device" to the gateway and second to the index; ``P2PBackend`` fell to "remote"). Now there is
one, here; everything else derives from it.

Tier classes and their default routing weights (the value of one cached token by the tier
holding it; ``spec.gateway.routing`` scales the whole term):

======== ====== ==========================================================================
class    weight what it costs to use
======== ====== ==========================================================================
device   1.0    nothing: already in accelerator memory
ddr      0.8    a host-to-device copy (LMCache's local CPU tier, PD receive buffers)
p2p      0.6    a pull from a peer over NIXL/HCCL, then the copy
disk     0.5    a local SSD read, then the copy
remote   0.3    a network store (Redis, Mooncake), then the copy
======== ====== ==========================================================================

Rank (the order "fastest first") is by weight, then by table order; names not in the table
rank after every known one, by name, and weigh as ``remote``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BACKENDS",
    "DEFAULT_TIER_WEIGHTS",
    "LOCAL_CPU",
    "LOCAL_DISK",
    "Backend",
    "TierClass",
    "backend",
    "tier_class",
    "tier_rank",
]

TierClass = Literal["device", "ddr", "p2p", "disk", "remote"]

#: Default routing weight of one cached token per tier class (see the module docstring).
DEFAULT_TIER_WEIGHTS: dict[str, float] = {
    "device": 1.0,
    "ddr": 0.8,
    "p2p": 0.6,
    "disk": 0.5,
    "remote": 0.3,
}

#: kvpool's names of the local tiers (the worker's memory API, metrics and ``/memory/stats``).
LOCAL_CPU = "local_cpu"
LOCAL_DISK = "local_disk"


@dataclass(frozen=True)
class Backend:
    """One LMCache storage backend as a worker reports it.

    ``name``: LMCache's ``str(backend)``; ``tier``: its class; ``local_name``: kvpool's name for
    it when it is a local tier of the worker (None for remote stores, P2P and PD buffers).
    """

    name: str
    tier: TierClass
    local_name: str | None = None

    @property
    def weight(self) -> float:
        return DEFAULT_TIER_WEIGHTS[self.tier]


#: Every backend LMCache 0.5.6 (and LMCache-Ascend) names, in table order.
BACKENDS: tuple[Backend, ...] = (
    Backend("LocalCPUBackend", "ddr", LOCAL_CPU),
    Backend("PDBackend", "ddr"),  # a PD receiver's buffer (host memory on CPU and CUDA)
    Backend("MaruBackend", "ddr"),  # shared host memory pool
    Backend("DaxBackend", "ddr"),
    Backend("P2PBackend", "p2p"),
    Backend("LocalDiskBackend", "disk", LOCAL_DISK),
    Backend("GdsBackend", "disk"),
    Backend("NixlStorageBackend", "disk"),
    Backend("RustRawBlockBackend", "disk"),
    Backend("RemoteBackend", "remote"),
)
_BY_NAME = {b.name: b for b in BACKENDS}
_RANK = {
    b.name: rank
    for rank, b in enumerate(
        sorted(BACKENDS, key=lambda b: (-b.weight, BACKENDS.index(b)))  # stable by table order
    )
}


def backend(name: str) -> Backend | None:
    """The table row of an LMCache backend name, or None for a name LMCache does not use."""
    return _BY_NAME.get(name)


def tier_class(location: str) -> TierClass:
    """The tier class of a location; names not in the table are ``remote``."""
    row = _BY_NAME.get(location)
    return row.tier if row is not None else "remote"


def tier_rank(location: str) -> tuple[int, str]:
    """Sort key of a location, fastest first: known backends by rank, then unknown by name."""
    return (_RANK.get(location, len(_RANK)), location)
