"""Fixtures of the operator's unit tests (builders live in op_builders.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from op_builders import EXAMPLES


@pytest.fixture
def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))
