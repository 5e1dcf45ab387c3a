"""``kvpool-gateway hashes`` end to end: the console script on the gateway.yaml the operator
renders for examples/cpu-demo.yaml, checked against LMCache's own ChunkedTokenDatabase and HF
transformers' chat rendering (what vLLM runs), and bad input refused naming the flag.

The reference tokenizer is the one kvpool.protocol ships (the worker serves with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.gateway.cli import main
from kvpool.operator.loader import load_text
from kvpool.operator.render import render_domain
from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR

REPO = Path(__file__).resolve().parents[3]
REFERENCE_TOKENIZER = REFERENCE_TOKENIZER_DIR
CLI = [str(Path(sys.executable).with_name("kvpool-gateway")), "hashes"]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The cpu-demo gateway.yaml as a file, and the PYTHONHASHSEED rendered beside it."""
    loaded = load_text((REPO / "examples" / "cpu-demo.yaml").read_text(), "cpu-demo.yaml")
    (domain,) = loaded.domains()
    objects = render_domain(domain.pool, domain.members)
    name = lambda o: o["metadata"]["name"]  # noqa: E731
    cm = next(o for o in objects if o["kind"] == "ConfigMap" and name(o).endswith("-gateway"))
    deploy = next(o for o in objects if o["kind"] == "Deployment" and name(o).endswith("-gateway"))
    env = {
        e["name"]: e.get("value")
        for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    path = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    path.write_text(cm["data"]["gateway.yaml"])
    return path, str(env["PYTHONHASHSEED"])


def _run(args: list[str], seed: str | None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    return subprocess.run(
        CLI + args, input=stdin, capture_output=True, text=True, env=env, timeout=60, check=False
    )


def _lmcache_hashes(tokens: list[int], chunk_size: int, save_unfull_chunk: bool) -> list[int]:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.token_database import ChunkedTokenDatabase

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size, save_unfull_chunk=save_unfull_chunk
    )
    rows = ChunkedTokenDatabase(config).process_tokens(tokens=tokens, make_key=False)
    return [h for _, _, h in rows]


def test_token_ids_on_the_rendered_config_hash_like_lmcache(rendered: tuple[Path, str]) -> None:
    config, seed = rendered
    tokens = [(i * 7919) % 4000 for i in range(600)]
    done = _run(["--config", str(config), "--tokens", json.dumps(tokens)], seed)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    chunk = yaml.safe_load(config.read_text())["chunkSize"]
    assert out["regime"] == {
        "chunk_size": chunk,
        "hash_algorithm": "builtin",
        "effective_algorithm": "builtin",
        "vllm": False,
        "hash_seed": seed,
        "save_unfull_chunk": False,
        "none_hash": 0,
    }
    assert out["tokens"] == tokens and out["num_tokens"] == 600
    assert out["hashes"] == _lmcache_hashes(tokens, chunk, save_unfull_chunk=False)
    assert [(c["start"], c["end"]) for c in out["chunks"]] == [(0, 256), (256, 512)]


def test_a_chat_body_gets_the_engines_token_ids(rendered: tuple[Path, str]) -> None:
    from transformers import PreTrainedTokenizerFast

    config, seed = rendered
    body = {
        "model": "kvpool/reference-tiny",
        "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Tell me about "},
                    {"type": "text", "text": "the river."},
                ],
            },
        ],
    }
    args = ["--config", str(config), "--tokenizer", str(REFERENCE_TOKENIZER), "--chat", "-"]
    done = _run([*args, "--save-unfull-chunk"], seed, stdin=json.dumps(body))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    cfg = json.loads((REFERENCE_TOKENIZER / "tokenizer_config.json").read_text())
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(REFERENCE_TOKENIZER / "tokenizer.json"),
        chat_template=cfg["chat_template"],
    )
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Tell me about the river."},
    ]
    expected = list(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    assert out["tokens"] == expected
    assert out["hashes"] == _lmcache_hashes(expected, out["regime"]["chunk_size"], True)
    assert len(out["hashes"]) == 1  # one partial chunk, hashed because of --save-unfull-chunk


def test_bad_input_exits_2_naming_the_flag() -> None:
    done = _run(["--chunk-size", "0", "--tokens", "1,2,3"], seed=None)
    assert done.returncode == 2
    assert done.stderr.startswith("kvpool-gateway hashes: --chunk-size: must be positive")
    assert "Traceback" not in done.stderr and done.stdout == ""


def _in_process(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any, str]:
    code = main(["hashes", *argv])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--tokens", "1,x"], "--tokens: '1,x' is not a list of token ids"),
        (["--tokens", "[1, 2.5]"], "--tokens:"),
        (["--tokens", "-1"], "--tokens: token ids must be non-negative"),
        (
            ["--hash-algorithm", "xxhash", "--tokens", "1"],
            "--hash-algorithm: 'xxhash' is not one of",
        ),
        (["--vllm", "--tokens", "1"], "--seed (or PYTHONHASHSEED): is required with vLLM"),
        (["--seed", "auto", "--tokens", "1"], "--seed: 'auto' is not a PYTHONHASHSEED"),
        (["--prompt", "hi"], "--tokenizer: a prompt or chat needs the model's tokenizer.json"),
        (["--prompt", "hi", "--tokenizer", "/nonexistent"], "--tokenizer: no tokenizer file"),
        (
            ["--config", "/nonexistent.yaml", "--tokens", "1"],
            "--config: cannot read the gateway config",
        ),
        (
            ["--chat", "/nonexistent.json", "--tokenizer", str(REFERENCE_TOKENIZER)],
            "--chat: cannot read",
        ),
    ],
)
def test_bad_inputs_name_the_flag(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    fragment: str,
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    code, _, err = _in_process(capsys, argv)
    assert code == 2
    assert err.startswith(f"kvpool-gateway hashes: {fragment}"), err


def test_a_bad_chat_body_names_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    body = tmp_path / "chat.json"
    body.write_text(json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}))
    code, _, err = _in_process(
        capsys, ["--chat", str(body), "--tokenizer", str(REFERENCE_TOKENIZER)]
    )
    assert code == 2 and err.startswith("kvpool-gateway hashes: --chat: messages.0.role:"), err


def test_flags_override_the_config_and_prompt_text_is_encoded_as_the_engine_does(
    capsys: pytest.CaptureFixture[str], rendered: tuple[Path, str]
) -> None:
    from transformers import PreTrainedTokenizerFast

    config, seed = rendered
    text = "The river runs past the old mill, and the miller counts the sacks."
    code, out, err = _in_process(
        capsys,
        [
            "--config",
            str(config),
            "--tokenizer",
            str(REFERENCE_TOKENIZER),
            "--prompt",
            text,
            "--chunk-size",
            "4",
            "--hash-algorithm",
            "sha256_cbor",
            "--vllm",
            "--seed",
            seed,
        ],
    )
    assert code == 0, err
    hf = PreTrainedTokenizerFast(tokenizer_file=str(REFERENCE_TOKENIZER / "tokenizer.json"))
    assert out["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    # the rendered cpu-demo config names the reference tokenizer itself
    code, by_config, err = _in_process(capsys, ["--config", str(config), "--prompt", text])
    assert code == 0, err
    assert by_config["tokens"] == out["tokens"]
    assert (
        out["regime"]["chunk_size"] == 4 and out["regime"]["effective_algorithm"] == "sha256_cbor"
    )
    assert out["regime"]["none_hash"] != 0 and len(out["hashes"]) == len(out["tokens"]) // 4
