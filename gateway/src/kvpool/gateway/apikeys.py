"""API keys: their format, the key file, and reloading it without a restart.

Why this module exists: the operator mounts the pool's ``spec.gateway.authSecretRef`` Secret
as a file (``KVPOOL_GATEWAY_AUTH_TOKEN_FILE``); rotating a key is editing that Secret, and the
kubelet updates the mounted file in place. The gateway watches it (``filewatch``) and swaps
its set of keys when the new content is valid. Content that is not (no key, a key with a
space or a control character, bytes that are not UTF-8, a file that vanished) never locks
every client out: the keys loaded before stay, and the log says what is wrong with the file
(once per change). At start a bad file is refused like a bad config (exit 2, naming it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


class KeyFileError(ValueError):
    """The key file cannot be used; the message says why, naming the file."""


def parse_keys(raw: str) -> frozenset[str]:
    """API keys: one, or several separated by commas or newlines (blanks ignored)."""
    return frozenset(k.strip() for k in raw.replace("\n", ",").split(",") if k.strip())


def read_keys(path: Path) -> frozenset[str]:
    """The keys in ``path``; :class:`KeyFileError` unless it holds at least one usable key."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeyFileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    keys = parse_keys(text)
    if not keys:
        raise KeyFileError(
            f"{path}: no API key in it; write one key, or several separated by commas or "
            "newlines (an empty Secret would let nobody in)"
        )
    for key in keys:
        bad = next((c for c in key if not "!" <= c <= "~"), None)
        if bad is not None:
            raise KeyFileError(
                f"{path}: a key contains {bad!r}; keys are printable ASCII without spaces (what "
                "an Authorization header carries), separated by commas or newlines"
            )
    return keys


class KeyReloader:
    """Reads the key file again after a change and hands valid keys to ``apply``;
    ``on_outcome`` counts each change as ``loaded`` (new keys in use) or ``invalid`` (kept the
    old ones); a read that finds the keys in use changes nothing and counts nothing."""

    def __init__(
        self,
        path: Path,
        current: frozenset[str],
        apply: Callable[[frozenset[str]], None],
        on_outcome: Callable[[str], None] = lambda _outcome: None,
    ) -> None:
        self.path = path
        self.current = current
        self.apply = apply
        self.on_outcome = on_outcome

    def reload(self) -> bool:
        """Read the file now; True when its keys are in use afterwards."""
        try:
            keys = read_keys(self.path)
        except KeyFileError as exc:
            logger.error(
                "API keys not reloaded: %s; keeping the %d key(s) loaded before",
                exc,
                len(self.current),
            )
            self.on_outcome("invalid")
            return False
        if keys != self.current:
            logger.info(
                "API keys reloaded from %s: %d key(s), %d new, %d removed",
                self.path,
                len(keys),
                len(keys - self.current),
                len(self.current - keys),
            )
            self.current = keys
            self.apply(keys)
            self.on_outcome("loaded")
        return True
