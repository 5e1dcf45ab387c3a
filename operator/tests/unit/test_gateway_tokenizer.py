"""spec.gateway.tokenizer (issue 17 part 6): the model's tokenizer rendered for the gateway of a
vLLM pool, mounted from a PersistentVolumeClaim when one is named; without it a vLLM pool's
gateway asks its workers' /tokenize and a platform cpu pool's uses the reference tokenizer.
(The gateway loading what is rendered: gateway/tests/unit/test_hub_tokenizer.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from kvpool.operator.loader import load_text
from kvpool.operator.render import render_domain

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _render(example: str, tokenizer: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
    """(the gateway's pod spec, its gateway.yaml) of ``example`` with ``tokenizer`` set."""
    docs = list(yaml.safe_load_all((EXAMPLES / example).read_text()))
    pool = next(d for d in docs if d["kind"] == "KVCachePool")
    if tokenizer is not None:
        pool["spec"].setdefault("gateway", {})["tokenizer"] = tokenizer
    loaded = load_text(yaml.safe_dump_all(docs), example)
    assert not loaded.errors, loaded.errors
    (domain,) = loaded.domains()
    objects = render_domain(domain.pool, domain.members)
    gateway = [o for o in objects if o["metadata"]["name"].endswith("-gateway")]
    deploy = next(o for o in gateway if o["kind"] == "Deployment")
    cm = next(o for o in gateway if o["kind"] == "ConfigMap")
    kubernetes_validate.validate(deploy, "1.33", strict=True)
    return deploy["spec"]["template"]["spec"], yaml.safe_load(cm["data"]["gateway.yaml"])


def test_a_vllm_pool_gets_the_tokenizer_mounted_read_only_from_its_claim() -> None:
    given = {"path": "/models/hub", "claimName": "llama-weights"}
    pod, config = _render("cuda-pd.yaml", given)
    assert config["vllm"] is True and config["tokenizer"] == "/models/hub"
    (container,) = pod["containers"]
    assert {"name": "tokenizer", "mountPath": "/models/hub", "readOnly": True} in container[
        "volumeMounts"
    ]
    claim = {"claimName": "llama-weights", "readOnly": True}
    assert {"name": "tokenizer", "persistentVolumeClaim": claim} in pod["volumes"]


def test_a_path_in_the_image_mounts_nothing() -> None:
    pod, config = _render("cuda-pd.yaml", {"path": "/opt/tokenizer/tokenizer.json"})
    assert config["tokenizer"] == "/opt/tokenizer/tokenizer.json"
    assert [v["name"] for v in pod["volumes"]] == ["config"]


def test_without_it_vllm_pools_use_their_workers_and_cpu_pools_the_reference() -> None:
    _, vllm = _render("cuda-pd.yaml", None)
    assert "tokenizer" not in vllm
    _, cpu = _render("cpu-demo.yaml", None)
    assert cpu["tokenizer"] == "reference"
    _, given = _render("cpu-demo.yaml", {"path": "/opt/tok"})
    assert given["tokenizer"] == "/opt/tok"  # what is given wins


def test_a_relative_path_is_refused_naming_the_field() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "cuda-pd.yaml").read_text()))
    pool = next(d for d in docs if d["kind"] == "KVCachePool")
    pool["spec"].setdefault("gateway", {})["tokenizer"] = {"path": "models/hub"}
    loaded = load_text(yaml.safe_dump_all(docs), "cuda-pd.yaml")
    text = " ".join(str(e) for e in loaded.errors)
    assert "gateway.tokenizer.path" in text, text
