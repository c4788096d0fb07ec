"""hsdump's server launcher (hsdump_patch/ops/launch.py) on small real processes (no SGLang):
ready when ``/ready`` answers, a clear error with the log's tail when the process exits or
never becomes ready, and stopping reaches what the server spawned."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from hsdump_patch.ops import launch

# A stand-in server: logs a line, spawns a child that sleeps (like SGLang's schedulers), writes
# the child's pid, then answers GET /ready with 200 on the given port.
SERVER = """
import http.server, subprocess, sys
print("stand-in server starting", flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_ready_server_is_returned_and_stopped_with_its_children(tmp_path):
    port, pids = launch.free_port(), tmp_path / "child.pid"
    server = launch.Server.launch([sys.executable, "-c", SERVER, str(port), str(pids)],
                                  dict(os.environ), tmp_path / "server.log",
                                  f"http://127.0.0.1:{port}", timeout=60)
    child = int(pids.read_text())
    assert server.proc.poll() is None and _alive(child)
    assert "stand-in server starting" in server.log()
    server.stop()
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_server_that_exits_fails_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "print('bad flag --xyz'); raise SystemExit(3)"]
    t0 = time.monotonic()
    with pytest.raises(launch.ServerFailed) as e:
        launch.Server.launch(argv, dict(os.environ), tmp_path / "s.log", "http://127.0.0.1:9",
                             timeout=120, what="server tp1")
    assert time.monotonic() - t0 < 60
    assert str(e.value).startswith(f"server tp1 exited with 3 before it was ready; log "
                                   f"{tmp_path / 's.log'}:\n")
    assert "bad flag --xyz" in str(e.value)


def test_a_server_never_ready_is_stopped_and_fails(tmp_path):
    argv = [sys.executable, "-c", "print('loading', flush=True); import time; time.sleep(600)"]
    with pytest.raises(launch.ServerFailed, match=r"(?s)^server not ready after 2 s; .*loading"):
        launch.Server.launch(argv, dict(os.environ), tmp_path / "s.log",
                             f"http://127.0.0.1:{launch.free_port()}", timeout=2)


def test_a_refused_launch_gives_its_exit_code_and_log(tmp_path):
    refuse = [sys.executable, "-c", "print('refused: --pp-size'); raise SystemExit(1)"]
    assert launch.run_until_exit(refuse, dict(os.environ), tmp_path / "r.log",
                                 timeout=60) == (1, "refused: --pp-size\n")
    hang = [sys.executable, "-c", "print('serving', flush=True); import time; time.sleep(600)"]
    t0 = time.monotonic()
    rc, log = launch.run_until_exit(hang, dict(os.environ), tmp_path / "h.log", timeout=2)
    assert (rc, log) == (None, "serving\n") and time.monotonic() - t0 < 30



def test_a_subclass_keeps_its_own_fields(tmp_path):
    """Fields named like the launch's own arguments (``argv``, ``env``) reach the subclass."""
    from dataclasses import dataclass

    @dataclass
    class Named(launch.Server):
        argv: list[str]
        env: str

    port = launch.free_port()
    server = Named.launch([sys.executable, "-c", SERVER, str(port), str(tmp_path / "pid")],
                          dict(os.environ), tmp_path / "s.log", f"http://127.0.0.1:{port}",
                          timeout=60, argv=["x"], env="y")
    server.stop()
    assert (server.argv, server.env, server.url) == (["x"], "y", f"http://127.0.0.1:{port}")


def test_free_ports_are_below_the_ephemeral_range_free_and_never_handed_out_twice(monkeypatch):
    """A port picked in the ephemeral range can be taken by any outgoing connection (or gloo's TP
    pairs) before the server binds it; so ports come from below it, each once, never one held."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [launch.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(launch.PORT_RANGE[0] <= p < low for p in ports), ports
    monkeypatch.setattr(launch, "PORT_RANGE", (1, 0))  # an empty range: the kernel's choice
    assert launch.free_port() >= low
    monkeypatch.setattr(launch, "_ephemeral_low", lambda: 65536)
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(launch, "PORT_RANGE", (taken, taken))
        assert launch.free_port() != taken  # the held one is skipped
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        free = probe.getsockname()[1]
    monkeypatch.setattr(launch, "PORT_RANGE", (free, free))
    assert launch.free_port() == free
    assert launch.free_port() != free  # handed out once: then the kernel's choice
