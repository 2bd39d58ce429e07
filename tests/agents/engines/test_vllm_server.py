"""`ServerProcess` without vLLM: its start, death and log keeping, around a stand-in server.

The stand-in is a few lines of Python's `http.server` that answer `/health`: what
`ServerProcess` needs of vLLM. vLLM itself starts in 30-70 s here, so these paths are tested
on it only once each (tests/agents/engines/test_vllm.py); this file runs in the default,
offline test run.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from agents.engines.vllm_server import (
    EngineDied,
    ServerProcess,
    ServerStartError,
    first_error,
    free_port,
    group_members,
)

STAND_IN = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("stand-in up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

VLLM_LOG = """\
(APIServer pid=9) WARNING 11-24 23:06:48 [system_utils.py:255] errors like `OSError: [Errno 24]`
(Worker pid=12) ERROR 11-24 23:07:09 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=12) ERROR 11-24 23:07:09 [multiproc_executor.py:1063] ValueError: Available memory
(EngineCore pid=11) ERROR 11-24 23:07:09 [core.py:1510] RuntimeError: Worker failed with error
RuntimeError: Engine core initialization failed. See root cause above.
"""


def started(port: int | None = None) -> ServerProcess:
    port = port or free_port()
    return ServerProcess([sys.executable, "-c", STAND_IN, str(port)], port, {}, 30.0)


def test_a_clean_stop_removes_the_log_and_every_process():
    server = started()
    assert server.alive() and server.death() is None
    assert "stand-in up" in server.log_tail()
    server.stop()
    assert not server.log_path.exists()
    assert group_members(server.pid) == []
    assert server.death() is None  # stopped on purpose: not a death


def test_a_server_that_dies_is_reported_with_its_kept_log():
    server = started()
    try:
        os.killpg(server.pid, signal.SIGKILL)
        died = server.death(wait=5.0)
    finally:
        server.stop()
    assert isinstance(died, EngineDied)
    assert f"pid {server.pid}, port {server.port}) exited with code -9 (SIGKILL)" in str(died)
    assert str(server.log_path) in str(died) and "stand-in up" in str(died)
    assert server.log_path.exists()  # kept after stop: the server had failed
    server.log_path.unlink()


def test_a_server_that_exits_while_starting_keeps_its_log():
    command = [sys.executable, "-c", "import sys; print('bad model', flush=True); sys.exit(3)"]
    with pytest.raises(ServerStartError, match=r"exited with code 3 while starting") as failed:
        ServerProcess(command, free_port(), {}, 30.0)
    message = str(failed.value)
    log = Path(message.split("its log (")[1].split(")")[0])
    assert message.endswith("bad model")
    assert log.read_text() == "bad model\n"
    log.unlink()


def test_the_first_error_is_the_root_cause_without_vllm_prefixes():
    assert first_error(VLLM_LOG) == "ValueError: Available memory"
    assert first_error("INFO all good\n") is None
