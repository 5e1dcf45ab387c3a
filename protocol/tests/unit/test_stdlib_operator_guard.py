"""Guard: the namespace layout must never shadow the standard library's ``operator``.

kvpool's operator lives at ``kvpool.operator``; a stray top-level ``operator`` package (or a
pytest rootdir that puts ``operator/`` on ``sys.path``) would silently replace the stdlib module
that half of Python imports. This test fails the moment that happens.
"""

import operator
import sysconfig
from pathlib import Path


def test_import_operator_is_the_stdlib() -> None:
    origin = operator.__spec__.origin if operator.__spec__ else None
    assert origin is not None
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(origin).resolve().parent == stdlib, origin
    assert operator.add(2, 3) == 5


def test_kvpool_is_a_namespace_package() -> None:
    import kvpool

    assert getattr(kvpool, "__file__", None) is None, "kvpool/__init__.py must not exist"
