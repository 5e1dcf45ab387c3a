"""The chaos suite's reduced run (``python -m chaos --reduced``; ``make chaos QUICK=1``).

Why: ``make chaos`` takes minutes; its reduced form keeps the chain honest on every
``make test``. ``kvpool-operator up`` runs the simulated fleet (e2e/chaos/fleet.yaml: four sim
workers, their controller and gateway) in the suite's own network namespace while kvpool's
replay client sends a trace the suite wrote, and the suite does one fault of each kind, in turn:
a worker, the controller (full-sync recovery) and the gateway killed with SIGKILL and restarted by
``up``, a worker frozen (SIGSTOP) past its heartbeat, a worker's ports partitioned (nftables).
The suite measures; this test asserts only what must hold whatever the box's load: no request
lost, hung or answered differently from its fault-free answer, every error the client met retried
to an answer, every target back and the hit ratio back to its pre-fault level within generous
bounds. About two minutes on the shared 2-core box.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parents[1]
LIMIT_S = 420


def test_reduced_chaos_run_loses_hangs_and_garbles_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    argv = [sys.executable, "-m", "chaos", "--reduced", "--out", str(out)]
    proc = subprocess.Popen(
        [*argv, "--workdir", str(tmp_path / "work")],
        cwd=E2E,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the suite stops everything it started on SIGTERM
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (0, 1), stderr[-4000:]
    doc = json.loads(out.read_text())
    m = doc["metrics"]
    assert "cut_not_run" not in doc["env"], doc["env"]["cut_not_run"]
    assert {f["kind"] for f in doc["faults"]} == {"kill", "freeze", "cut"}
    assert (m["lost"], m["hung"], m["wrong"], m["unchecked"]) == (0, 0, 0, 0), stdout
    assert m["failed"] == 0, stdout  # every error met was retried to an answer
    assert m["answered"] == m["requests"] > 100
    assert (m["not_back"], m["not_recovered"]) == (0, 0), stdout
    for fault in doc["faults"]:
        name = fault["name"]
        assert fault["streams"]["chaossim"]["requests"] > 0, name
        assert fault["back_s"] < 60, (name, fault["back_s"])
        assert m[f"recovery_s.{name}"] < 30, (name, m[f"recovery_s.{name}"])
    gateway = doc["faults"][[f["name"] for f in doc["faults"]].index("gateway-kill")]
    assert gateway["streams"]["chaossim"]["retried_ok"] > 0  # the client met it, and retried
