"""Generated CRDs are structural, valid for Kubernetes, and in sync with the committed files.

No API server can run here, so the CRDs are checked with kubernetes-validate (the official
OpenAPI schema of apiextensions.k8s.io/v1, strict) plus the structural-schema rules the API
server enforces, checked by walking the schema; every example CR is validated against its CRD
schema with jsonschema.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from op_builders import EXAMPLES, REPO

from kvpool.operator import gen
from kvpool.operator.api import ChartValues

K8S_VERSION = "1.33"
CRDS = {
    doc["spec"]["names"]["kind"]: doc
    for doc in (
        gen.crd(kind, plural, short, spec, status)
        for kind, plural, short, spec, status in gen.KINDS
    )
}


def _walk(node: Any, path: str = "") -> list[str]:
    """Violations of Kubernetes' structural-schema rules below ``node``."""
    bad: list[str] = []
    if not isinstance(node, dict):
        return bad
    for key in ("$ref", "$defs", "title", "const"):
        if key in node:
            bad.append(f"{path}: has {key}")
    if "properties" in node and "additionalProperties" in node:
        bad.append(f"{path}: properties and additionalProperties together")
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    if "anyOf" in node:
        if not int_or_string:
            bad.append(f"{path}: anyOf outside int-or-string")
        elif node["anyOf"] != [{"type": "integer"}, {"type": "string"}]:
            bad.append(f"{path}: int-or-string anyOf is {node['anyOf']}")
    if (
        "type" not in node
        and not int_or_string
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        bad.append(f"{path}: no type")
    if node.get("type") == "null":
        bad.append(f"{path}: type null (use nullable)")
    for name, sub in node.get("properties", {}).items():
        bad += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        bad += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _walk(node["additionalProperties"], f"{path}{{}}")
    return bad


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_crd_is_valid_apiextensions_v1(kind: str) -> None:
    assert kubernetes_validate.validate(CRDS[kind], K8S_VERSION, strict=True)


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_crd_schema_is_structural(kind: str) -> None:
    version = CRDS[kind]["spec"]["versions"][0]
    assert _walk(version["schema"]["openAPIV3Schema"]) == []
    assert version["subresources"]["status"] == {}
    if version["subresources"].get("scale"):  # P2PGroup: kubectl scale --replicas
        assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    if kind == "KVCachePool":
        assert columns == ["Ready", "Domain", "Seed", "Members", "Instances", "Hit", "Age"]
    else:
        assert columns == ["Pool", "Instances", "TP", "Ready", "Age"]
    assert CRDS[kind]["spec"]["names"]["shortNames"]


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_printer_columns_read_fields_the_schema_has(kind: str) -> None:
    version = CRDS[kind]["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]["properties"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"].split("[")[0].strip(".").split(".")
        if path[0] == "metadata":
            continue
        node = root[path[0]]
        for part in path[1:]:
            node = node["properties"][part]
        assert node.get("type"), column


def test_conditions_are_a_list_map_and_cel_rule_is_present() -> None:
    schema = CRDS["P2PGroup"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    transfer = schema["properties"]["spec"]["properties"]["transfer"]
    rules = [r["rule"] for r in transfer["x-kubernetes-validations"]]
    assert rules == ["!self.delayPull || (self.pullMode && self.useNPU)"]


def _to_jsonschema(node: Any) -> Any:
    """OpenAPI (nullable) -> JSON Schema, so jsonschema can check CRs against the CRD."""
    if isinstance(node, list):
        return [_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if out.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def test_every_example_cr_matches_its_crd_schema() -> None:
    checked = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            crd = CRDS[doc["kind"]]
            schema = _to_jsonschema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
            jsonschema.validate(doc, schema)
            checked += 1
    assert checked >= 12


def test_crd_schema_rejects_a_wrong_type() -> None:
    schema = _to_jsonschema(CRDS["P2PGroup"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    doc = yaml.safe_load((EXAMPLES / "ascend-p2p.yaml").read_text().split("---")[1])
    doc["spec"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        jsonschema.validate(doc, schema)


def test_values_schema_accepts_defaults_and_rejects_typos() -> None:
    schema = gen.values_schema()
    jsonschema.validate(ChartValues().model_dump(by_alias=True), schema)
    with pytest.raises(jsonschema.ValidationError, match="logLevl"):
        jsonschema.validate({"logLevl": "INFO"}, schema)


def test_committed_files_are_up_to_date() -> None:
    for rel, content in gen.generated_files().items():
        assert (REPO / rel).read_text() == content, f"{rel} drifted: run make generate"


def test_check_mode_reports_drift_and_write_mode_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "operator").mkdir()
    (tmp_path / "charts").mkdir()
    assert gen.main(["--root", str(tmp_path), "--check"]) == 1
    assert "+++ b/crds/kvpool.io_p2pgroups.yaml (generated)" in capsys.readouterr().out
    assert gen.main(["--root", str(tmp_path)]) == 0
    assert gen.main(["--root", str(tmp_path), "--check"]) == 0
    crd_file = tmp_path / "charts/kvpool/crds/kvpool.io_pdpairs.yaml"
    crd_file.write_text(crd_file.read_text().replace("pdpairs", "pdpair"))
    assert gen.main(["--root", str(tmp_path), "--check"]) == 1
    data = json.loads((tmp_path / "charts/kvpool/values.schema.json").read_text())
    assert data["additionalProperties"] is False
    assert copy.deepcopy(data) == gen.values_schema()
