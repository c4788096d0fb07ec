"""Launch an SGLang server process in the background: start it in its own process group with
its output in a log file, wait until it answers ``/ready`` (or exits, or a time limit passes:
:class:`ServerFailed` with the log's tail), and stop it with everything it spawned. Shared by
``hsdump verify``, ``make smoke`` (scripts/smoke_local.py) and the test suite."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import requests

# How much of a failed server's log an error shows.
LOG_TAIL_CHARS = 6000
# What a server on SGLang's CPU engine adds: a KV pool sized for a small machine (the default
# takes 15 GB), a request pool to match (the default, 2048 requests x the context length in
# int32, is 1.3 GB for Kimi-K2.5's 163,840 tokens), and idle schedulers that do not busy-poll
# a core each.
CPU_ARGS = ("--device", "cpu", "--max-total-tokens", "8192", "--max-running-requests", "128",
            "--sleep-on-idle")


class ServerFailed(RuntimeError):
    """A server exited or did not become ready."""


# Ports handed out below the kernel's ephemeral range, beneath the one SGLang 0.5.23 uses for its
# own ports bound later (22000-29999, utils/network.py get_free_port_below_ephemeral).
PORT_RANGE = (15000, 21999)
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port that is free now, for a server that binds it later: below the ephemeral range
    (where bind(0) and outgoing connections, gloo's TP pairs among them, take ports, so a port
    picked there can be gone a minute later: "address already in use"), never the same twice in
    one process."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low() - 1)
    for port in random.sample(range(low, high + 1), min(256, max(0, high - low + 1))):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no free port below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """Start ``argv`` with exactly ``env``, stdout and stderr to ``log_path``, in a new process
    group (so :func:`stop_group` reaches the processes it spawns); do not wait."""
    with open(log_path, "w") as log:
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                                start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of ``proc``'s process group (spawned schedulers included) and reap
    ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM ``proc``'s process group if it still runs, wait up to ``grace`` s for it, then
    :func:`kill_group`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    kill_group(proc)


def log_tail(log_path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last ``chars`` characters of a server log ('' if it does not exist)."""
    with contextlib.suppress(FileNotFoundError):
        return log_path.read_text(errors="replace")[-chars:]
    return ""


@dataclass
class Server:
    """A running server process and the URL it serves on."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    @classmethod
    def launch(cls, argv: Sequence[str], env: Mapping[str, str], log_path: Path, url: str, /,
               *, timeout: float, what: str = "server", **fields: Any) -> Self:
        """Start ``argv``, a server that will listen at ``url`` (``fields``: the subclass's own;
        ``what``: its name in errors), and wait until it is ready; on any failure
        (:class:`ServerFailed`, an interrupt) stop it before raising."""
        server = cls(spawn(argv, env, log_path), url, log_path, **fields)
        try:
            server.wait_ready(timeout, what)
        except BaseException:
            server.stop()
            raise
        return server

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float, what: str = "server") -> None:
        """Poll ``/ready`` until it answers 200; raise :class:`ServerFailed` (with the log's
        tail) if the process exits first or ``timeout`` s pass. Does not stop the server."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{what} exited with {self.proc.returncode} before it was "
                                   f"ready; log {self.log_path}:\n{log_tail(self.log_path)}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise ServerFailed(f"{what} not ready after {timeout:.0f} s; log {self.log_path}:\n"
                           f"{log_tail(self.log_path)}")

    def stop(self) -> None:
        """Stop the server's process group (see :func:`stop_group`)."""
        stop_group(self.proc)


def run_until_exit(argv: Sequence[str], env: Mapping[str, str], log_path: Path, *,
                   timeout: float) -> tuple[int | None, str]:
    """Start a server expected to refuse at start-up; return (its exit code, or None if it still
    ran after ``timeout`` s, and its whole log). The process group is killed either way."""
    proc = spawn(argv, env, log_path)
    rc: int | None
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(proc)
    return rc, log_path.read_text(errors="replace")
