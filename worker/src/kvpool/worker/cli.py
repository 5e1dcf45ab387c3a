"""``kvpool-worker``: the worker pod's entry point.

Why this module exists: in a pod, the worker is what turns the operator's rendered LMCache
config and injected environment into a running engine, and what refuses to run when they are
inconsistent (a worker from another cache domain serves 0 % hits without any error). Here it
parses flags, checks the contract, then either execs vLLM(-Ascend) with the LMCache connector
(``--engine vllm``) or serves the reference engine over HTTP (``--engine reference``) with a
bounded SIGTERM drain, or serves the simulated engine (``--engine sim``: a worker in every
respect but the model math; ``kvpool-worker host`` runs many of them in one process).

    kvpool-worker serve --engine reference --port 8000
    kvpool-worker serve --engine sim --sim-profile h100-llama-3.1-8b-vllm --num-layers 32 ...
    kvpool-worker host --instances instances.json
    kvpool-worker serve --engine vllm --platform ascend --model /models/qwen3 --block-size 128
    kvpool-worker fingerprint --model M --block-size 16 --kv-dtype float32 [--config FILE]
    kvpool-worker calibrate --out profile.json [--sweep quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError

from kvpool.protocol.chat import TextTokenizer
from kvpool.protocol.domain import DomainFacts, domain_fingerprint
from kvpool.protocol.hashing import DEFAULT_CHUNK_SIZE, DEFAULT_HASH_ALGORITHM
from kvpool.worker.contract import (
    Problem,
    check_contract,
    check_devices,
    format_problems,
    parse_lmcache_config,
)
from kvpool.worker.controller_wait import ControllerUnreachableError, wait_for_controller
from kvpool.worker.engine_api import Engine, ReferenceEngineOptions
from kvpool.worker.server import WorkerRuntime, build_app
from kvpool.worker.settings import WorkerSettings
from kvpool.worker.shutdown import EXIT_OK, GracefulShutdown, ShutdownPolicy, hard_exit
from kvpool.worker.tokenizer import load_tokenizer
from kvpool.worker.vllm_cmd import VllmCommandError, VllmLaunch, vllm_command

logger = logging.getLogger(__name__)

EXIT_REFUSED = 2  # the contract or the flags are wrong: fix the deployment, do not retry
EXIT_FAILED = 1  # the engine failed to start


class StartRefusedError(Exception):
    """The worker must not start; the message says what to fix (printed, no traceback)."""


# Flag name → settings field. Flags left unset fall through to KVPOOL_WORKER_* and defaults.
_SERVE_FLAGS: list[tuple[str, str, type, str]] = [
    ("--host", "host", str, "bind address (default 127.0.0.1)"),
    ("--port", "port", int, "HTTP port (default 8000)"),
    ("--model", "model", str, "served model name; part of the domain fingerprint"),
    ("--model-dir", "model_dir", str, "local HF model directory (reference: else random)"),
    ("--block-size", "block_size", int, "KV block size in tokens (fingerprint)"),
    ("--kv-dtype", "kv_dtype", str, "KV dtype, e.g. float32, bfloat16 (fingerprint)"),
    ("--max-model-len", "max_model_len", int, "prompt plus generated tokens, at most"),
    ("--tokenizer", "tokenizer", str, "tokenizer.json or its directory"),
    ("--weights-seed", "weights_seed", int, "reference: seed of the random weights"),
    ("--num-kv-blocks", "num_kv_blocks", int, "reference: paged KV capacity in blocks"),
    ("--max-num-seqs", "max_num_seqs", int, "batch size (reference 8; sim: the profile's)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "sim: a step's token budget"),
    ("--sim-profile", "sim_profile", str, "sim: a bundled profile's name or a profile file"),
    ("--sim-speedup", "sim_speedup", float, "sim: model seconds per wall second (default 1)"),
    ("--sim-device-kv-gib", "sim_device_kv_gib", float, "sim: device KV GiB (default: profile)"),
    ("--num-layers", "num_layers", int, "sim: layers of the pool's model (KV bytes per token)"),
    ("--num-kv-heads", "num_kv_heads", int, "sim: KV heads of the pool's model"),
    ("--head-dim", "head_dim", int, "sim: head dimension of the pool's model"),
    ("--kv-events-config", "kv_events_config", str, "sim, vllm: vLLM's KV-event config (JSON)"),
    ("--platform", "platform", str, "vllm: ascend or cuda"),
    ("--ascend-connector", "ascend_connector", str, "vllm on ascend: dynamic or builtin"),
    ("--tensor-parallel-size", "tensor_parallel_size", int, "vllm: TP size"),
    ("--lmcache-rpc-port", "lmcache_rpc_port", str, "vllm: LMCache RPC port identifier"),
    ("--session-capacity", "session_capacity", int, "sessions remembered for /memory"),
    ("--unready-delay", "unready_delay_s", float, "SIGTERM: seconds unready before draining"),
    ("--drain-timeout", "drain_timeout_s", float, "SIGTERM: seconds to drain in-flight work"),
    ("--shutdown-deadline", "shutdown_deadline_s", float, "SIGTERM: exit within (seconds)"),
    ("--stall-timeout", "stall_timeout_s", float, "unready while one engine step runs longer"),
    ("--controller-wait", "controller_wait_s", float, "s the KV controller may take (0: none)"),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool-worker", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the worker (reference engine, vLLM or sim)")
    serve.add_argument("--engine", choices=["reference", "vllm", "sim"], default=None)
    for flag, field, kind, text in _SERVE_FLAGS:
        serve.add_argument(flag, dest=field, type=kind, default=None, help=text)
    serve.add_argument(
        "--print-command",
        action="store_true",
        help="vllm: print the command line instead of exec'ing it",
    )
    serve.add_argument("vllm_args", nargs="*", help="after --: extra vLLM arguments")
    host = sub.add_parser(
        "host", help="serve many --engine sim instances from one process (one port each)"
    )
    host.add_argument(
        "--instances",
        required=True,
        help='JSON file: a list of {"argv": [the rendered kvpool-worker serve argv], "env": '
        "{its environment}}",
    )
    host.add_argument("--log-level", default="info", help="debug, info, warning or error")
    cal = sub.add_parser(
        "calibrate", help="fit a --engine sim profile from the reference engine on this machine"
    )
    cal.add_argument("--out", required=True, help="the profile file to write (JSON)")
    cal.add_argument(
        "--sweep",
        choices=["tiny", "quick", "full"],
        default="quick",
        help="quick: about a minute; full: minutes, more lengths and rounds; tiny: tests",
    )
    cal.add_argument("--name", default="calibrated-reference-tiny", help="the profile's name")
    cal.add_argument("--model", default="kvpool/reference-tiny", help="the model's name")
    cal.add_argument("--model-dir", help="a local HF model directory (default: random weights)")
    cal.add_argument(
        "--statistic",
        choices=["min", "median"],
        default="min",
        help="what stands for a shape's rounds: min (the engine with the least interference) "
        "or median (this box at its load)",
    )
    fp = sub.add_parser("fingerprint", help="print the cache-domain fingerprint")
    fp.add_argument("--model", required=True)
    fp.add_argument("--block-size", type=int, required=True)
    fp.add_argument("--kv-dtype", required=True)
    fp.add_argument("--config", help="LMCache YAML (chunk size, hash algorithm)")
    fp.add_argument("--hash-seed", help="default: $PYTHONHASHSEED")
    return parser


def settings_from(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> WorkerSettings:
    """Flags over ``KVPOOL_WORKER_*`` of ``env`` (default: this process's environment)."""
    fields = [f for _, f, _, _ in _SERVE_FLAGS] + ["engine"]
    overrides = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    try:
        return WorkerSettings.from_env(os.environ if env is None else env, **overrides)
    except ValidationError as exc:
        lines = [
            f"  - {'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        ]
        raise StartRefusedError(
            "invalid settings (flags or KVPOOL_WORKER_*):\n" + "\n".join(lines)
        ) from exc


def read_config(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The rendered LMCache config's text, or None and why it could not be read."""
    path = env.get("LMCACHE_CONFIG_FILE")
    if path is None:
        return None, "LMCACHE_CONFIG_FILE is unset"
    try:
        return Path(path).read_text(encoding="utf-8"), None
    except OSError as exc:
        return None, exc.strerror or str(exc)


def enforce_contract(
    settings: WorkerSettings, env: Mapping[str, str], *, devices: bool = False
) -> dict[str, Any]:
    """Check DESIGN.md rules 1 and 9; return the parsed LMCache config or refuse."""
    text, error = read_config(env)
    problems: list[Problem] = check_contract(
        env,
        text,
        config_error=error,
        model=settings.model,
        block_size=settings.block_size,
        kv_dtype=settings.kv_dtype,
    )
    if devices:
        problems += check_devices(
            env, platform=settings.platform, tensor_parallel_size=settings.tensor_parallel_size
        )
    if problems:
        raise StartRefusedError(format_problems(problems))
    config, _ = parse_lmcache_config(text or "")
    return config


def run_vllm(args: argparse.Namespace, settings: WorkerSettings, env: Mapping[str, str]) -> int:
    platform = settings.platform
    if platform == "cpu":
        raise StartRefusedError(
            "--engine vllm needs --platform ascend or cuda; on the cpu platform run "
            "--engine reference (the KVCachePool's P2PGroup/PDPair engine.platform: cpu)"
        )
    config = enforce_contract(settings, env, devices=True)
    launch = VllmLaunch(
        model=settings.model_dir or settings.model,
        served_model_name=settings.model,
        platform=platform,
        ascend_connector=settings.ascend_connector,
        block_size=settings.block_size,
        kv_dtype=settings.kv_dtype,
        host=settings.host,
        port=settings.port,
        tensor_parallel_size=settings.tensor_parallel_size,
        max_model_len=settings.max_model_len,
        lmcache_rpc_port=settings.lmcache_rpc_port,
        kv_events_config=settings.kv_events_config,
        extra_args=tuple(args.vllm_args),
    )
    try:
        argv = vllm_command(config, launch)
    except VllmCommandError as exc:
        raise StartRefusedError(f"cannot build the vLLM command: {exc}") from exc
    if args.print_command:
        print(shlex.join(argv))
        return EXIT_OK
    await_lmcache_controller(config, settings)  # vLLM builds LMCache's engine, which registers
    logger.info("exec %s", shlex.join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, dict(env))
    return EXIT_FAILED  # not reached


def await_lmcache_controller(config: Mapping[str, Any], settings: WorkerSettings) -> None:
    """Before LMCache's engine starts (it registers once, and goes mute without an answer):
    the bounded wait for a controller that answers (:mod:`kvpool.worker.controller_wait`);
    raises ``ControllerUnreachableError`` when it runs out."""
    url = config.get("controller_reply_url")
    if not config.get("enable_controller") or not url:
        return
    instance = str(config.get("lmcache_instance_id") or "")
    wait_for_controller(str(url), instance, timeout_s=settings.controller_wait_s)


def reference_options(settings: WorkerSettings, config_file: str | None) -> ReferenceEngineOptions:
    return ReferenceEngineOptions(
        model_name=settings.model,
        model_dir=settings.model_dir,
        weights_seed=settings.weights_seed,
        max_model_len=settings.max_model_len,
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks,
        max_num_seqs=settings.max_num_seqs or ReferenceEngineOptions.max_num_seqs,
        dtype=settings.kv_dtype,
        lmcache_config_file=config_file,
    )


def tokenizer_for(settings: WorkerSettings, *, memo: int = 0) -> TextTokenizer:
    path: str | None = settings.tokenizer
    if path is None and settings.model_dir is not None:
        candidate = Path(settings.model_dir) / "tokenizer.json"
        path = str(candidate) if candidate.is_file() else None
    try:
        return load_tokenizer(path, memo=memo)
    except Exception as exc:
        raise StartRefusedError(
            f"cannot load the tokenizer {path or '(reference)'}: {exc}"
        ) from exc


def build_reference_engine(
    settings: WorkerSettings, env: Mapping[str, str], tokenizer: TextTokenizer
) -> Engine:
    """The reference engine, with LMCache when the operator rendered a config."""
    config_file = env.get("LMCACHE_CONFIG_FILE")
    config: dict[str, Any] = {}
    if config_file is not None:
        config = enforce_contract(settings, env)
    else:
        logger.warning(
            "LMCACHE_CONFIG_FILE is unset: the reference engine runs without LMCache "
            "(every prompt is prefilled; no KV is stored or shared)"
        )
    # torch, transformers and LMCache load only now: refusals and the vllm path stay fast.
    from kvpool.worker.engine import ReferenceEngine  # noqa: PLC0415
    from kvpool.worker.engine.model import model_shape  # noqa: PLC0415

    options = reference_options(settings, config_file)
    try:
        shape = model_shape(options)
    except Exception as exc:
        raise StartRefusedError(f"cannot read the model config: {exc}") from exc
    if tokenizer.vocab_size > shape.vocab_size:
        raise StartRefusedError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has "
            f"{shape.vocab_size}; pass the model's own tokenizer with --tokenizer"
        )
    offload = None
    if config_file is not None:
        from kvpool.worker.engine.offload import (  # noqa: PLC0415
            LMCacheOffload,
            OffloadConfigError,
        )

        if config.get("enable_p2p") or config.get("enable_pd"):
            from kvpool.worker.ucx_env import restrict_ucx  # noqa: PLC0415

            restrict_ucx(os.environ)  # before NIXL loads: UCX reads the process env once
        instance = str(config.get("lmcache_instance_id") or options.lmcache_instance_id)
        await_lmcache_controller(config, settings)
        try:
            offload = LMCacheOffload(
                config_file,
                instance_id=instance,
                num_layers=shape.num_layers,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                block_size=options.block_size,
                dtype=options.dtype,
                model_name=options.model_name,
            )
        except OffloadConfigError as exc:
            raise StartRefusedError(f"LMCache: {exc}") from exc
    return ReferenceEngine(options, offload)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: GracefulShutdown owns SIGTERM/SIGINT."""

    def install_signal_handlers(self) -> None:  # older uvicorn
        return None

    def capture_signals(self) -> Any:  # uvicorn >= 0.29
        return contextlib.nullcontext()


async def serve(runtime: WorkerRuntime, settings: WorkerSettings) -> int:
    """Serve until SIGTERM (drained, engine shut down) or an engine start failure."""
    app = build_app(runtime, start_engine=False)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=2,
        lifespan="on",
    )
    server = _Server(config)

    def stop_server() -> None:
        server.should_exit = True

    policy = ShutdownPolicy(
        unready_delay_s=settings.unready_delay_s,
        drain_timeout_s=settings.drain_timeout_s,
        shutdown_deadline_s=settings.shutdown_deadline_s,
    )
    shutdown = GracefulShutdown(runtime, policy, stop_server)
    shutdown.install(asyncio.get_running_loop())
    code = EXIT_OK

    async def start() -> None:
        nonlocal code
        try:
            await runtime.start_engine()
        except Exception:
            code = EXIT_FAILED
            stop_server()

    start_task = asyncio.create_task(start(), name="kvpool-engine-start")
    await server.serve()
    if shutdown.started:
        await shutdown.done.wait()
    elif not start_task.done():
        start_task.cancel()
    return code


def _fingerprint(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    chunk, algo = DEFAULT_CHUNK_SIZE, DEFAULT_HASH_ALGORITHM
    if args.config:
        config, problems = parse_lmcache_config(Path(args.config).read_text(encoding="utf-8"))
        if problems:
            raise StartRefusedError(format_problems(problems))
        chunk = int(config.get("chunk_size", chunk))
        algo = str(config.get("pre_caching_hash_algorithm", algo))
    seed = args.hash_seed if args.hash_seed is not None else env.get("PYTHONHASHSEED", "")
    facts = DomainFacts(args.block_size, chunk, algo, seed, args.kv_dtype, args.model)
    print(domain_fingerprint(facts))
    return EXIT_OK


def _stray_threads() -> bool:
    main_thread = threading.main_thread()
    return any(
        t is not main_thread and t.is_alive() and not t.daemon for t in threading.enumerate()
    )


def build_sim(settings: WorkerSettings, env: Mapping[str, str], tokenizer: TextTokenizer) -> Engine:
    """The simulated engine: the same contract as the reference engine, then the sim's own
    checks (profile, model shape, what of the rendered LMCache config it models)."""
    from kvpool.worker.sim.build import SimConfigError, build_sim_engine  # noqa: PLC0415

    config: dict[str, Any] | None = None
    if "LMCACHE_CONFIG_FILE" in env:
        config = enforce_contract(settings, env)
    else:
        logger.warning(
            "LMCACHE_CONFIG_FILE is unset: the simulated engine runs without LMCache (no DDR "
            "or disk tier, no controller; only the device prefix cache hits)"
        )
    try:
        return build_sim_engine(settings, env, tokenizer, config)
    except SimConfigError as exc:
        raise StartRefusedError(format_problems(exc.problems)) from exc


def build_runtime(
    settings: WorkerSettings, env: Mapping[str, str], tokenizer: TextTokenizer | None = None
) -> WorkerRuntime:
    """One instance's engine and HTTP runtime (``--engine reference`` or ``sim``), built from
    its settings and environment alone; StartRefusedError says what to fix."""
    if settings.engine != "sim" and settings.kv_events_config:
        raise StartRefusedError(
            "--kv-events-config: the reference engine publishes no KV events; run --engine sim "
            "or --engine vllm (the operator's engine.sim or platform ascend/cuda), or drop it"
        )
    tok = tokenizer if tokenizer is not None else tokenizer_for(settings)
    if settings.engine == "sim":
        engine = build_sim(settings, env, tok)
        return WorkerRuntime(
            engine,
            tok,
            session_capacity=settings.session_capacity,
            memory_budget_bytes=settings.memory_budget_bytes,
            stall_timeout_s=settings.stall_timeout_s,
        )
    engine = build_reference_engine(settings, env, tok)
    offload = getattr(engine, "offload", None)
    pd_info = None
    if offload is not None:
        from kvpool.worker.engine.offload.pd import pd_info as describe_pd  # noqa: PLC0415

        pd_info = describe_pd(offload.config)
    return WorkerRuntime(
        engine,
        tok,
        session_capacity=settings.session_capacity,
        pd_info=pd_info,
        memory_budget_bytes=settings.memory_budget_bytes,
        stall_timeout_s=settings.stall_timeout_s,
    )


def refuse(exc: StartRefusedError) -> int:
    """Print why the worker does not start; exit status 2 (never a traceback)."""
    print(f"kvpool-worker: {exc}", file=sys.stderr)
    if _stray_threads():
        # A failed LMCache start can leave non-daemon threads that would keep a refused
        # worker alive (and Ready-looking) forever: end the process for real.
        sys.stderr.flush()
        hard_exit(EXIT_REFUSED)
    return EXIT_REFUSED


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = dict(os.environ)
    if args.command == "host":
        from kvpool.worker.sim.host import run_host  # noqa: PLC0415

        return run_host(args.instances, args.log_level)
    if args.command == "calibrate":
        from kvpool.worker.sim.calibrate import run as run_calibrate  # noqa: PLC0415 (torch)

        return run_calibrate(
            args.out, args.sweep, args.name, args.model, args.model_dir, args.statistic
        )
    try:
        if args.command == "fingerprint":
            return _fingerprint(args, env)
        settings = settings_from(args, env)
        configure_logging(settings.log_level)
        if settings.engine == "vllm":
            return run_vllm(args, settings, env)
        runtime = build_runtime(settings, env)
    except StartRefusedError as exc:
        return refuse(exc)
    except ControllerUnreachableError as exc:
        logger.error("%s", exc)
        return EXIT_FAILED  # not refused: the kubelet starts the worker again
    try:
        code = asyncio.run(serve(runtime, settings))
    except SystemExit as exc:  # uvicorn exits when it cannot bind: still end for real below
        code = exc.code if isinstance(exc.code, int) else EXIT_FAILED
    logger.info("kvpool-worker exits with %d", code)
    # LMCache leaves non-daemon threads behind: a normal interpreter exit could wait forever.
    hard_exit(code)
    return code  # not reached


if __name__ == "__main__":
    sys.exit(main())
