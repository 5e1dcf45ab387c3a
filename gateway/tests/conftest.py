"""Shared test setup: the tests directory is importable (``fakes``), LMCache never phones home."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
