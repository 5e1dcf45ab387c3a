"""Notice that a mounted file changed, by polling its identity.

Why this module exists: a Secret or ConfigMap mounted as a volume is updated in place by the
kubelet (it writes the new content into a new directory and swaps the ``..data`` symlink, so
the path keeps its name and gets a new inode), while the process keeps running. The gateway
reads such files again when they change — its API keys today (``apikeys``), its
configuration next — without inotify (a symlink swap in the parent directory is not an event
on the file, and the kubelet's own docs recommend polling). One poll is one ``stat``; what
"changed" means is here once: the file that the path resolves to now is not the one seen
last (device, inode, modification time or size differ), or it appeared or vanished.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Identity:
    """What one ``stat`` (through symlinks) says of the file a path names."""

    device: int
    inode: int
    mtime_ns: int
    size: int


def identity(path: Path) -> Identity | None:
    """The identity of the file ``path`` resolves to now; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Identity(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class FileWatch:
    """``changed()`` is True once for each change of the file at ``path`` since the last call
    (or since construction: the caller has just read the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = identity(path)

    def changed(self) -> bool:
        now = identity(self.path)
        if now == self._seen:
            return False
        self._seen = now
        return True


async def watch(watcher: FileWatch, interval_s: float, on_change: Callable[[], object]) -> None:
    """Forever: every ``interval_s``, ``on_change()`` when the file changed."""
    while True:
        await asyncio.sleep(interval_s)
        if watcher.changed():
            on_change()
