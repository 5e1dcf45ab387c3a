"""The dry-run CLI: validate prints every problem with its fix, render prints valid objects,
and bad input gets a message naming the field, never a traceback."""

from __future__ import annotations

import io
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


def test_f_repeats_names_directories_and_reads_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubectl's habits: -f twice adds both, -f DIR reads its manifests, -f - reads stdin."""
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(POOL))
    (tmp_path / "member.yml").write_text(yaml.safe_dump(P2P))
    (tmp_path / "notes.txt").write_text("not a manifest")
    assert (
        main(["validate", "-f", str(tmp_path / "pool.yaml"), "-f", str(tmp_path / "member.yml")])
        == 0
    )
    assert "KVCachePool ns/pool: domain" in capsys.readouterr().out
    assert main(["validate", "-f", str(tmp_path)]) == 0
    assert "1 member(s)" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump_all([POOL, P2P])))
    assert main(["validate", "-f", "-"]) == 0
    assert "1 member(s)" in capsys.readouterr().out


def test_directories_recurse_only_with_r(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "all.yaml").write_text(yaml.safe_dump_all([POOL, P2P]))
    assert main(["validate", "-f", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "is a directory without .yaml, .yml or .json files" in out and "-R" in out
    assert main(["validate", "-R", "-f", str(tmp_path)]) == 0


def test_examples_directory_validates_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "-f", str(EXAMPLES)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("=> 0 error(s), 0 warning(s)")
    assert "default P2PGroup/qwen-p2p: spec.transfer.npuBufferSize = 128Mi" in out


def test_summary_counts_load_errors_like_the_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([POOL, merge(P2P, {"spec": {"chunkSise": 1}})]))
    assert main(["validate", "-f", str(bad)]) == 1
    assert capsys.readouterr().out.rstrip().endswith("=> 1 error(s), 0 warning(s)")


def test_member_of_a_pool_in_another_namespace_is_told_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    member = merge(P2P, {"metadata": {"namespace": "other"}})
    assert main(["validate", "-f", _write(tmp_path, POOL, member)]) == 1
    out = capsys.readouterr().out
    assert "which is in namespace 'ns', but this P2PGroup is in namespace 'other'" in out
    assert "fix: set metadata.namespace: ns on the P2PGroup" in out


def test_a_list_document_is_unwrapped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listing = {"apiVersion": "v1", "kind": "List", "items": [POOL, P2P]}
    assert main(["validate", "-f", _write(tmp_path, listing)]) == 0
    assert "1 member(s)" in capsys.readouterr().out
