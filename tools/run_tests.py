"""Run each component's pytest in its own process and print one closing line for all.

Components run a few at a time (``KVPOOL_TEST_JOBS``, default ``DEFAULT_JOBS``), each output
line prefixed with its component, then a summary line per component and one for all.

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
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
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


#: Components in the order a free slot takes them: the longest first (seconds each took on a
#: clean clone at load ~2, stop 21: e2e 503, worker 426, gateway 424, controller 109, operator
#: 92, protocol 62, kernels 29), so the slots end together.
ORDER = ["e2e", "worker", "gateway", "controller", "operator", "protocol", "kernels"]
#: How many components run at once. Most of the suites' time is spent waiting on real processes
#: (engines starting, transfers, controllers electing), not on the CPU: on this 2-core machine
#: three at once finish in about half the time of one after another. Every test binds the ports
#: it is given or asks the OS for free ones (``up`` localizes every render to free ports), so
#: suites running together do not collide. KVPOOL_TEST_JOBS=1 runs them one after another.
DEFAULT_JOBS = 3


class Printer:
    """One line at a time, each prefixed with its component, so concurrent suites stay legible."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, comp: str, line: str) -> None:
        with self.lock:
            sys.stdout.write(f"[{comp}] {line}" if line.endswith("\n") else f"[{comp}] {line}\n")
            sys.stdout.flush()


def run_component(
    comp: str, tmp: Path, env_path: str, say: Printer
) -> tuple[int, list[int], float]:
    """pytest for one component (its isolated files in their own processes after the rest):
    the exit status, [passed, failed, skipped] and the seconds it took."""
    say(comp, "pytest")
    t0 = time.monotonic()
    alone = ISOLATED.get(comp, [])
    runs = [[f"--ignore={f}" for f in alone]] + [[f] for f in alone]
    rc = 0
    got = [0, 0, 0]  # passed, failed, skipped
    for n, args in enumerate(runs):
        xml = tmp / f"{comp}.{n}.xml"
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", f"--junitxml={xml}", "-p",
             "no:cacheprovider", "-p", GUARD, *args],
            cwd=ROOT / comp,
            # LMCache phones home unless told not to (DESIGN.md rule 9): never from tests.
            env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": env_path,
                 "PYTHONUNBUFFERED": "1"},  # its lines as they come: the run's progress
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            say(comp, line)
        code = proc.wait()
        rc = rc or code
        got = [a + b for a, b in zip(got, _counts(xml), strict=True)]
    return rc, got, time.monotonic() - t0


def main(argv: list[str]) -> int:
    components = argv or ORDER
    jobs = max(1, int(os.environ.get("KVPOOL_TEST_JOBS", DEFAULT_JOBS)))
    total = [0, 0, 0]
    bad: list[str] = []
    path = os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH", "")) if p)
    say = Printer()
    if "protocol" in components:
        _build_vllm_venv()
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"==> {len(components)} components, {min(jobs, len(components))} at a time "
              f"(KVPOOL_TEST_JOBS={jobs})", flush=True)  # fmt: skip
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {c: pool.submit(run_component, c, Path(tmp), path, say) for c in components}
            results = {c: f.result() for c, f in futures.items()}
    print("==> summary", flush=True)
    for comp in components:
        rc, (passed, failed, skipped), dt = results[comp]
        for i, n in enumerate((passed, failed, skipped)):
            total[i] += n
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
    print(f"{total[0]} passed, {total[1]} failed, {total[2]} skipped "
          f"in {time.monotonic() - t_all:.0f}s")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
