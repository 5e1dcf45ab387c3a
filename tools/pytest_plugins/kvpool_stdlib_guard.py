"""The layout guard, once for every component: ``import operator`` is the stdlib's.

Why a plugin: kvpool's operator lives at ``kvpool.operator`` (PEP 420 namespace ``kvpool``); a
stray top-level ``operator`` package, a ``kvpool/__init__.py``, or a pytest rootdir that puts
``operator/`` on ``sys.path`` would silently replace the stdlib module that half of Python
imports (DESIGN.md, Repository layout). Shadowing is a property of each pytest process (its
rootdir, import mode and ``pythonpath``), so the check must run inside every component's
session, after its test modules were imported. ``tools/run_tests.py`` loads this plugin into
each component's pytest (``-p kvpool_stdlib_guard``), and it appends one test item there,
``test_stdlib_operator_guard[<component>]``, counted like any other test. It replaces the copy
each component used to keep under ``tests/``.
"""

from __future__ import annotations

import importlib
import sysconfig
from pathlib import Path

import pytest

NAME = "test_stdlib_operator_guard"


def problems() -> list[str]:
    """What is wrong with the layout as this process sees it (empty: nothing)."""
    out: list[str] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    operator = importlib.import_module("operator")  # what every ``import operator`` gets now
    spec = getattr(operator, "__spec__", None)
    origin = spec.origin if spec is not None else None
    if origin is None or Path(origin).resolve().parent != stdlib:
        out.append(f"import operator gives {origin or operator!r}, not the stdlib's ({stdlib})")
    elif operator.add(2, 3) != 5:
        out.append(f"import operator gives {origin}, whose add(2, 3) is not 5")
    kvpool = importlib.import_module("kvpool")
    if getattr(kvpool, "__file__", None) is not None:
        out.append(f"kvpool is a regular package ({kvpool.__file__}): kvpool/__init__.py must go")
    return out


class GuardItem(pytest.Item):
    """The guard as a test of the component's session (it has no file of its own there)."""

    def runtest(self) -> None:
        found = problems()
        if found:
            raise AssertionError("; ".join(found))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return Path(__file__), None, self.name


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append the guard to a session that collected tests (one that collected none still
    exits 5, which run_tests.py reports)."""
    if not items:
        return
    component = config.rootpath.name
    name = f"{NAME}[{component}]"
    items.append(
        GuardItem.from_parent(session, name=name, nodeid=f"kvpool_stdlib_guard.py::{name}")
    )
