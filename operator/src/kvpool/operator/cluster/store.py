"""The API server's object store: versions, watch history, finalizers and garbage collection.

Why a module of its own: every writer (HTTP clients through the API server, and the in-process
controllers and kubelet, which skip HTTP) must go through the same bookkeeping a real API
server does, or kopf and kubectl see objects no cluster would produce:

- metadata stamping: uid, one monotonic resourceVersion for the whole store, generation
  (bumped only when spec changes), creationTimestamp, generateName;
- finalizers: a delete sets deletionTimestamp while finalizers remain, removing the last one
  deletes; pods on a node are deleted gracefully (their kubelet finishes the delete);
- ownerReference garbage collection: when an object goes, its dependents whose owners are all
  gone are deleted (``propagationPolicy: Orphan`` removes the reference instead);
- a bounded history per resource from which WATCH resumes at a resourceVersion, answering
  410 Gone ("too old resource version") for one older than the history, and BOOKMARKs.

Objects are plain JSON dicts; a stored version is never mutated (readers share it).
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import datetime
import json
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

Obj = dict[str, Any]


class Res(NamedTuple):
    """A resource: group ("" is the core group), version, plural."""

    group: str
    version: str
    plural: str


Key = tuple[str | None, str]  # (namespace, name)

#: Events kept per resource for WATCH to resume from; older resourceVersions are 410 Gone.
HISTORY = 20_000


class StoreError(Exception):
    """An API error: HTTP status, reason and message (rendered as a Status by the server)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def copy_json(obj: Obj) -> Obj:
    """A private copy of a JSON object (several times cheaper than deepcopy)."""
    out: Obj = json.loads(json.dumps(obj))
    return out


def now_stamp() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def not_found(res: Res, name: str) -> StoreError:
    qualified = f"{res[2]}.{res[0]}" if res[0] else res[2]
    return StoreError(404, "NotFound", f'{qualified} "{name}" not found')


@dataclass
class Watcher:
    """One open WATCH: its resource, namespace (None: all) and queue of events."""

    res: Res
    namespace: str | None
    queue: asyncio.Queue[Obj] = field(default_factory=asyncio.Queue)


