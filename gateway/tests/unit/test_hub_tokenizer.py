"""The gateway's own tokenizer for a vLLM pool (issue 17 part 6): ``tokenizer`` names a
Hugging Face hub cache (what vLLM workers load the model from), resolved to the served model's
snapshot, so the gateway routes on the engine's tokens without a worker's /tokenize. The cache
here is laid out as huggingface_hub writes it (blobs, snapshot symlinks, refs/main) around the
reference tokenizer's files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from kvpool.gateway.config import ConfigError, parse_config
from kvpool.gateway.instances import InstanceSet
from kvpool.gateway.prompts import LocalEncoder, encoder_for, hub_snapshot, local_tokenizer
from kvpool.operator.loader import load_text
from kvpool.operator.render import render_domain
from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

MODEL = "acme/Tiny-Chat-1B"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def hub_cache(root: Path, model: str = MODEL, revisions: tuple[str, ...] = ("c0ffee",),
              main: str | None = "c0ffee") -> Path:  # fmt: skip
    """``root`` as a hub cache holding ``model`` at ``revisions`` (refs/main -> ``main``)."""
    entry = root / ("models--" + model.replace("/", "--"))
    (entry / "blobs").mkdir(parents=True)
    for rev in revisions:
        snap = entry / "snapshots" / rev
        snap.mkdir(parents=True)
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            data = (REFERENCE_TOKENIZER_DIR / name).read_bytes()
            blob = entry / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / name).symlink_to(Path("../../blobs") / blob.name)
    if main is not None:
        (entry / "refs").mkdir()
        (entry / "refs" / "main").write_text(main + "\n")
    return entry


def test_the_snapshot_refs_main_names_tokenizes_like_the_engine(tmp_path: Path) -> None:
    entry = hub_cache(tmp_path, revisions=("0ld", "c0ffee"))
    assert hub_snapshot(tmp_path, MODEL) == entry / "snapshots" / "c0ffee"
    text = "Hello there, general Kenobi: a prompt of the pool's model."
    ours = local_tokenizer(str(tmp_path), MODEL).encode(text)
    assert ours == local_tokenizer("reference").encode(text)


def test_hf_home_layout_and_a_single_snapshot_without_refs(tmp_path: Path) -> None:
    entry = hub_cache(tmp_path / "hub", main=None)
    assert hub_snapshot(tmp_path, MODEL) == entry / "snapshots" / "c0ffee"
    assert hub_snapshot(tmp_path, "acme/other") is None


def test_several_snapshots_and_no_refs_is_refused_saying_what_to_give(tmp_path: Path) -> None:
    hub_cache(tmp_path, revisions=("a1", "b2"), main=None)
    with pytest.raises(FileNotFoundError, match="2 snapshots and no refs/main"):
        local_tokenizer(str(tmp_path), MODEL)


def test_the_rendered_config_tokenizes_locally_or_names_what_is_missing(tmp_path: Path) -> None:
    hub_cache(tmp_path)
    doc = {"model": MODEL, "chunkSize": 4, "controllerUrl": "http://x", "vllm": True}
    config = parse_config({**doc, "tokenizer": str(tmp_path)})
    encoder = encoder_for(config, InstanceSet([]), None)  # type: ignore[arg-type]
    assert isinstance(encoder, LocalEncoder)
    missing = parse_config({**doc, "model": "acme/Absent", "tokenizer": str(tmp_path)})
    with pytest.raises(ConfigError) as err:
        encoder_for(missing, InstanceSet([]), None)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"tokenizer: no tokenizer.json in {tmp_path}")
    assert "models--acme--Absent" in str(err.value)


def test_the_operator_renders_it_for_a_vllm_pool_and_the_gateway_loads_it(
    tmp_path: Path,
) -> None:
    """examples/cuda-pd.yaml (vLLM engines) with spec.gateway.tokenizer pointing at a hub
    cache: the rendered gateway.yaml names it, and the gateway tokenizes locally with it."""
    docs = list(yaml.safe_load_all((EXAMPLES / "cuda-pd.yaml").read_text()))
    pool = next(d for d in docs if d["kind"] == "KVCachePool")
    model = pool["spec"]["model"]["name"]
    hub_cache(tmp_path, model)
    pool["spec"].setdefault("gateway", {})["tokenizer"] = {"path": str(tmp_path)}
    loaded = load_text(yaml.safe_dump_all(docs), "cuda-pd.yaml")
    assert not loaded.errors
    (domain,) = loaded.domains()
    (cm,) = [
        o
        for o in render_domain(domain.pool, domain.members)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-gateway")
    ]
    config = parse_config(yaml.safe_load(cm["data"]["gateway.yaml"]))
    assert config.vllm and config.tokenizer == str(tmp_path) and config.model == model
    encoder = encoder_for(config, InstanceSet([]), None)  # type: ignore[arg-type]
    assert isinstance(encoder, LocalEncoder)
    assert encoder.tokenizer.encode("a b c") == local_tokenizer("reference").encode("a b c")
