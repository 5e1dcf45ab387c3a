"""``kvpool-operator cluster demo`` (``make demo-cluster``): the demo through Helm and kubectl.

Why: ``make demo`` runs the render directly (``kvpool-operator up``); this runs the same agent
workload (``local.demo``) through the path a user takes on a cluster: ``kvpool-operator cluster
up``, ``helm install kvpool charts/kvpool`` through Helm's own install action, ``kubectl apply
-f`` the domain with client-side validation, ``kubectl wait`` until the operator reports it
Ready, ``kubectl get`` of the three kinds, then the workload against the processes the
cluster's kubelet runs for the operator's pods. Everything stops at the end (also on Ctrl-C).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from kvpool.operator.cluster.main import ClusterProcess
from kvpool.operator.local.demo import Demo, DemoError, domain_of, report

_KINDS = {"configmaps": "ConfigMap", "deployments": "Deployment", "statefulsets": "StatefulSet"}
READY_S = 900.0  # four reference workers loading torch and LMCache on a shared 2-core box


class Kubectl:
    """The real kubectl binary, bound to one kubeconfig; each call echoed like a terminal."""

    def __init__(self, kubeconfig: str, out: TextIO) -> None:
        found = shutil.which("kubectl")
        if found is None:
            raise DemoError("kubectl is not on PATH (https://kubernetes.io/docs/tasks/tools/)")
        self.binary, self.kubeconfig, self.out = found, kubeconfig, out

    def __call__(self, *args: str, echo: bool = True, timeout: float = 120.0) -> str:
        if echo:
            print(f"$ kubectl {' '.join(args)}", file=self.out, flush=True)
        done = subprocess.run(
            [self.binary, *args],
            env={**os.environ, "KUBECONFIG": self.kubeconfig},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if echo:
            print((done.stdout + done.stderr).rstrip(), file=self.out, flush=True)
        if done.returncode != 0:
            raise DemoError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout


def helm_install(kubeconfig: str, chart: Path, out: TextIO) -> None:
    """``helm install kvpool charts/kvpool -n kvpool-system --create-namespace``."""
    try:
        import helm_python as helm  # noqa: PLC0415 (helm-python-sdk: Helm v4's Go SDK)
    except ImportError:
        raise DemoError("helm-python-sdk is not installed (make install)") from None
    print("$ helm install kvpool charts/kvpool -n kvpool-system --create-namespace", file=out)
    with helm.Config(kubeconfig_path=kubeconfig, namespace="kvpool-system") as cfg:
        release = cfg.install(
            chart, "kvpool", {}, namespace="kvpool-system", create_namespace=True, timeout=120
        )
    print(f"release kvpool: {release['status']}, revision {release['revision']}", file=out)


def endpoints(state: dict[str, Any], namespace: str) -> dict[str, str]:
    """Each workload (Deployment or StatefulSet) -> the URL of its running pod's http port
    (of its Service's proxy, for a Deployment of several replicas: the Ready ones, the
    controller's leader)."""
    out: dict[str, str] = {}
    for pod in (state.get("pods") or {}).get(namespace, {}).values():
        port = (pod.get("service_ports") or {}).get("http") or (pod.get("ports") or {}).get("http")
        if port:
            out[str(pod["owner"])] = f"http://127.0.0.1:{port}"
    return out


def run(files: Sequence[str], state_dir: Path, png: Path, chart: Path, out: TextIO) -> int:
    """The whole path, then the workload; every process stops at the end."""
    t0 = time.monotonic()
    docs = [d for f in files for d in yaml.safe_load_all(Path(f).read_text()) if d]
    pool = next((d for d in docs if d.get("kind") == "KVCachePool"), None)
    if pool is None:
        raise DemoError("no KVCachePool in the given files")
    ns = pool["metadata"].get("namespace", "default")
    members = [
        f"{d['kind'].lower()}/{d['metadata']['name']}"
        for d in docs
        if d.get("kind") in ("P2PGroup", "PDPair")
    ]
    print("demo: kvpool-operator cluster up", file=out, flush=True)
    with ClusterProcess(state_dir) as cluster:
        state = cluster.start()
        kubectl = Kubectl(state["kubeconfig"], out)
        helm_install(state["kubeconfig"], chart, out)
        kubectl(
            "wait",
            "--for=condition=Available",
            "deployment/kvpool-operator",
            "-n",
            "kvpool-system",
            "--timeout=300s",
            timeout=310,
        )
        kubectl("apply", *[a for f in files for a in ("-f", f)])
        wait = f"--timeout={READY_S:.0f}s"
        kubectl(
            "wait",
            "--for=condition=Ready",
            f"kvcachepool/{pool['metadata']['name']}",
            *members,
            "-n",
            ns,
            wait,
            timeout=READY_S + 10,
        )
        selector = f"kvpool.io/pool={pool['metadata']['name']}"
        deployments = yaml.safe_load(
            kubectl("get", "deployments", "-n", ns, "-l", selector, "-o", "json", echo=False)
        )
        for deployment in deployments["items"]:  # the gateway rolls once the PD pair is ready
            kubectl(
                "rollout",
                "status",
                f"deployment/{deployment['metadata']['name']}",
                "-n",
                ns,
                wait,
                timeout=READY_S + 10,
            )
        kubectl("get", "kvcachepools,p2pgroups,pdpairs", "-n", ns)
        kubectl("get", "pods", "-n", ns, "-o", "wide")
        objects: list[dict[str, Any]] = []
        for kind in ("configmaps", "deployments", "statefulsets"):
            listed = yaml.safe_load(
                kubectl(
                    "get",
                    kind,
                    "-n",
                    ns,
                    "-l",
                    selector,
                    "-o",
                    "json",
                    echo=False,
                )
            )
            objects += [{**o, "kind": o.get("kind") or _KINDS[kind]} for o in listed["items"]]
        urls = endpoints(cluster.state(), ns)
        print(
            f"demo: domain Ready through Helm and kubectl in {time.monotonic() - t0:.0f}s; "
            "replaying the agent workload",
            file=out,
            flush=True,
        )
        demo = Demo(
            domain_of(objects, {"endpoints": urls}), lambda line: print(line, file=out, flush=True)
        )
        demo.run()
        print("demo: stopping the cluster and every pod", file=out, flush=True)
    report(demo.turns, png, out)
    return 0
