"""The kubelet of ``kvpool-operator cluster``: every pod bound to the node runs as a local process.

Why: the operator's children only mean something when they run. This kubelet runs each pod
through ``kvpool-operator up``'s runner (``local.plan``, ``local.rewrite``, ``local.stack``):
the container's command and env as rendered, its ConfigMap files and emptyDir volumes under
the pod's directory, what the cluster gives a pod beyond its spec (``podenv``: its Secrets'
values, the downward API, a kubeconfig with its service account's token, the service proxy),
and every cluster address (Service and pod DNS names, container ports) rewritten to
127.0.0.1 and a local port, checked by ``check_rewrite`` to be nothing but that. It probes the
rendered readiness probe and writes the pod's status (Ready, restarts, the last exit code,
CrashLoopBackOff), restarts a process that exits (``restartPolicy: Always``, doubling backoff),
stops the process when the pod is deleted (SIGTERM, SIGKILL after the grace period) and then
completes the deletion. A running pod's ConfigMap files follow their ConfigMap, as a real
kubelet updates them (each file replaced at once: a reader sees the old or the new content,
never half; a real kubelet swaps a ``..data`` symlink instead), so a process that re-reads its
mounted config sees the change without a restart.

One machine means one network namespace: every pod of a namespace shares its ports, so two pods
whose containers use the same port cannot run together; the second one waits (PortsInUse). The
pods of a Deployment of several replicas are the exception (``endpoints``): each binds the ports
of its own replica slot, and the Deployment's Service is a proxy to the ones that are Ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from kvpool.operator.cluster import workloads
from kvpool.operator.cluster.endpoints import (
    PODS,
    SERVICES,
    ServiceProxies,
    backend,
    describe,
    eligible,
    free_slot,
    owner_deployment,
)
from kvpool.operator.cluster.podenv import downward_fields, pod_env, secret_values
from kvpool.operator.cluster.store import Obj, Res, Store, StoreError, now_stamp
from kvpool.operator.local.balance import Balanced, balanced_services
from kvpool.operator.local.plan import (
    LOOPBACK,
    ClusterMap,
    StackError,
    cluster_map,
    workload_of,
)
from kvpool.operator.local.rewrite import LocalWorkload, unresolved
from kvpool.operator.local.stack import LocalStack, Running, free_port

log = logging.getLogger(__name__)
CONFIGMAPS = Res("", "v1", "configmaps")
SECRETS = Res("", "v1", "secrets")
STATEFULSETS = Res("apps", "v1", "statefulsets")
DEPLOYMENTS = Res("apps", "v1", "deployments")
MAX_GRACE_S = 30.0


@dataclass
class PodRun:
    """One pod on this node: what runs for it and what its status says."""

    namespace: str
    name: str
    uid: str
    container: workloads.Container
    ports: dict[int, int] = field(default_factory=dict)  # container port -> the local port bound
    deployment: str | None = None  # the Deployment of several replicas whose slot it holds
    slot: int | None = None  # its replica slot, for the pod's lifetime
    probe: tuple[str, int] | None = None  # readiness GET path, local port
    period_s: float = 5.0
    failure_threshold: int = 3
    failures: int = 0
    next_probe: float = 0.0
    next_try: float = 0.0  # a pod that could not start is tried again from then
    stopping: bool = False
    exited_seen: bool = False


@dataclass
class Kubelet:
    """Runs the node's pods; ``token_for(namespace, service account)`` issues API tokens."""

    store: Store
    root: Path
    api_url: str
    proxy_url: str
    token_for: Callable[[str, str], str]
    ca_pem: bytes
    runs: dict[str, PodRun] = field(default_factory=dict)  # by pod uid
    stacks: dict[str, LocalStack] = field(default_factory=dict)  # by namespace
    ports: dict[str, dict[int, int]] = field(default_factory=dict)  # namespace -> port map
    #: namespace -> Deployment of several replicas -> each replica slot's port map
    replica_ports: dict[str, dict[str, tuple[dict[int, int], ...]]] = field(default_factory=dict)
    proxies: ServiceProxies = field(init=False)
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    #: a ConfigMap or Service changed: the mounted files of running pods are compared again
    mounts_dirty: bool = False
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _warned: set[str] = field(default_factory=set)
    _http: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self.proxies = ServiceProxies(self._eligible)

    def start(self) -> None:
        self.store.listeners.append(self._changed)

    def _changed(self, res: Res, _etype: str, _obj: Obj) -> None:
        if res in (PODS, SERVICES, CONFIGMAPS, SECRETS):
            self.dirty.set()
        if res in (SERVICES, CONFIGMAPS):
            self.mounts_dirty = True

    async def run(self, stop: asyncio.Event) -> None:
        """Sync after every change and probe every few hundred milliseconds until ``stop``."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.dirty.wait(), 0.3)
                self.dirty.clear()
                try:
                    self.sync()
                    await self.probe()
                    await self.proxies.sync(self._balanced())
                except Exception:  # a bug must not stop the node: log it, go on
                    log.exception("kubelet pass failed")
        finally:
            await self._http.close()

    # -- pods ------------------------------------------------------------------------------------
    def stack(self, namespace: str) -> LocalStack:
        if namespace not in self.stacks:
            self.stacks[namespace] = LocalStack([], self.root / namespace)
        return self.stacks[namespace]

    def sync(self) -> None:
        """Start pods bound here, stop deleted ones, restart exited processes, report."""
        pods = {
            p["metadata"]["uid"]: p
            for p in self.store.list(PODS)
            if (p.get("spec") or {}).get("nodeName") == workloads.NODE
        }
        for uid, running in list(self.runs.items()):
            if uid not in pods and not running.stopping:
                self._stop(running, delete=False)
        for uid, pod in pods.items():
            run = self.runs.get(uid)
            if pod["metadata"].get("deletionTimestamp"):
                if run is not None and not run.stopping:
                    self._stop(
                        run,
                        delete=True,
                        grace=float(pod["metadata"].get("deletionGracePeriodSeconds", 30)),
                    )
                elif run is None:
                    self._finish_delete(pod["metadata"]["namespace"], pod["metadata"]["name"], uid)
                continue
            waiting = run is not None and run.container.pid is None
            if run is None or (waiting and time.monotonic() >= run.next_try):
                self._start(pod, run)
        for stack in self.stacks.values():
            stack.supervise()
        for run in self.runs.values():
            self._observe(run)
        if self.mounts_dirty:
            self.mounts_dirty = False
            for uid, run in self.runs.items():
                if run.container.pid is not None and not run.stopping and uid in pods:
                    self._refresh_mounts(run, pods[uid])

    def _start(self, pod: Obj, previous: PodRun | None) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        (container, *_) = spec["containers"]
        run = previous or PodRun(
            ns,
            name,
            meta["uid"],
            workloads.Container(container["name"], str(container.get("image", "")), "waiting"),
        )
        self.runs[meta["uid"]] = run
        probe = container.get("readinessProbe") or {}
        run.period_s = float(probe.get("periodSeconds", 10))
        run.failure_threshold = int(probe.get("failureThreshold", 3))
        numbers = sorted({int(p["containerPort"]) for p in container.get("ports", [])})
        try:
            cmap = self._cluster_map(ns)
            if not self._take_slot(run, pod, cmap):
                return
            own = self._own(run, cmap).own_ports
            run.ports = {n: own.get(n, n) for n in numbers}
            holder = self._port_holder(run)
            if holder is not None:
                self._wait(
                    run,
                    "PortsInUse",
                    f"container port(s) {numbers} are held by {holder} (one machine: the pods "
                    "of a namespace share 127.0.0.1)",
                )
                return
            lw = self._localize(pod, run)
        except (StackError, KeyError, ValueError) as exc:
            self._wait(run, "CreateContainerConfigError", str(exc).splitlines()[0])
            return
        missing = unresolved(lw)
        if missing:  # a Service not created yet: this process could never reach it
            self._wait(run, "ContainerCreating", f"waiting for the Service of {missing[0]}")
            return
        lw.env.update(self._pod_env(ns, name, str(spec.get("serviceAccountName", "default"))))
        try:
            proc = self.stack(ns).start(lw, run.container.restarts)
        except (StackError, OSError) as exc:
            self._wait(run, "RunContainerError", str(exc))
            return
        run.probe = lw.readiness
        run.container.state, run.container.reason, run.container.message = "running", "", ""
        run.container.pid, run.container.started_at = proc.proc.pid, now_stamp()
        run.next_probe = 0.0
        log.info("pod %s/%s started (pid %d)", ns, name, proc.proc.pid)
        self._report(run)

    def _take_slot(self, run: PodRun, pod: Obj, cmap: ClusterMap) -> bool:
        """Give a pod of a Deployment of several replicas its replica slot (kept until its
        process has stopped); False when every slot is held: the pod waits."""
        deployment = owner_deployment(pod)
        if run.slot is not None or deployment is None or deployment not in cmap.replicas:
            return True
        held = [
            r
            for r in self.runs.values()
            if r is not run and r.namespace == run.namespace and r.deployment == deployment
        ]
        slot = free_slot(
            {r.slot for r in held if r.slot is not None}, len(cmap.replicas[deployment])
        )
        if slot is None:
            names = ", ".join(sorted(r.name for r in held))
            self._wait(
                run,
                "PortsInUse",
                f"every replica slot of Deployment {deployment} is held (pods {names}): "
                "each replica binds its own ports here; this pod starts when one has stopped",
            )
            return False
        run.deployment, run.slot = deployment, slot
        return True

    def _own(self, run: PodRun, cmap: ClusterMap) -> ClusterMap:
        """The map ``run`` is localized with: its replica slot's ports, or the namespace's."""
        if run.slot is None or run.deployment is None:
            return cmap
        return cmap.for_replica(run.deployment, run.slot)

    def _localize(self, pod: Obj, run: PodRun) -> LocalWorkload:
        """The pod's container as it runs here, from the ConfigMaps, Services and Secrets of
        its namespace as they are now (on its replica slot's ports, if it holds one)."""
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        stack = self.stack(ns)
        configmaps = {
            c["metadata"]["name"]: c.get("data") or {} for c in self.store.list(CONFIGMAPS, ns)
        }
        labels = dict(meta.get("labels") or {})
        stack.rendered[name] = workload_of(name, labels, spec, configmaps)
        stack.cmap = self._own(run, self._cluster_map(ns))
        stack.secrets.update(secret_values(self.store.list(SECRETS, ns)))
        return stack.prepare(name, fields=downward_fields(pod))

    def _refresh_mounts(self, run: PodRun, pod: Obj) -> None:
        """Bring a running pod's ConfigMap files up to date (what a kubelet does every sync
        period); a file naming a Service that does not exist yet waits for it."""
        try:
            lw = self._localize(pod, run)
        except (StackError, KeyError, ValueError) as exc:
            log.warning("pod %s/%s: mounted files not updated: %s", run.namespace, run.name, exc)
            return
        if unresolved(lw):
            self.mounts_dirty = True  # again once the Service exists
            return
        for path in self.stack(run.namespace).update_files(lw):
            log.info("pod %s/%s: %s updated from its ConfigMap", run.namespace, run.name, path)

    def _port_holder(self, run: PodRun) -> str | None:
        """Another pod of the namespace whose process holds one of ``run``'s local ports (one
        that is stopping still does, until its process exits), or a Service's proxy."""
        mine = set(run.ports.values())
        for other in self.runs.values():
            if (
                other is not run
                and other.namespace == run.namespace
                and other.container.pid is not None
                and mine & set(other.ports.values())
            ):
                return f"pod {other.name}"
        proxied = self.proxies.held(run.namespace)
        for port in sorted(mine & set(proxied)):
            return f"the proxy of Service {proxied[port]}"
        return None

    def _objects(self, ns: str) -> list[Obj]:
        return (
            self.store.list(SERVICES, ns)
            + self.store.list(STATEFULSETS, ns)
            + self.store.list(DEPLOYMENTS, ns)
        )

    def _cluster_map(self, ns: str, objects: list[Obj] | None = None) -> ClusterMap:
        """The namespace's addresses: its port map and each Deployment of several replicas'
        slot maps, both kept as pods come and go. A Deployment scaled down to one keeps its
        slots (and its Service's proxy) while a pod still holds one."""
        objects = self._objects(ns) if objects is None else objects
        known = self.ports.setdefault(ns, {})
        kept = self.replica_ports.get(ns, {})
        cmap = cluster_map(objects, free_port, (), known, kept)
        known.update(cmap.ports)
        live = {
            r.deployment for r in self.runs.values() if r.namespace == ns and r.slot is not None
        }
        several = {
            o["metadata"]["name"] for o in objects if o.get("kind") == "Deployment"
            and int((o.get("spec") or {}).get("replicas", 1)) > 1
        }  # fmt: skip
        replicas = {
            name: tuple(dict(m) for m in maps)
            for name, maps in cmap.replicas.items()
            if name in several or name in live
        }
        self.replica_ports[ns] = replicas
        return replace(cmap, replicas=replicas)

    def _balanced(self) -> dict[str, list[Balanced]]:
        """Per namespace with pods, the Services in front of a Deployment of several replicas."""
        out: dict[str, list[Balanced]] = {}
        for ns in sorted({r.namespace for r in self.runs.values()}):
            objects = self._objects(ns)
            try:
                out[ns] = balanced_services(objects, self._cluster_map(ns, objects))
            except StackError as exc:  # e.g. two pools' ports clash: the proxies stay as they are
                out[ns] = self.proxies.current(ns)
                if str(exc) not in self._warned:
                    self._warned.add(str(exc))
                    log.warning("namespace %s: Service proxies not updated: %s", ns, exc)
        return out

    def _pod_env(self, ns: str, name: str, account: str) -> dict[str, str]:
        return pod_env(
            self.root / ns / name / "serviceaccount" / "kubeconfig",
            api_url=self.api_url,
            proxy_url=self.proxy_url,
            namespace=ns,
            account=account,
            token=self.token_for(ns, account),
            ca_pem=self.ca_pem,
        )

    def _wait(self, run: PodRun, reason: str, message: str) -> None:
        run.next_try = time.monotonic() + 1.0
        run.container.state, run.container.reason, run.container.message = (
            "waiting",
            reason,
            message,
        )
        run.container.pid, run.container.ready = None, False
        self._report(run)

    def _observe(self, run: PodRun) -> None:
        """Notice an exit (CrashLoopBackOff until the stack restarts it) or a restart."""
        if run.stopping or run.container.pid is None:
            return
        current = self.stack(run.namespace).running.get(run.name)
        if current is None:
            return
        if current.proc.poll() is not None and not run.exited_seen:
            run.exited_seen = True
            run.container.last_exit = current.proc.returncode
            run.container.finished_at = now_stamp()
            run.container.state, run.container.reason, run.container.ready = (
                "waiting",
                "CrashLoopBackOff",
                False,
            )
            run.container.message = f"back-off restarting failed container {run.container.name}"
            self._report(run)
        elif current.proc.poll() is None and current.proc.pid != run.container.pid:
            run.exited_seen = False
            run.container.restarts = current.restarts
            run.container.pid, run.container.started_at = current.proc.pid, now_stamp()
            run.container.state, run.container.reason, run.container.message = "running", "", ""
            run.failures, run.next_probe = 0, 0.0
            self._report(run)

    def _stop(self, run: PodRun, delete: bool, grace: float = 30.0) -> None:
        run.stopping = True
        stack = self.stack(run.namespace)

        async def stop() -> None:
            await asyncio.to_thread(stack.stop, run.name, min(grace, MAX_GRACE_S))
            self.runs.pop(run.uid, None)
            if delete:
                self._finish_delete(run.namespace, run.name, run.uid)
            self.dirty.set()

        task = asyncio.get_running_loop().create_task(stop())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _finish_delete(self, ns: str, name: str, uid: str) -> None:
        pod = self.store.find(PODS, ns, name)
        if pod is not None and pod["metadata"].get("uid") == uid:
            with contextlib.suppress(StoreError):
                self.store.delete(PODS, ns, name, grace=0)

    # -- readiness -------------------------------------------------------------------------------
    async def probe(self) -> None:
        now = time.monotonic()
        due = [
            r
            for r in self.runs.values()
            if r.container.state == "running" and not r.stopping and now >= r.next_probe
        ]
        await asyncio.gather(*(self._probe(r, now) for r in due))

    async def _probe(self, run: PodRun, now: float) -> None:
        if run.probe is None:
            ready = True  # no readiness probe: Ready once running, as in Kubernetes
        else:
            ready = await self._get(run.probe[1], run.probe[0])
        # Until Ready, probe often (a pod is not waited on for a whole period); then by period.
        run.next_probe = now + (run.period_s if ready or run.container.ready else 1.0)
        if ready:
            run.failures = 0
        else:
            run.failures += 1
            if run.container.ready and run.failures < run.failure_threshold:
                return
        if ready != run.container.ready:
            run.container.ready = ready
            self._report(run)

    async def _get(self, port: int, path: str) -> bool:
        assert self._http is not None
        try:
            async with self._http.get(f"http://{LOOPBACK}:{port}{path}") as resp:
                return 200 <= resp.status < 400
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    def _report(self, run: PodRun) -> None:
        pod = self.store.find(PODS, run.namespace, run.name)
        if pod is None or pod["metadata"].get("uid") != run.uid:
            return
        status = workloads.pod_status(run.container, pod.get("status"), now_stamp())
        if status == pod.get("status"):
            return
        with contextlib.suppress(StoreError):
            self.store.replace(PODS, pod, {**pod, "status": status}, status=True)

    # -- services ----------------------------------------------------------------------------------
    async def resolve(self, ns: str, service: str, port: str) -> tuple[str, int] | None:
        """A ready backend of a Service port (by name or number; "" = the first port)."""
        return backend(self.store, self.runs.values(), ns, service, port)

    def _eligible(self, ns: str, service: Balanced, port: int) -> list[int]:
        return eligible(self.store, self.runs.values(), ns, service, port)

    def pod_log(self, ns: str, name: str) -> str | None:
        """The pod's log (``kubectl logs``): its process's output, the last megabyte."""
        stack = self.stacks.get(ns)
        run: Running | None = stack.running.get(name) if stack is not None else None
        if run is None:
            return None
        with contextlib.suppress(OSError):
            return run.log.read_text(errors="replace")[-1_000_000:]
        return None

    def endpoints(self) -> dict[str, Any]:
        """What runs where: each pod's pid, local ports, owner and replica slot, per namespace."""
        return describe(self.store, self.runs.values(), self.stacks, self.proxies)

    async def close(self) -> None:
        """Stop every pod's process (each namespace's stack in reverse start order)."""
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.proxies.close()
        for stack in self.stacks.values():
            await asyncio.to_thread(stack.close, 15.0)
