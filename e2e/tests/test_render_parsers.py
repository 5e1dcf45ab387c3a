"""Every command line, env and config the operator renders goes through the real parser of the
component it is rendered for, for every example x every value of every API enum.

Why: the render and the components are one contract. A flag the controller does not know
(``--persistence none`` was one), a setting a worker refuses (a KV dtype its engine lacks) or
a value that parses but lands nowhere shows up only when the pod starts. Here each rendered
workload is parsed without starting anything: the controller's argparse and
``ControllerSettings``; the worker's argparse, ``WorkerSettings``, its contract check (seed,
fingerprint, LMCache config) and, per engine, LMCache's own config loader and the reference
engine's dtype and model-shape checks or the vLLM command it would exec; the gateway's parser
and config loader; Mooncake's flag list (``mooncake_master --helpfull``) and its env loader.
"Honoured" is checked too: every rendered flag lands on the settings field it names, with the
rendered value. Nothing is mocked; the env a kubelet adds (the pod IP) is filled in.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from kvpool.operator.api import KVCachePool, P2PGroup, PDPair
from kvpool.operator.loader import load_text
from kvpool.operator.local.plan import Workload, workloads
from kvpool.operator.render import render_domain
from kvpool.operator.validation import errors, validate_domain

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
MODELS: dict[str, type[BaseModel]] = {
    "KVCachePool": KVCachePool,
    "P2PGroup": P2PGroup,
    "PDPair": PDPair,
}
POD_IP = "10.0.0.7"  # what the kubelet puts in valueFrom.fieldRef status.podIP
INSTANCES_PER_MEMBER = 2  # parsed per member and variant (a 16-instance fleet: its first two)
# Enum values that validate clean in no example, and why (so a silently narrowed API is seen).
NEVER_CLEAN: dict[tuple[str, str, str], str] = {}
# Values that are valid only with another field set too (the rules say so): set both.
_PD_CUDA: dict[tuple[str, ...], Any] = {
    ("spec", "prefill", "engine", "platform"): "cuda",
    ("spec", "decode", "engine", "platform"): "cuda",
    ("spec", "transfer", "channel"): "nixl",
    ("spec", "transfer", "bufferDevice"): "cuda",
}  # fmt: skip
COMPANIONS: dict[tuple[str, str, str], dict[tuple[str, ...], Any]] = {
    ("KVCachePool", "spec.controller.persistence.mode", "redis"): {
        ("spec", "controller", "persistence", "redisUrl"): "redis://kv-redis.llm.svc:6379/0"
    },
    ("P2PGroup", "spec.transfer.channel", "hixl"): {
        ("spec", "transfer", "hostStaging", "enabled"): False
    },
    ("PDPair", "spec.prefill.engine.platform", "cuda"): _PD_CUDA,
    ("PDPair", "spec.decode.engine.platform", "cuda"): _PD_CUDA,
    ("PDPair", "spec.transfer.bufferDevice", "cuda"): _PD_CUDA,
}


def _literal(annotation: Any) -> tuple[Any, ...] | None:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in get_args(annotation):
            found = _literal(arg)
            if found is not None:
                return found
    return None


def _model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def enum_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[Any]:
    """``(path of camelCase keys, values)`` of every Literal field under ``spec``."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        if not prefix and key != "spec":
            continue  # apiVersion, kind, metadata, status: not rendered into a component
        values = _literal(info.annotation)
        if values is not None:
            yield (*prefix, key), values
            continue
        sub = _model(info.annotation)
        if sub is not None:
            yield from enum_fields(sub, (*prefix, key))


