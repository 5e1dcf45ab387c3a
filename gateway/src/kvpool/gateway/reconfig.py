"""What changed between two gateway configurations, and whether a running gateway can apply
it. Pure: no I/O, no clock.

Why this module exists: the gateway reconfigures itself without a restart (``live``) when its
mounted ``gateway.yaml`` changes or an admin posts a new one. Whether that is possible, and what
it means, is decided here from the two documents alone, so it is tested without sockets:

- a change to a key outside :data:`kvpool.protocol.gateway_config.LIVE_KEYS` (model, hashing
  regime, tokenizer, controller addresses, limits) needs a restart: the new document is not
  applied, and each such key is named with its old and new value;
- routing (policy, weights) or guards changed: a new router;
- instances added, removed, or *moved* (same name, another URL, role, group or P2P flag: a
  different instance under an old name), and PD pairs added, removed or changed.

An instance that keeps its facts keeps its state in the running gateway (readiness, breaker,
load, pending prefixes); the rest is in ``live``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.gateway.config import GatewayConfig
from kvpool.gateway.routing import Guards, PolicySettings, Router, make_policy
from kvpool.protocol.gateway_config import LIVE_KEYS, restart_part

__all__ = ["Change", "InstanceFacts", "diff", "instance_facts", "router_for"]

#: Longest value shown in a change line (``key: old -> new``).
SHOWN_CHARS = 60


@dataclass(frozen=True, slots=True)
class InstanceFacts:
    """What the configuration says of one instance; equal facts mean the same instance."""

    name: str
    url: str
    role: str  # "peer", "prefill" or "decode"
    group: str  # the P2P group or the PD pair
    pulls: bool  # a P2P group member that pulls its peers' KV


def instance_facts(config: GatewayConfig) -> list[InstanceFacts]:
    """Every instance the configuration lists: P2P group members, then PD pairs' sides."""
    out: list[InstanceFacts] = []
    for group in config.p2p_groups:
        out += [
            InstanceFacts(i.name, i.url.rstrip("/"), "peer", group.name, group.p2p)
            for i in group.instances
        ]
    for pair in config.pd_pairs:
        out += [
            InstanceFacts(i.name, i.url.rstrip("/"), "prefill", pair.name, False)
            for i in pair.prefill
        ]
        out += [
            InstanceFacts(i.name, i.url.rstrip("/"), "decode", pair.name, False)
            for i in pair.decode
        ]
    return out


def router_for(config: GatewayConfig) -> Router:
    """The router ``routing`` and ``guards`` describe."""
    guards = Guards(config.guards.imbalance_abs, config.guards.imbalance_ratio)
    weights = config.routing.weights
    settings = PolicySettings(weights.prefix_hit, weights.load, guards)
    return Router(make_policy(config.routing.policy, settings), guards)


@dataclass(frozen=True)
class Change:
    """The difference between the configuration in force and a new one."""

    restart: tuple[str, ...] = ()  # "key: old -> new" of each key only a restart applies
    live: tuple[str, ...] = ()  # "key: old -> new" of each live key that changed
    routing: bool = False  # routing or guards changed: a new router
    added: tuple[str, ...] = ()  # instance names
    removed: tuple[str, ...] = ()
    moved: tuple[str, ...] = ()  # same name, other facts: the old one goes, a new one comes
    pd_added: tuple[str, ...] = ()
    pd_removed: tuple[str, ...] = ()
    pd_changed: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.restart or self.live)

    @property
    def needs_restart(self) -> bool:
        return bool(self.restart)

    def summary(self) -> list[str]:
        """One line per fact, for logs and the admin endpoint's answer."""
        lines = [f"needs a restart: {line}" for line in self.restart]
        lines += [line for line in self.live if not line.startswith(("p2pGroups", "pdPairs"))]
        for what, names in (
            ("instances added", self.added),
            ("instances removed", self.removed),
            ("instances replaced (same name, another URL, role or group)", self.moved),
            ("PD pairs added", self.pd_added),
            ("PD pairs removed", self.pd_removed),
            ("PD pairs changed", self.pd_changed),
        ):
            if names:
                lines.append(f"{what}: {', '.join(names)}")
        return lines


def _dump(config: GatewayConfig) -> dict[str, Any]:
    """The document as written (camelCase), defaults included: an omitted key and its default
    written out are the same configuration."""
    return config.model_dump(mode="json", by_alias=True)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def changed_paths(old: Any, new: Any, path: str = "") -> Iterator[str]:
    """``path: old -> new`` for each difference, descending into mappings (lists are compared
    whole)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in [*old, *(k for k in new if k not in old)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in new:
                yield f"{where}: {_shown(old[key])} -> (absent)"
            elif key not in old:
                yield f"{where}: (absent) -> {_shown(new[key])}"
            else:
                yield from changed_paths(old[key], new[key], where)
    elif old != new:
        yield f"{path}: {_shown(old)} -> {_shown(new)}"


def diff(old: GatewayConfig, new: GatewayConfig) -> Change:
    """What applying ``new`` over ``old`` changes (see the module docstring)."""
    a, b = _dump(old), _dump(new)
    restart = tuple(changed_paths(restart_part(a), restart_part(b)))
    live_a = {k: v for k, v in a.items() if k in LIVE_KEYS}
    live_b = {k: v for k, v in b.items() if k in LIVE_KEYS}
    live = tuple(changed_paths(live_a, live_b))
    was = {f.name: f for f in instance_facts(old)}
    now = {f.name: f for f in instance_facts(new)}
    pairs_a = {p["name"]: p for p in a["pdPairs"]}
    pairs_b = {p["name"]: p for p in b["pdPairs"]}
    return Change(
        restart=restart,
        live=live,
        routing=a["routing"] != b["routing"] or a["guards"] != b["guards"],
        added=tuple(n for n in now if n not in was),
        removed=tuple(n for n in was if n not in now),
        moved=tuple(n for n in now if n in was and was[n] != now[n]),
        pd_added=tuple(n for n in pairs_b if n not in pairs_a),
        pd_removed=tuple(n for n in pairs_a if n not in pairs_b),
        pd_changed=tuple(n for n in pairs_b if n in pairs_a and pairs_a[n] != pairs_b[n]),
    )
