"""Run each component's pytest in its own process and print one closing line for all.

Why a script: pytest must run with each component as its rootdir (one pytest over the repo
root puts ``operator/`` on ``sys.path`` and shadows the stdlib ``operator``), and CI reads one
"N passed, N failed" line. Exit status is non-zero if any component fails or collects no test.
Every component's pytest loads ``tools/pytest_plugins/kvpool_stdlib_guard.py``: the one guard
that ``import operator`` is the stdlib's, run inside each component's own test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_TESTS_COLLECTED = 5
#: Builds .kvpool/vllm-venv (idempotent; minutes the first time), where protocol's hash-parity
#: oracles run lmcache next to the real vLLM.
VLLM_VENV = ROOT / "protocol" / "tests" / "vllm_venv.py"
#: Holds only the guard plugin, so putting it on PYTHONPATH makes nothing else importable.
PLUGINS = ROOT / "tools" / "pytest_plugins"
GUARD = "kvpool_stdlib_guard"
#: Test files that run in a pytest process of their own, after the rest of their component:
#: they build a real LMCache engine in the test process itself, and LMCache's process-wide
#: state (engine builder, controller-worker threads and their event loops, ZMQ contexts) left
#: by earlier tests made test_p2p_process fail or spin (a clean clone's run hung in it for
#: 15 minutes after test_p2p_frozen_peer was added before it).
ISOLATED: dict[str, list[str]] = {"worker": ["tests/integration/test_p2p_process.py"]}


def _build_vllm_venv() -> None:
    """Before protocol's tests. A failed build (no network) does not stop the run: the vLLM-regime
    parity tests then fail, each saying what to run."""
    print("==> [protocol] vLLM venv for the hash-parity tests", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, str(VLLM_VENV)], cwd=ROOT)
    state = "ready" if rc == 0 else f"NOT built (rc={rc}), its tests will fail"
    print(f"==> [protocol] vLLM venv {state} in {time.monotonic() - t0:.0f}s", flush=True)


def _counts(junit: Path) -> tuple[int, int, int]:
    if not junit.exists():
        return 0, 0, 0
    tests = failed = skipped = 0
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def main(argv: list[str]) -> int:
    components = argv or [
        "protocol",
        "operator",
        "controller",
        "gateway",
        "kernels",
        "worker",
        "e2e",
    ]
    total = [0, 0, 0]
    bad: list[str] = []
    path = os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        for comp in components:
            junit = Path(tmp) / f"{comp}.xml"
            if comp == "protocol":
                _build_vllm_venv()
            print(f"==> [{comp}] pytest", flush=True)
            t0 = time.monotonic()
            alone = ISOLATED.get(comp, [])
            runs = [[f"--ignore={f}" for f in alone]] + [[f] for f in alone]
            rc = 0
            got = [0, 0, 0]  # passed, failed, skipped
            for n, args in enumerate(runs):
                xml = junit.with_suffix(f".{n}.xml")
                code = subprocess.call(
                    [sys.executable, "-m", "pytest", f"--junitxml={xml}", "-p",
                     "no:cacheprovider", "-p", GUARD, *args],
                    cwd=ROOT / comp,
                    # LMCache phones home unless told not to (DESIGN.md rule 9): never from tests.
                    env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": path},
                )  # fmt: skip
                rc = rc or code
                got = [a + b for a, b in zip(got, _counts(xml), strict=True)]
            passed, failed, skipped = got
            for i, n in enumerate((passed, failed, skipped)):
                total[i] += n
            dt = time.monotonic() - t0
            print(
                f"==> [{comp}] rc={rc} {passed} passed, {failed} failed, {skipped} skipped "
                f"in {dt:.0f}s",
                flush=True,
            )
            if rc == NO_TESTS_COLLECTED:
                bad.append(f"{comp} (no tests collected)")
            elif rc != 0:
                bad.append(comp)
    if bad:
        print(f"make test: FAILED in {', '.join(bad)}")
    print(f"{total[0]} passed, {total[1]} failed, {total[2]} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