def _set(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc.setdefault(key, {})
        if not isinstance(doc, dict):
            return
    doc[path[-1]] = value


@dataclass
class Variants:
    """Every rendered workload (deduplicated) and which enum values rendered clean."""

    loads: dict[str, tuple[str, Workload]]  # unique key -> (where it came from, workload)
    clean: set[tuple[str, str, str]]
    tried: set[tuple[str, str, str]]


def _publishing_engines(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """Paths of the member's engines that can publish vLLM's KV events (vLLM or engine.sim)."""
    sides = {"P2PGroup": [("spec", "engine")], "PDPair": [("spec", s, "engine") for s in (
        "prefill", "decode")]}.get(doc["kind"], [])  # fmt: skip
    out = []
    for path in sides:
        engine: Any = doc
        for key in path:
            engine = engine.get(key, {})
        if engine.get("platform") != "cpu" or "sim" in engine:
            out.append(path)
    return out


def _render(docs: list[dict[str, Any]], source: str) -> list[dict[str, Any]] | None:
    loaded = load_text(yaml.safe_dump_all(docs), source)
    domains = loaded.domains()
    if loaded.errors or not domains:
        return None
    objects: list[dict[str, Any]] = []
    for d in domains:
        if errors(validate_domain(d.pool, d.members)):
            return None
        objects += render_domain(d.pool, d.members)
    return objects


def _collect() -> Variants:
    out = Variants({}, set(), set())
    for path in EXAMPLES:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        cases: list[tuple[str, tuple[str, str, str] | None, list[dict[str, Any]]]] = [
            (path.name, None, docs)
        ]
        for i, doc in enumerate(docs):
            for field_path, values in enum_fields(MODELS[doc["kind"]]):
                for value in values:
                    variant = copy.deepcopy(docs)
                    _set(variant[i], field_path, value)
                    tag: tuple[str, str, str] = (doc["kind"], ".".join(field_path), str(value))
                    for other, companion in COMPANIONS.get(tag, {}).items():
                        _set(variant[i], other, companion)
                    cases.append((f"{path.name}#{i + 1} {tag[1]}={value}", tag, variant))
            engines = _publishing_engines(doc)
            if engines:  # engine.kvEvents: --kv-events-config on its own ports
                variant = copy.deepcopy(docs)
                for engine in engines:
                    _set(variant[i], (*engine, "kvEvents"), True)
                tag = (doc["kind"], f"{path.name}#{i + 1} engine.kvEvents", "True")
                cases.append((f"{path.name}#{i + 1} engine.kvEvents=true", tag, variant))
        for source, case, variant in cases:
            if case is not None:
                out.tried.add(case)
            objects = _render(variant, source)
            if objects is None:
                continue
            if case is not None:
                out.clean.add(case)
            per_member: dict[str, int] = {}
            for w in workloads(objects).values():
                member = w.labels.get("kvpool.io/member")
                if member is not None:  # instances of a member differ in names and ports only
                    per_member[member] = per_member.get(member, 0) + 1
                    if per_member[member] > INSTANCES_PER_MEMBER:
                        continue
                key = json.dumps([w.component, w.argv, w.env, w.field_env, w.files])
                out.loads.setdefault(key, (source, w))
    return out


VARIANTS = _collect()


def _of(component: str) -> list[tuple[str, Workload]]:
    return [v for v in VARIANTS.loads.values() if v[1].component == component]


def _ids(items: list[tuple[str, Workload]]) -> list[str]:
    return [f"{w.name}@{src}" for src, w in items]


def test_every_enum_value_renders_clean_somewhere() -> None:
    """Every value of every API enum reaches the parsers below in at least one example."""
    missing = sorted(VARIANTS.tried - VARIANTS.clean - set(NEVER_CLEAN))
    assert missing == [], f"enum values that validate clean in no example: {missing}"
    assert len(VARIANTS.clean) >= 40  # the walk over the API found its enums


@contextlib.contextmanager
def pod_env(w: Workload, tmp: Path) -> Iterator[dict[str, str]]:
    """This process's env as the pod's: the rendered env, the pod IP, mounts as files."""
    saved = dict(os.environ)
    mounts = {}
    for mounted, text in w.files.items():
        local = tmp / Path(mounted).name
        local.write_text(text, encoding="utf-8")
        mounts[mounted] = str(local)
    env = {k: v for k, v in saved.items() if not k.startswith(("KVPOOL_", "LMCACHE_", "MOONCAKE"))}
    env.update({k: POD_IP for k in w.field_env})
    env.update({k: f"secret-{ref[0]}-{ref[1]}" for k, ref in w.secret_env.items()})
    for key, rendered in w.env.items():
        value = rendered
        for ref in w.field_env:  # the kubelet expands $(VAR) of the pod's own env
            value = value.replace(f"$({ref})", POD_IP)
        env[key] = mounts.get(value, value)
    w.argv = [mounts.get(a, a) for a in w.argv]  # a mounted path a flag names: the local file
    os.environ.clear()
    os.environ.update(env)
    try:
        yield env
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _flags(argv: list[str]) -> list[tuple[str, str]]:
    """``--flag value`` pairs before a bare ``--`` (what follows it is the engine's own)."""
    argv = argv[: argv.index("--")] if "--" in argv else argv
    return [
        (a, argv[i + 1])
        for i, a in enumerate(argv[:-1])
        if a.startswith("--") and not argv[i + 1].startswith("--")
    ]


def assert_flags_land(
    parser: Any, argv: list[str], settings: Any, loaded: frozenset[str] = frozenset()
) -> None:
    """Each rendered ``--flag value`` sets the settings field it names, to that value
    (``loaded``: flags naming a file the caller checks was loaded instead)."""
    parsed = parser.parse_args(argv)
    actions = {s: a for a in parser._actions for s in a.option_strings}
    for flag, raw in _flags(argv):
        dest = actions[flag].dest
        if dest in loaded:
            continue
        value = getattr(parsed, dest)
        landed = getattr(settings, dest, None)
        if isinstance(landed, dict):
            assert landed == {k: int(v) for k, v in json.loads(raw).items()}, flag
        else:
            assert landed == value, f"{flag} {raw!r} was parsed as {value!r} but ran as {landed!r}"


CONTROLLERS = _of("controller")


@pytest.mark.parametrize(("source", "w"), CONTROLLERS, ids=_ids(CONTROLLERS))
def test_rendered_controller_parses_and_honours_every_flag(
    source: str, w: Workload, tmp_path: Path
) -> None:
    from kvpool.controller.main import build_parser, settings_from_args

    with pod_env(w, tmp_path) as env:
        settings = settings_from_args(w.argv[1:])
        assert_flags_land(build_parser(), w.argv[1:], settings)
        assert settings.fingerprint == env["KVPOOL_DOMAIN_FINGERPRINT"]


WORKERS = _of("worker")


@pytest.mark.parametrize(("source", "w"), WORKERS, ids=_ids(WORKERS))
def test_rendered_worker_parses_and_passes_its_own_start_checks(
    source: str, w: Workload, tmp_path: Path
) -> None:
    from kvpool.worker import cli

    assert w.argv[:2] == ["kvpool-worker", "serve"]
    with pod_env(w, tmp_path) as env:
        args = cli._parser().parse_args(w.argv[1:])
        settings = cli.settings_from(args)
        serve = cli._parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]
        assert_flags_land(serve, w.argv[2:], settings)
        if settings.engine == "vllm":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert cli.main(["serve", "--print-command", *w.argv[2:]]) == 0
            vllm = shlex.split(out.getvalue())
            assert "vllm.entrypoints.openai.api_server" in vllm
            _assert_vllm_accepts_dtypes(vllm)
            events = _kv_events(w)
            assert _flags(vllm).count(("--kv-events-config", events)) == (1 if events else 0)
            return
        if settings.engine == "sim":
            _assert_sim_builds_from_the_render(cli, settings, env, _kv_events(w))
            return
        from kvpool.worker.engine.model import model_shape
        from kvpool.worker.engine.offload.config import kv_dtype, load_config

        config = cli.enforce_contract(settings, env)
        lm = load_config(env["LMCACHE_CONFIG_FILE"])
        for key, value in config.items():
            assert getattr(lm, key) == value, key
        kv_dtype(settings.kv_dtype)  # the reference engine's dtype table
        shape = model_shape(cli.reference_options(settings, env["LMCACHE_CONFIG_FILE"]))
        assert shape.num_layers > 0


def test_kv_events_reach_sim_and_vllm_workers_of_every_platform() -> None:
    """engine.kvEvents renders --kv-events-config for the sim and vLLM on ascend and cuda (the
    worker test above checks each against its ports, its parser and what it runs)."""
    engines = set()
    for _, w in WORKERS:
        if _kv_events(w) is not None:
            flags = dict(_flags(w.argv))
            engines.add((flags["--engine"], flags["--platform"]))
    assert engines == {("sim", "cpu"), ("vllm", "ascend"), ("vllm", "cuda")}


def _kv_events(w: Workload) -> str | None:
    """The rendered ``--kv-events-config`` (None without), checked against the instance's
    container ports: vLLM's JSON, bound on every interface of the pod."""
    flags = dict(_flags(w.argv))
    text = flags.get("--kv-events-config")
    if text is None:
        assert not {"kv-events", "kv-replay"} & set(w.ports), w.ports
        return None
    assert json.loads(text) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{w.ports['kv-events']}",
        "replay_endpoint": f"tcp://*:{w.ports['kv-replay']}",
    }
    return text


