"""``kvpool-operator up --monitoring``: a real Prometheus over the local domain.

Why: the chart's ServiceMonitors and alerts are only worth something if a real Prometheus,
scraping real components, gets series for every dashboard and alert out of them. Here the
Debian ``prometheus`` (2.x) runs as one more process of the stack, on 127.0.0.1 and a free
port, with the scrape configuration ``kvpool.operator.monitoring.scrape`` derives from the
same definition as the ServiceMonitors (targets carry the labels Kubernetes discovery would
give, the rules are the Prometheus Operator's plus the chart's) and the chart's alerts file.
Its TSDB lives in ``<state-dir>/prometheus``; ``down`` and Ctrl-C stop it with the rest.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from kvpool.operator.local.plan import LOOPBACK, Obj, StackError
from kvpool.operator.local.rewrite import LocalWorkload
from kvpool.operator.local.stack import LocalStack, Running, free_port
from kvpool.operator.monitoring import alerts, scrape

NAME = "prometheus"
COMPONENT = "monitoring"
#: Shorter than the chart's 15 s: a local check sees a rate within seconds.
LOCAL_INTERVAL = "2s"


def rules_file(repo_root: Path | None) -> str:
    """The chart's alerts file (as shipped); regenerated from the definitions when ``up`` runs
    outside a checkout."""
    if repo_root is not None and (repo_root / alerts.RULES_PATH).exists():
        return (repo_root / alerts.RULES_PATH).read_text(encoding="utf-8")
    return alerts.rules_yaml("")


def _repo_root() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        if (parent / "charts" / "kvpool").is_dir():
            return parent
    return None


def prometheus_workload(
    stack: LocalStack, objects: Sequence[Obj], interval: str = LOCAL_INTERVAL
) -> LocalWorkload:
    """Prometheus' command line and files for the stack's domain (nothing started)."""
    if shutil.which(NAME) is None:
        raise StackError(
            "--monitoring runs Prometheus, and it is not installed: apt-get install -y "
            "prometheus (tools/ensure-system-deps.sh installs it without starting its service)"
        )
    root = stack.root / NAME
    rules = str(root / "alerts.yaml")
    config = scrape.prometheus_config(objects, stack.cmap.ports, interval, [rules])
    port = free_port()
    argv = [
        NAME,
        f"--config.file={root / 'prometheus.yml'}",
        f"--storage.tsdb.path={root / 'data'}",
        "--storage.tsdb.retention.time=1d",
        f"--web.listen-address={LOOPBACK}:{port}",
        "--web.enable-lifecycle",
        "--log.level=warn",
    ]
    files = {
        str(root / "prometheus.yml"): yaml.safe_dump(config, sort_keys=False),
        rules: rules_file(_repo_root()),
    }
    return LocalWorkload(NAME, COMPONENT, argv, {}, files, {}, {"http": port}, ("/-/ready", port))


def start_prometheus(
    stack: LocalStack,
    objects: Sequence[Obj],
    timeout_s: float,
    say: Callable[[str], None],
    cancelled: Callable[[], bool],
) -> Running:
    """Start Prometheus as a process of ``stack`` (supervised and stopped with it) and wait
    until it is ready."""
    run = stack.start(prometheus_workload(stack, objects))
    took = stack.wait_ready(run, timeout_s, say, cancelled)
    say(f"prometheus ready after {took:.1f}s at {run.url} (scrapes every {LOCAL_INTERVAL})")
    return run
