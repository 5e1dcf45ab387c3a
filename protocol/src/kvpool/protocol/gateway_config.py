"""Which keys of the gateway's ``gateway.yaml`` a running gateway applies without a restart.

Why this module exists: the gateway re-reads its mounted ``gateway.yaml`` when the kubelet
updates it (and takes the same document on its admin endpoint) and applies what routes
requests — the policy and its weights, the guards, the instance lists of the P2P groups and
the PD pairs — to the running process. Everything else (the model and hashing regime, the
tokenizer, the controller's addresses, the limits that size its queues and pools) is what the
process is built around: a change to it needs a new process. The operator puts a hash of
exactly that rest on the gateway's pod template, so those changes roll the pod and the live
ones do not. Both sides read the one list below; a key that is not on it needs a restart (the
safe default for a key added later).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["LIVE_KEYS", "restart_part"]

#: Top-level keys of ``gateway.yaml`` (as written, camelCase) a running gateway applies live.
LIVE_KEYS: Final = frozenset({"routing", "guards", "p2pGroups", "pdPairs"})


def restart_part(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a ``gateway.yaml`` mapping that only a restart applies (``LIVE_KEYS`` left
    out), in the mapping's order."""
    return {key: value for key, value in config.items() if key not in LIVE_KEYS}