def _assert_sim_builds_from_the_render(
    cli: Any, settings: Any, env: dict[str, str], events: str | None
) -> None:
    """The simulated worker passes its start checks (the reference engine's contract, then
    what it models of the config) and runs the rendered profile, shape and tiers, and publishes
    vLLM's KV events where rendered, naming the pod's IP to routers."""
    config = cli.enforce_contract(settings, env)
    engine = cli.build_sim(settings, env, cli.tokenizer_for(settings))
    inst = engine.instance.config
    assert inst.profile.name == settings.sim_profile
    assert engine.speedup == settings.sim_speedup
    assert (inst.chunk_size, inst.block_size) == (config["chunk_size"], settings.block_size)
    assert inst.ddr_chunks > 0  # the rendered CPU tier bounds the simulated DDR
    assert (engine.client is not None) == bool(config.get("enable_controller"))
    assert engine.p2p == bool(config.get("enable_p2p"))
    assert (engine.kv_events is not None) == (events is not None)
    if events is not None:
        rendered = json.loads(events)
        assert engine.kv_events.config.endpoint == rendered["endpoint"]
        source = engine.kv_event_sources()["0"]
        assert source["endpoint"] == rendered["endpoint"].replace("*", POD_IP)
        assert source["replay_endpoint"] == rendered["replay_endpoint"].replace("*", POD_IP)


