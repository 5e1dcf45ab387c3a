"""``kvpool-operator``: validate and render cache domains offline (no cluster needed).

Why: the same pure validation and render the operator runs in the cluster, usable on a laptop
or in CI before anything is applied: ``validate`` prints every problem with its fix,
``render`` prints the child objects the operator would create.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from kvpool.operator.derive.defaults import domain_defaults
from kvpool.operator.loader import load_files
from kvpool.operator.quantity import format_bytes
from kvpool.operator.render import render_domain
from kvpool.operator.render.fingerprint import pool_fingerprint, resolve_hash_seed
from kvpool.operator.validation import errors, memory_budgets, validate_domain, warnings
from kvpool.operator.yamlfmt import dump_all


def cmd_validate(files: Sequence[str], out: TextIO, *, recursive: bool = False) -> int:
    """Print every problem, the defaults kvpool fills in and each member's memory budget, then
    one summary line whose error count (load errors included) decides the exit status."""
    loaded = load_files(files, recursive=recursive)
    domains = loaded.domains()
    n_errors, n_warnings = len(loaded.errors), 0
    for err in loaded.errors:
        print(err, file=out)
    if not domains and not loaded.errors:
        print("ERROR no KVCachePool found in the given files", file=out)
        n_errors += 1
    for domain in domains:
        pool = domain.pool
        print(
            f"KVCachePool {pool.metadata.namespace}/{pool.metadata.name}: domain "
            f"{pool_fingerprint(pool)} (PYTHONHASHSEED={resolve_hash_seed(pool)}), "
            f"{len(domain.members)} member(s)",
            file=out,
        )
        problems = validate_domain(pool, domain.members)
        for problem in problems:
            print(f"  {problem}".replace("\n", "\n  "), file=out)
        for key, budget in memory_budgets(pool, domain.members).items():
            print(
                f"  memory {key}: {budget.formula} "
                f"(per instance {format_bytes(budget.per_instance_bytes)}; chunk "
                f"{format_bytes(budget.chunk_bytes_per_rank)}/rank; largest pod requests "
                f"{format_bytes(budget.pod_memory_request_bytes)})",
                file=out,
            )
        for filled in domain_defaults(pool, domain.members):
            print(f"  default {filled}", file=out)
        n_errors += len(errors(problems))
        n_warnings += len(warnings(problems))
    print(f"=> {n_errors} error(s), {n_warnings} warning(s)", file=out)
    return 1 if n_errors else 0


def cmd_render(
    files: Sequence[str], fmt: str, out: TextIO, err: TextIO, *, recursive: bool = False
) -> int:
    """Print the child objects of every domain; refuse (exit 1) if validation has errors."""
    loaded = load_files(files, recursive=recursive)
    domains = loaded.domains()
    failed = [str(e) for e in loaded.errors]
    for domain in domains:
        problems = validate_domain(domain.pool, domain.members)
        failed += [str(p) for p in errors(problems)]
        for warning in warnings(problems):
            print(warning, file=err)
    if failed:
        print("\n".join(failed), file=err)
        print("not rendering: fix the errors above (kvpool-operator validate -f ...)", file=err)
        return 1
    objects = [obj for d in domains for obj in render_domain(d.pool, d.members)]
    if fmt == "json":
        json.dump({"apiVersion": "v1", "kind": "List", "items": objects}, out, indent=2)
        out.write("\n")
    else:
        out.write(dump_all(objects))
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    """``up`` / ``down`` / ``demo``: the render as local processes (kvpool.operator.local)."""
    from kvpool.operator.local import up as local  # noqa: PLC0415 (processes: loaded on demand)
    from kvpool.operator.local.plan import StackError  # noqa: PLC0415

    state_dir = Path(args.state_dir or local.DEFAULT_STATE_DIR)
    try:
        if args.command == "demo":
            from kvpool.operator.local.demo import DemoError, run_demo  # noqa: PLC0415

            try:
                return run_demo(args.filename, state_dir, Path(args.plot), sys.stdout)
            except DemoError as exc:
                print(f"kvpool-operator demo: FAILED: {exc}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print("kvpool-operator demo: interrupted; every process stopped", file=sys.stderr)
                return 130
        if args.command == "down":
            return local.down(state_dir, sys.stdout)
        return local.up(
            args.filename,
            state_dir,
            sys.stdout,
            args.ready_timeout,
            args.skip,
            args.sim_host,
            args.monitoring,
        )
    except StackError as exc:
        print(f"kvpool-operator {args.command}: {exc}", file=sys.stderr)
        return 1


_FILE_HELP = "YAML/JSON file or directory (repeatable), - = stdin"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpool-operator`` console script."""
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["run"]:  # its flags are the settings class's (kvpool-operator run --help)
        from kvpool.operator.runtime.main import main as run  # noqa: PLC0415 (kopf on demand)

        return run(given[1:])
    if given[:1] == ["cluster"]:  # the local control plane (kmock, the kubelet): on demand
        from kvpool.operator.cluster.main import main as cluster  # noqa: PLC0415

        return cluster(given[1:])
    parser = argparse.ArgumentParser(
        prog="kvpool-operator", description="Validate and render kvpool cache domains offline."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="print every problem of the given resources")
    v.add_argument("-f", "--filename", action="append", required=True, help=_FILE_HELP)
    v.add_argument("-R", "--recursive", action="store_true", help="read -f directories deeply")
    sub.add_parser("run", help="run the operator in a cluster (kopf; see run --help)")
    sub.add_parser(
        "cluster", help="a local Kubernetes control plane for one machine (see cluster --help)"
    )
    r = sub.add_parser("render", help="print the Kubernetes objects the operator would create")
    r.add_argument("-f", "--filename", action="append", required=True, help=_FILE_HELP)
    r.add_argument("-R", "--recursive", action="store_true", help="read -f directories deeply")
    r.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    u = sub.add_parser("up", help="run the render as local processes on 127.0.0.1 until Ctrl-C")
    u.add_argument("-f", "--filename", action="append", required=True, help="YAML file")
    u.add_argument("--state-dir", default=None, help="state file and logs (default .kvpool/up)")
    u.add_argument("--ready-timeout", type=float, default=300.0, help="seconds per workload")
    u.add_argument("--skip", action="append", default=[], help="a workload not to start")
    u.add_argument(
        "--sim-host",
        action="store_true",
        help="run every simulated instance (engine.sim) of a domain in one `kvpool-worker "
        "host` process instead of one process per pod",
    )
    u.add_argument(
        "--monitoring",
        action="store_true",
        help="also run Prometheus on 127.0.0.1, scraping the domain as the chart's "
        "ServiceMonitors would and evaluating the chart's alerts (needs Debian's prometheus)",
    )
    d = sub.add_parser("down", help="stop everything a running `up` started")
    d.add_argument("--state-dir", default=None, help="the state dir given to up")
    m = sub.add_parser("demo", help="up, replay an agent workload through the gateway, down")
    m.add_argument("-f", "--filename", action="append", required=True, help="YAML file")
    m.add_argument("--state-dir", default=None, help="state file and logs (default .kvpool/up)")
    m.add_argument("--plot", default="bench-results/demo.png", help="PNG written at the end")
    args = parser.parse_args(argv)
    if args.command == "validate":
        return cmd_validate(args.filename, sys.stdout, recursive=args.recursive)
    if args.command in ("up", "down", "demo"):
        return cmd_local(args)
    return cmd_render(args.filename, args.output, sys.stdout, sys.stderr, recursive=args.recursive)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
