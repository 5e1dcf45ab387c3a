"""``python -m chaos`` (from e2e/; ``make chaos``): the chaos suite under load.

Why this module exists: it is the command. It names the two runs (the full one: the reference
domain and the simulated fleet, every component killed in turn, a worker frozen and one cut
off; the reduced one the e2e suite runs: the fleet alone, one fault of each kind), enters a
network namespace of its own first (:mod:`chaos.netns`: the cut needs a packet filter, which
must not touch the shared machine), turns SIGTERM into the same clean stop as Ctrl-C, and
writes the report: JSON (``metrics.lost``, ``metrics.hung``, ``metrics.wrong``,
``recovery_s.<fault>``, every fault's per-stream figures) and the Markdown table. Exit status
0 when lost, hung and wrong are all 0, 1 otherwise, 2 when the run could not be made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from chaos import entry, netns
from chaos.faults import Fault
from chaos.measure import markdown
from chaos.suite import Plan, Run
from chaos.workload import StreamSpec

HERE = Path(__file__).resolve().parent
REFERENCE, FLEET = HERE / "reference.yaml", HERE / "fleet.yaml"
REDIS = "redis-chaos-redis.default.svc-6379"  # up's name for the Redis the pool names

P2P = StreamSpec("chaos", "chaos", "chaos-gateway", rate=0.75, tenants=4, questions=6,
                 system_blocks=2, question_blocks=2, block=256, output_tokens=8)  # fmt: skip
PD = StreamSpec("chaos-pd", "chaos", "chaos-gateway", rate=0.2, tenants=4, questions=6,
                system_blocks=2, question_blocks=2, block=256, output_tokens=8,
                headers={"x-kvpool-pd": "chaos-pd"}, warm=False)  # fmt: skip
SIM = StreamSpec("chaossim", "chaossim", "chaossim-gateway", rate=4.0, tenants=8, questions=8,
                 system_blocks=4, question_blocks=2, block=256, output_tokens=16)  # fmt: skip

#: the reduced run's: fewer prompts, so the warm-up that visits each once is short
SIM_FEW = dataclasses.replace(SIM, tenants=4, questions=6)
BOTH = ("chaos", "chaossim")
FULL = Plan(
    files=(REFERENCE, FLEET),
    streams=(P2P, PD, SIM),
    faults=(
        Fault(
            "worker-kill",
            "kill",
            ("chaos-p2p-1", "chaossim-sim-1"),
            what="a worker pod dies (one of each domain)",
        ),
        Fault(
            "redis-kill", "kill", (REDIS,), what="the controller's Redis dies (comes back empty)"
        ),
        Fault(
            "controller-kill",
            "kill",
            ("chaos-controller", "chaossim-controller"),
            what="the controller dies (Redis recovery; full-sync recovery)",
        ),
        Fault(
            "gateway-kill",
            "kill",
            ("chaos-gateway", "chaossim-gateway"),
            what="the gateway dies (one replica)",
        ),
        Fault(
            "mooncake-master-kill",
            "kill",
            ("chaos-mooncake-master",),
            what="the Mooncake master dies",
        ),
        Fault(
            "mooncake-store-kill",
            "kill",
            ("chaos-mooncake-store",),
            what="the Mooncake store (its memory segment) dies",
        ),
        Fault(
            "worker-freeze",
            "freeze",
            ("chaos-p2p-0", "chaossim-sim-2"),
            hold_s=20.0,
            what="a worker hangs 20 s (SIGSTOP): past its 3 s heartbeat and the 15 s purge",
        ),
        Fault(
            "worker-cut",
            "cut",
            ("chaos-p2p-1", "chaossim-sim-3"),
            hold_s=20.0,
            what="a worker's network is partitioned for 20 s",
        ),
        Fault(
            "pd-decoder-kill",
            "kill",
            ("chaos-pd-decode-0",),
            what="the PD pair's decoder dies (last: see the report)",
        ),
    ),
    fault_domains={
        "worker-kill": BOTH,
        "pd-decoder-kill": ("chaos",),
        "redis-kill": ("chaos",),
        "controller-kill": BOTH,
        "gateway-kill": BOTH,
        "mooncake-master-kill": ("chaos",),
        "mooncake-store-kill": ("chaos",),
        "worker-freeze": BOTH,
        "worker-cut": BOTH,
    },
)
REDUCED = Plan(
    files=(FLEET,),
    streams=(SIM_FEW,),
    faults=(
        Fault("worker-kill", "kill", ("chaossim-sim-1",), what="a worker pod dies"),
        Fault(
            "controller-kill",
            "kill",
            ("chaossim-controller",),
            what="the controller dies (full-sync recovery)",
        ),
        Fault("gateway-kill", "kill", ("chaossim-gateway",), what="the gateway dies"),
        Fault(
            "worker-freeze",
            "freeze",
            ("chaossim-sim-2",),
            hold_s=5.0,
            what="a worker hangs 5 s (SIGSTOP): past its 3 s heartbeat",
        ),
        Fault(
            "worker-cut",
            "cut",
            ("chaossim-sim-3",),
            hold_s=5.0,
            what="a worker's network is partitioned for 5 s",
        ),
    ),
    fault_domains={
        n: ("chaossim",)
        for n in ("worker-kill", "controller-kill", "gateway-kill", "worker-freeze", "worker-cut")
    },
    steady_s=5.0,
    gap_s=1.0,
    recovery_cap_s=30.0,
    reduced=True,
)


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m chaos", description=doc)
    p.add_argument("--reduced", action="store_true", help="the e2e suite's run (fleet only)")
    p.add_argument("--out", type=Path, default=Path("../bench-results/chaos.json"))
    p.add_argument("--workdir", type=Path, help="state and logs (default: a temporary dir)")
    p.add_argument("--sim-trace", type=Path, help="a Mooncake-format trace for the fleet")
    p.add_argument("--sim-time-scale", type=float, default=1.0)
    p.add_argument("--no-netns", action="store_true",
                   help="stay in this network namespace (the cut is then not run)")  # fmt: skip
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    status = entry.enter_namespace("chaos", argv, args.no_netns)
    if status is not None:
        return status
    plan = REDUCED if args.reduced else FULL
    if plan.sim_trace is None and args.sim_trace is not None:
        plan = dataclasses.replace(
            plan, sim_trace=args.sim_trace.resolve(), sim_time_scale=args.sim_time_scale
        )
    why_not = netns.nft_available()
    if netns.in_namespace():
        netns.setup(with_lan=REFERENCE in plan.files)
    elif why_not is None:
        why_not = "not in the suite's own network namespace (--no-netns)"
    if why_not is not None:
        print(f"chaos: the network cut is not run: {why_not}", file=sys.stderr)
        plan = dataclasses.replace(plan, faults=tuple(f for f in plan.faults if f.kind != "cut"))
    entry.interrupt_on_sigterm()
    out = args.out.resolve()
    with tempfile.TemporaryDirectory(prefix="kvpool-chaos-") as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        run = Run(plan, workdir, entry.say)
        try:
            doc = run.execute()
        except KeyboardInterrupt:
            entry.say("chaos: interrupted; every process stopped")
            return 130
    reqs = out.with_suffix(".requests.jsonl")
    reqs.parent.mkdir(parents=True, exist_ok=True)
    reqs.write_text("".join(json.dumps(r) + "\n" for r in run.requests()), encoding="utf-8")
    doc["env"]["requests_file"] = str(reqs)
    if why_not is not None:
        doc["env"]["cut_not_run"] = why_not
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    table = markdown(doc)
    out.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table)
    m = doc["metrics"]
    return 0 if m["lost"] == m["hung"] == m["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
