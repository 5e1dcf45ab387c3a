"""What each chaos command (``python -m chaos``, ``python -m chaos.freeze``) does before its run.

Why this module exists: both commands run in a network namespace of their own
(:mod:`chaos.netns`) unless ``--no-netns``: started outside one, they run again inside a new one
and exit with its status; both stop on SIGTERM (``make``'s, a CI's cancel) exactly as on Ctrl-C,
where the run stops every process it started; both report progress as lines on stderr. Written
once, so the two commands cannot drift apart.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from chaos import netns


def enter_namespace(
    module: str, argv: list[str], no_netns: bool, env: dict[str, str] | None = None
) -> int | None:
    """Unless ``no_netns`` or already in one: ``python -m module argv`` again in a network
    namespace of its own (``env`` added), returning its exit status. None: run here."""
    if no_netns or netns.in_namespace():
        return None
    return netns.reenter(module, argv, env)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def interrupt_on_sigterm() -> None:
    """SIGTERM raises ``KeyboardInterrupt`` from now on: the same clean stop as Ctrl-C."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def say(line: str) -> None:
    """One progress line on stderr, at once."""
    print(line, file=sys.stderr, flush=True)