# What vLLM's argument parser accepts (vLLM cannot be installed here, so its choices are
# written down): ``--dtype`` is vllm/config/model.py's ModelDType, ``--kv-cache-dtype``
# vllm/config/cache.py's CacheDType (int8 since vLLM 0.11; vllm-ascend's int8 KV).
VLLM_DTYPE = {"auto", "half", "float16", "bfloat16", "float", "float32"}
VLLM_KV_CACHE_DTYPE = {
    "auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
}  # fmt: skip


def _assert_vllm_accepts_dtypes(argv: list[str]) -> None:
    flags = dict(_flags(argv))
    assert ("--dtype" in flags) != ("--kv-cache-dtype" in flags), argv
    if "--dtype" in flags:
        assert flags["--dtype"] in VLLM_DTYPE, flags["--dtype"]
    else:
        assert flags["--kv-cache-dtype"] in VLLM_KV_CACHE_DTYPE, flags["--kv-cache-dtype"]


def _gateway_cli() -> types.ModuleType:
    try:
        return importlib.import_module("kvpool.gateway.cli")
    except ImportError as exc:
        pytest.skip(f"kvpool-gateway cannot be imported ({exc}): its render is not parsed")


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


GATEWAYS = _of("gateway")


@pytest.mark.parametrize(("source", "w"), GATEWAYS, ids=_ids(GATEWAYS))
def test_rendered_gateway_parses_and_loads_its_config(
    source: str, w: Workload, tmp_path: Path
) -> None:
    gw = _gateway_cli()
    from kvpool.gateway.config import GatewayEnv

    w = copy.deepcopy(w)
    with pod_env(w, tmp_path) as env:
        assert w.argv[:2] == ["kvpool-gateway", "serve"]
        config, options = gw.settings_from_args(w.argv[1:])
        serve = gw.build_parser()._subparsers._group_actions[0].choices["serve"]
        assert_flags_land(serve, w.argv[2:], options, frozenset({"config"}))
        gateway_env = GatewayEnv()
        assert gateway_env.hash_seed == env["PYTHONHASHSEED"]
        if "KVPOOL_GATEWAY_AUTH_TOKEN" in env:
            assert gateway_env.api_keys()
    # Every rendered key of gateway.yaml is read back with its rendered value.
    (text,) = w.files.values()
    loaded = dict(_leaves(config.model_dump(by_alias=True, mode="json")))
    for path, value in _leaves(yaml.safe_load(text)):
        assert loaded.get(path) == value, f"gateway.yaml{path}: rendered {value!r}"


MOONCAKE = [v for v in VARIANTS.loads.values() if v[1].component.startswith("mooncake")]


@functools.cache
def _mooncake_flags(binary: str) -> frozenset[str]:
    """Flag names the program knows: gflags' ``--helpfull``, else argparse's ``--help``."""
    exe = Path(sys.executable).parent / binary
    if not exe.exists():
        pytest.skip(f"{binary} is not installed (mooncake-transfer-engine-non-cuda)")
    names: set[str] = set()
    for option in ("--helpfull", "--help"):
        text = subprocess.run(
            [str(exe), option], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        names |= {m.group(1) for m in re.finditer(r"(?:^|\s|\[)--?([a-z][a-z0-9_-]*)", text)}
        if len(names) > 3:
            break
    return frozenset(names)


@pytest.mark.parametrize(("source", "w"), MOONCAKE, ids=_ids(MOONCAKE))
def test_rendered_mooncake_parts_use_flags_and_env_mooncake_knows(
    source: str, w: Workload, tmp_path: Path
) -> None:
    if w.argv[:3] == ["python3", "-m", "mooncake.mooncake_store_service"]:
        from mooncake import mooncake_store_service
        from mooncake.mooncake_config import MooncakeConfig

        with pod_env(w, tmp_path), contextlib.ExitStack() as stack:
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                sys, "argv", ["mooncake_store_service", *w.argv[3:]]
            )
            mooncake_store_service.parse_arguments()
            config = MooncakeConfig.load_from_env()
            assert config.master_server_address == os.environ["MOONCAKE_MASTER"]
            assert config.global_segment_size == int(os.environ["MOONCAKE_GLOBAL_SEGMENT_SIZE"])
        return
    known = _mooncake_flags(w.argv[0])
    for arg in w.argv[1:]:
        if arg.startswith("-"):
            name = arg.lstrip("-").split("=")[0]
            assert name in known, f"{w.argv[0]} has no flag {arg}"
