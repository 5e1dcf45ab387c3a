"""A controller whose ZMQ port is taken exits 2 with a message naming the flag, no traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from conftest import ENV, free_port


def test_taken_monitor_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = json.dumps({"pull": port, "reply": free_port()})
        result = subprocess.run(
            [sys.executable, "-m", "kvpool.controller.main", "--host", "127.0.0.1",
             "--port", str(free_port()), "--monitor-ports", ports],
            env=ENV, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--monitor-ports" in result.stderr
    assert "Traceback" not in result.stderr