@dataclass
class Store:
    """Every object of the cluster, by resource and (namespace, name)."""

    rv: int = 0
    objects: dict[Res, dict[Key, Obj]] = field(default_factory=dict)
    history: dict[Res, list[tuple[int, Obj]]] = field(default_factory=dict)
    watchers: list[Watcher] = field(default_factory=list)
    #: owner uid -> the (resource, key) of each object that names it in ownerReferences
    dependents: dict[str, set[tuple[Res, Key]]] = field(default_factory=dict)
    #: uid -> (resource, key) of every live object
    by_uid: dict[str, tuple[Res, Key]] = field(default_factory=dict)
    #: resources whose ``status`` is a subresource (the main endpoint ignores it)
    status_isolated: set[Res] = field(default_factory=set)
    #: called after every change with (resource, event type, object)
    listeners: list[Callable[[Res, str, Obj], None]] = field(default_factory=list)
    #: every event of every resource, in order (tests assert on it); None: not kept
    journal: list[tuple[int, Res, Obj]] | None = None

    # -- reading ---------------------------------------------------------------------------
    def get(self, res: Res, namespace: str | None, name: str) -> Obj:
        obj = self.objects.get(res, {}).get((namespace, name))
        if obj is None:
            raise not_found(res, name)
        return obj

    def find(self, res: Res, namespace: str | None, name: str) -> Obj | None:
        return self.objects.get(res, {}).get((namespace, name))

    def list(self, res: Res, namespace: str | None = None) -> list[Obj]:
        """Objects of ``res`` (in ``namespace``, or all), sorted by namespace and name."""
        found = [
            (key, obj)
            for key, obj in self.objects.get(res, {}).items()
            if namespace is None or key[0] == namespace
        ]
        return [obj for _k, obj in sorted(found, key=lambda kv: (str(kv[0][0]), kv[0][1]))]

    # -- events ------------------------------------------------------------------------------
    def _bump(self, obj: Obj) -> None:
        self.rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)

    def _index(self, res: Res, key: Key, old: Obj | None, new: Obj | None) -> None:
        for o, add in ((old, False), (new, True)):
            for ref in (o or {}).get("metadata", {}).get("ownerReferences") or []:
                deps = self.dependents.setdefault(str(ref.get("uid")), set())
                if add:
                    deps.add((res, key))
                else:
                    deps.discard((res, key))

    def _emit(self, res: Res, etype: str, obj: Obj) -> None:
        event = {"type": etype, "object": obj}
        res = Res(*res)
        if self.journal is not None:
            self.journal.append((self.rv, res, event))
        log = self.history.setdefault(res, [])
        log.append((self.rv, event))
        if len(log) > HISTORY:
            del log[: len(log) - HISTORY]
        meta = obj["metadata"]
        key = (meta.get("namespace"), meta["name"])
        live = self.objects.setdefault(res, {})
        old = live.get(key)
        if etype == "DELETED":
            live.pop(key, None)
            self.by_uid.pop(str(meta.get("uid")), None)
            self._index(res, key, old, None)
        else:
            live[key] = obj
            self.by_uid[str(meta.get("uid"))] = (res, key)
            self._index(res, key, old, obj)
        for w in self.watchers:
            if w.res == res and w.namespace in (None, meta.get("namespace")):
                w.queue.put_nowait(event)
        for listener in self.listeners:
            listener(res, etype, obj)

    # -- writing ---------------------------------------------------------------------------------
    def create(self, res: Res, namespace: str | None, body: Obj, *, commit: bool = True) -> Obj:
        obj = copy_json(body)
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise StoreError(
                422, "Invalid", "metadata.name: Required value: name or generateName is required"
            )
        if self.find(res, namespace, meta["name"]) is not None:
            raise StoreError(
                409,
                "AlreadyExists",
                f'{res[2]}{"." + res[0] if res[0] else ""} "{meta["name"]}" already exists',
            )
        if res in self.status_isolated:
            obj.pop("status", None)
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_stamp())
        for stale in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(stale, None)
        if not commit:
            return obj
        self._bump(obj)
        self._emit(res, "ADDED", obj)
        return obj

    def replace(
        self, res: Res, old: Obj, new: Obj, *, status: bool = False, commit: bool = True
    ) -> Obj:
        """Store ``new`` as the next version of ``old``: immutable metadata kept, status or
        everything but status taken from ``new`` (status subresource isolation), generation
        bumped on a spec change, deleted when its deletion waited only for finalizers."""
        new = copy_json(new)
        if res in self.status_isolated:
            if status:
                new = {**copy_json(old), "status": new.get("status")}
                if new["status"] is None:
                    new.pop("status")
            elif "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        expected = meta.get("resourceVersion")
        if expected and expected != old_meta.get("resourceVersion"):
            raise StoreError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {res[2]} "{old_meta["name"]}":'
                " the object has been modified; please apply your changes to the latest version "
                "and try again",
            )
        for immutable in (
            "uid",
            "name",
            "namespace",
            "creationTimestamp",
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ):
            if immutable in old_meta:
                meta[immutable] = old_meta[immutable]
            else:
                meta.pop(immutable, None)
        if new.get("spec") != old.get("spec"):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if new == old or not commit:
            return new if not commit else old
        self._bump(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._emit(res, "DELETED", new)
            self._collect(new)
            return new
        self._emit(res, "MODIFIED", new)
        return new

    def delete(
        self,
        res: Res,
        namespace: str | None,
        name: str,
        *,
        propagation: str = "Background",
        grace: int | None = None,
        precondition_uid: str | None = None,
        commit: bool = True,
    ) -> Obj:
        """Delete (or mark for deletion while finalizers remain, or while the kubelet stops a
        pod on a node: ``grace`` > 0) and collect the dependents."""
        obj = copy_json(self.get(res, namespace, name))
        meta = obj["metadata"]
        if precondition_uid and precondition_uid != meta.get("uid"):
            raise StoreError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: "
                f"{precondition_uid}, UID in object meta: {meta.get('uid')}",
            )
        graceful = res == ("", "v1", "pods") and (obj.get("spec") or {}).get("nodeName")
        if graceful and grace is None:
            grace = int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
        if meta.get("deletionTimestamp") and not (graceful and grace == 0):
            return obj
        if not commit:
            return obj
        if propagation == "Orphan":
            self._orphan(meta.get("uid", ""))
        if meta.get("finalizers") or (graceful and grace):
            meta["deletionTimestamp"] = meta.get("deletionTimestamp") or now_stamp()
            if graceful and grace:
                meta["deletionGracePeriodSeconds"] = grace
            self._bump(obj)
            self._emit(res, "MODIFIED", obj)
            return obj
        self._bump(obj)
        self._emit(res, "DELETED", obj)
        self._collect(obj)
        return obj

    def _orphan(self, uid: str) -> None:
        for res, (ns, name) in sorted(self.dependents.pop(uid, set()), key=str):
            dep = self.find(res, ns, name)
            if dep is None:
                continue
            refs = [r for r in dep["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
            new = copy_json(dep)
            new["metadata"]["ownerReferences"] = refs
            if not refs:
                new["metadata"].pop("ownerReferences")
            self._bump(new)
            self._emit(res, "MODIFIED", new)

    def _collect(self, gone: Obj) -> None:
        """Delete the dependents of ``gone`` whose owners are all gone (background GC)."""
        uid = str(gone["metadata"].get("uid", ""))
        for res, (ns, name) in sorted(self.dependents.pop(uid, set()), key=str):
            dep = self.find(res, ns, name)
            if dep is None:
                continue
            owners = [r.get("uid") for r in dep["metadata"].get("ownerReferences") or []]
            if any(self.alive(o) for o in owners if o != uid):
                continue
            self.delete(res, ns, name)

    def alive(self, uid: str | None) -> bool:
        """Whether an object with this uid exists (an owner still keeps its dependents)."""
        return bool(uid) and str(uid) in self.by_uid

    # -- watching --------------------------------------------------------------------------------
    def since(self, res: Res, namespace: str | None, rv: int) -> builtins.list[Obj]:
        """Events of ``res`` after ``rv``; StoreError 410 when the history no longer reaches it."""
        log = self.history.get(res, [])
        if log and rv < log[0][0] - 1 and len(log) >= HISTORY:
            raise StoreError(410, "Expired", f"too old resource version: {rv} ({log[0][0] - 1})")
        start = bisect.bisect_right(log, rv, key=lambda entry: entry[0])
        return [
            event
            for _rv, event in log[start:]
            if namespace in (None, event["object"]["metadata"].get("namespace"))
        ]

    def watch(self, res: Res, namespace: str | None) -> Watcher:
        w = Watcher(res, namespace)
        self.watchers.append(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        self.watchers.remove(w)


async def events(
    watcher: Watcher,
    backlog: Iterable[Obj],
    *,
    matches: Callable[[Obj], bool],
    bookmark: Callable[[], Obj] | None,
    bookmark_every_s: float,
    timeout_s: float | None,
    gone: Callable[[], bool],
) -> AsyncIterator[Obj]:
    """The events of one WATCH: the backlog, then live events, a BOOKMARK every
    ``bookmark_every_s`` when asked for, until ``timeout_s`` or the client hangs up."""
    loop = asyncio.get_running_loop()
    end = None if timeout_s is None else loop.time() + timeout_s
    for event in backlog:
        watcher.queue.put_nowait(event)
    next_mark = loop.time() + bookmark_every_s
    while end is None or loop.time() < end:
        if not watcher.queue.empty():
            event = watcher.queue.get_nowait()
        else:
            try:
                event = await asyncio.wait_for(watcher.queue.get(), 0.2)
            except TimeoutError:
                if gone():
                    return
                if bookmark is not None and loop.time() >= next_mark:
                    next_mark = loop.time() + bookmark_every_s
                    yield {"type": "BOOKMARK", "object": bookmark()}
                continue
        if matches(event["object"]):
            yield event
