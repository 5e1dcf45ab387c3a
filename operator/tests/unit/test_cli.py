"""The dry-run CLI: validate prints every problem with its fix, render prints valid objects,
and bad input gets a message naming the field, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from op_builders import EXAMPLES, P2P, POOL, merge

from kvpool.operator.cli import main


def _write(tmp_path: Path, *docs: dict[str, object]) -> str:
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump_all(list(docs)))
    return str(path)


def test_validate_examples_pass(capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(p) for p in sorted(EXAMPLES.glob("*.yaml"))]
    args = ["validate"] + [a for f in files for a in ("-f", f)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "KVCachePool llm/ascend-p2p: domain" in out
    assert (
        "memory P2PGroup/qwen-p2p: 2 instances x TP 2 = 4 workers x "
        "(8Gi staging + 16Gi CPU cache) = 96Gi" in out
    )


def test_validate_reports_errors_and_fix_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = merge(P2P, {"spec": {"transfer": {"useNPU": False}, "engine": {"acceleratorCount": 1}}})
    assert main(["validate", "-f", _write(tmp_path, POOL, bad)]) == 1
    out = capsys.readouterr().out
    assert "ERROR [rule 5] P2PGroup/grp: spec.transfer.delayPull: delay pull needs useNPU" in out
    assert "fix: set pullMode: true and useNPU: true" in out
    assert "ERROR [rule 9] P2PGroup/grp: spec.engine.acceleratorCount" in out
    assert "=> 2 error(s), 0 warning(s)" in out


def test_warnings_do_not_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    the_pool = merge(POOL, {"spec": {"nodeAllocatableMemory": "8Gi"}})
    assert main(["validate", "-f", _write(tmp_path, the_pool, P2P)]) == 0
    assert "WARNING [rule 7]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kind: [unclosed", "invalid YAML"),
        ("apiVersion: kvpool.io/v1alpha1\nkind: CachePool\n", "unknown kind 'CachePool'"),
        ("apiVersion: v1\nkind: P2PGroup\n", "apiVersion: is 'v1'"),
        (
            yaml.safe_dump(merge(POOL, {"spec": {"chunkSise": 128}})),
            "spec.chunkSise: Extra inputs are not permitted",
        ),
        (yaml.safe_dump(P2P), "names KVCachePool 'pool' in namespace 'ns', which is not"),
    ],
)
def test_bad_input_is_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["validate", "-f", str(path)]) == 1
    out = capsys.readouterr().out
    assert expected in out
    assert "Traceback" not in out


def test_missing_file_is_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "-f", "/nonexistent/x.yaml"]) == 1
    assert "cannot read (No such file or directory)" in capsys.readouterr().out


def test_render_yaml_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo = str(EXAMPLES / "cpu-demo.yaml")
    assert main(["render", "-f", demo]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap"}
    assert main(["render", "-f", demo, "-o", "json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["kind"] == "List" and len(listing["items"]) == len(docs)


def test_render_refuses_invalid_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = merge(P2P, {"spec": {"useLayerwise": True}})
    assert main(["render", "-f", _write(tmp_path, POOL, bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "P2P with use_layerwise raises ValueError" in captured.err


def test_console_script_runs() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool.operator.cli",
            "validate",
            "-f",
            str(EXAMPLES / "cpu-demo.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "KVCachePool default/demo" in proc.stdout


def test_render_prints_warnings_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    the_pool = merge(POOL, {"spec": {"nodeAllocatableMemory": "8Gi"}})
    assert main(["render", "-f", _write(tmp_path, the_pool, P2P)]) == 0
    captured = capsys.readouterr()
    assert "WARNING [rule 7]" in captured.err
    assert "kind: StatefulSet" in captured.out


def test_resource_names_must_be_dns_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = merge(POOL, {"metadata": {"name": "1pool"}})
    assert main(["validate", "-f", _write(tmp_path, bad)]) == 1
    assert "metadata.name: String should match pattern" in capsys.readouterr().out


def test_the_invalid_example_fails_with_every_documented_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """examples/invalid/p2p-mistakes.yaml is what README shows; keep it failing for its reasons."""
    path = EXAMPLES / "invalid" / "p2p-mistakes.yaml"
    assert main(["validate", "-f", str(path)]) == 1
    out = capsys.readouterr().out
    for rule, field in [
        ("rule 4", "spec.tiers.disk"),
        ("rule 5", "spec.transfer.delayPull"),
        ("rule 5", "spec.transfer.hostStaging.enabled"),
        ("rule 7", "spec.transfer.hostStaging.bytes"),
        ("rule 9", "spec.engine.acceleratorCount"),
    ]:
        assert f"ERROR [{rule}]" in out
        assert field in out
    assert "=> 5 error(s)" in out
    assert "Traceback" not in out
