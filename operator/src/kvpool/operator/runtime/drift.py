"""Pure drift check: do the running pods carry the domain's current seed, fingerprint and ports?

Why: the contract (DESIGN.md rule 1) is that old and new processes of a domain never mix. The
render puts the fingerprint, the rollout hash and the mounted config's hash on every pod
template; comparing what each *running* pod carries with what the templates now say names the
pods that are behind (a rollout in progress) or that someone changed by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.operator.derive import names

Obj = dict[str, Any]


@dataclass
class Expected:
    """What a pod of one workload must carry."""

    annotations: dict[str, str]
    seed: str | None
    ports: dict[str, int]
    member: str | None


@dataclass
class Drift:
    """Pods that disagree with the templates, as messages naming them."""

    seed: list[str] = field(default_factory=list)
    ports: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    by_member: dict[str, Drift] = field(default_factory=dict)

    def only(self, member: str) -> Drift:
        """The part of the drift that concerns one member's pods."""
        return self.by_member.get(member, Drift())


def _workload_key(labels: dict[str, str]) -> tuple[str, str]:
    return labels.get(names.LABEL_COMPONENT, ""), labels.get(names.LABEL_INSTANCE, "")


def _container_facts(pod_spec: Obj) -> tuple[str | None, dict[str, int]]:
    seed = None
    ports: dict[str, int] = {}
    for container in pod_spec.get("containers") or []:
        for var in container.get("env") or []:
            if var.get("name") == "PYTHONHASHSEED" and "value" in var:
                seed = str(var["value"])
        for port in container.get("ports") or []:
            ports[str(port.get("name", port.get("containerPort")))] = int(port["containerPort"])
    return seed, ports


def expectations(desired: list[Obj]) -> dict[tuple[str, str], Expected]:
    """Per workload (component, instance), what its pods must carry, from the rendered objects."""
    out: dict[tuple[str, str], Expected] = {}
    for obj in desired:
        if obj.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        template = obj["spec"]["template"]
        labels = template["metadata"].get("labels", {})
        seed, ports = _container_facts(template.get("spec", {}))
        out[_workload_key(labels)] = Expected(
            annotations=dict(template["metadata"].get("annotations", {})),
            seed=seed,
            ports=ports,
            member=labels.get(names.LABEL_MEMBER),
        )
    return out


def _check(name: str, pod: Obj, want: Expected, drift: Drift) -> None:
    have = pod["metadata"].get("annotations") or {}
    fp_want = want.annotations.get(names.ANNOTATION_FINGERPRINT)
    fp_have = have.get(names.ANNOTATION_FINGERPRINT)
    seed, ports = _container_facts(pod.get("spec") or {})
    if fp_want is not None and fp_have != fp_want:
        drift.seed.append(f"pod {name} has domain fingerprint {fp_have}, the domain is {fp_want}")
    if want.seed is not None and seed is not None and seed != want.seed:
        drift.seed.append(f"pod {name} runs PYTHONHASHSEED={seed}, the domain has {want.seed}")
    cfg_want = want.annotations.get(names.ANNOTATION_CONFIG)
    if cfg_want is not None and have.get(names.ANNOTATION_CONFIG) != cfg_want:
        drift.ports.append(
            f"pod {name} mounts config {have.get(names.ANNOTATION_CONFIG)}, rendered {cfg_want}"
        )
    if ports and ports != want.ports:
        wrong = sorted(k for k in set(ports) | set(want.ports) if ports.get(k) != want.ports.get(k))
        drift.ports.append(f"pod {name} serves ports {', '.join(wrong)} other than allocated")
    if any(have.get(k) != v for k, v in want.annotations.items()):
        drift.stale.append(name)


def observe(pods: list[Obj], desired: list[Obj]) -> Drift:
    """Compare every running pod of the domain with its workload's rendered template."""
    expected = expectations(desired)
    drift = Drift()
    for pod in sorted(pods, key=lambda p: str(p["metadata"]["name"])):
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            continue
        want = expected.get(_workload_key(meta.get("labels") or {}))
        if want is None:
            continue
        _check(meta["name"], pod, want, drift)
        if want.member is not None:
            _check(meta["name"], pod, want, drift.by_member.setdefault(want.member, Drift()))
    return drift
