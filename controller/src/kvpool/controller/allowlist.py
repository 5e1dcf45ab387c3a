"""Which LMCache instance ids may register: the ids the operator rendered for the domain.

Why: the controller's ZMQ sockets are not HTTP and carry no token, so anything that reaches
them could register an instance and admit chunks it does not hold. NetworkPolicies keep other
pods out, but not hostNetwork members (the usual Ascend layout), whose traffic comes from the
node. The operator knows every instance it renders (``<name>~<fingerprint>``); it renders them
into a ConfigMap mounted as ``--instances-file`` and sends each change to ``PUT
/v1/instances`` before it creates the pods that carry a new id. A registration of any other id
is refused (service.py), whatever its network.

The list changes by the latest of the two: a push replaces it, and the file replaces it when
its content changes (the kubelet updates a mounted ConfigMap within a minute or so, and a
controller that restarts reads it at once). With neither, every id is accepted, as before
(a standalone controller for development).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvpool.protocol.http_api import instances_of

logger = logging.getLogger(__name__)
#: How often the controller re-reads its ``--instances-file`` for a change (seconds).
FILE_POLL_S = 5.0


class AllowlistError(ValueError):
    """An allowlist that cannot be read or parsed; the message names the file and the fix."""


@dataclass
class Allowlist:
    """The instance ids that may register; ``ids`` None: never given, every id may."""

    ids: frozenset[str] | None = None
    source: str = "none"

    def allows(self, instance_id: str) -> bool:
        return self.ids is None or instance_id in self.ids

    def replace(self, ids: list[str], source: str) -> None:
        new = frozenset(ids)
        if new != self.ids:
            added = sorted(new - (self.ids or frozenset()))
            logger.info(
                "instance allowlist from %s: %d id(s)%s",
                source,
                len(new),
                f", new: {', '.join(added[:10])}" if added and self.ids is not None else "",
            )
        self.ids, self.source = new, source

    def describe(self) -> dict[str, object]:
        """The list as ``GET /v1/instances`` shows it (``instance_ids`` null: not enforced)."""
        ids = None if self.ids is None else sorted(self.ids)
        return {"instance_ids": ids, "source": self.source}


def parse(text: str, where: str) -> list[str]:
    """The ids of an allowlist file (JSON or YAML: ``{"instance_ids": [...]}``)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AllowlistError(f"{where}: not JSON or YAML ({exc})") from None
    try:
        return instances_of(data)
    except ValueError as exc:
        raise AllowlistError(f"{where}: {exc}") from None


class AllowlistFile:
    """The ``--instances-file``: read at start, then applied again whenever its text changes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._text: str | None = None
        self._warned = False

    def read(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise AllowlistError(
                f"--instances-file {self.path}: cannot read it ({exc.strerror}); mount the "
                "controller's ConfigMap there or drop the flag"
            ) from None

    def load(self, allowlist: Allowlist) -> None:
        """Apply the file now (at start: an unreadable or malformed file is an error)."""
        text = self.read()
        allowlist.replace(parse(text, f"--instances-file {self.path}"), "file")
        self._text = text

    def poll(self, allowlist: Allowlist) -> bool:
        """Apply the file if its text changed since it was last applied; a file that cannot be
        read or parsed now keeps the list as it is (logged once). True when applied."""
        try:
            text = self.read()
            if text == self._text:
                return False
            ids = parse(text, f"--instances-file {self.path}")
        except AllowlistError as exc:
            if not self._warned:
                logger.warning("%s; keeping the allowlist as it is", exc)
                self._warned = True
            return False
        self._warned = False
        self._text = text
        allowlist.replace(ids, "file")
        return True
