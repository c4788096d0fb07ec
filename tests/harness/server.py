"""Test-only: start and stop a real SGLang 0.5.23 server on CPU (with the CPU stand-ins)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

CPU_SHIM = Path(__file__).resolve().parent / "cpu_shim"
# What every CPU test server needs.
CPU_ARGS = ["--device", "cpu", "--max-total-tokens", "8192", "--host", "127.0.0.1",
            # idle schedulers otherwise busy-poll a core each, starving the rest of the suite
            "--sleep-on-idle"]
# What the capture patch requires.
EXTRACTION_ARGS = ["--cuda-graph-backend-prefill", "disabled", "--cuda-graph-backend-decode",
                   "disabled", "--disable-radix-cache"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(extra: dict[str, str] | None = None, tp: int = 1) -> dict[str, str]:
    """Environment for a CPU SGLang process: the stand-in for sgl_kernel on PYTHONPATH."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM), env.get("PYTHONPATH")) if p)
    env.pop("SGLANG_HS_DUMP_DIR", None)
    # torch.compile's on-disk cache is not safe across concurrent processes (an importer can
    # read a half-written .so): one cache per test run, shared by its servers in sequence.
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                  f"hsdump-inductor-{os.getpid()}")
    if tp > 1:
        # One NUMA node: bind one core per rank; no NCCL on CPU: fall back to gloo.
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(tp))
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
    env.update(extra or {})
    return env


@dataclass
class Server:
    """A running ``python -m sglang.launch_server`` process."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generate(self, input_ids: list[int], rid: str | None = None, max_new_tokens: int = 0,
                 **extra) -> dict:
        body = {"input_ids": input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}
        if rid is not None:
            body["rid"] = rid
        r = requests.post(f"{self.url}/generate", json=body, timeout=300)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        _kill_group(self.proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill whatever is left of a server's process group (spawned schedulers included)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launch(model: Path, log_path: Path, *, args: list[str] = (), env: dict[str, str] | None = None,
           tp: int = 1, extraction_args: list[str] = EXTRACTION_ARGS,
           python: str = sys.executable) -> subprocess.Popen:
    """Start a server process without waiting for it (see :func:`start`)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), *CPU_ARGS,
           *extraction_args, "--tp-size", str(tp), *args]
    log = open(log_path, "w")  # noqa: SIM115 - owned by the child process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(env, tp),
                            start_new_session=True)


def start(model: Path, log_path: Path, *, args: list[str] = (), env: dict[str, str] | None = None,
          tp: int = 1, extraction_args: list[str] = EXTRACTION_ARGS,
          timeout: float = 900) -> Server:
    """Start a server and wait until it answers ``/ready``; raise with its log on failure."""
    port = free_port()
    full_args = ["--port", str(port), *args]
    proc = launch(model, log_path, args=full_args, env=env, tp=tp,
                  extraction_args=extraction_args)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path, full_args)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-6000:]}")
        try:
            if requests.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"server not ready after {timeout}s:\n{server.log()[-6000:]}")


def run_until_exit(model: Path, log_path: Path, *, args: list[str] = (),
                   env: dict[str, str] | None = None, tp: int = 1,
                   extraction_args: list[str] = EXTRACTION_ARGS,
                   timeout: float = 240) -> tuple[int, str]:
    """Start a server expected to fail at start-up; return (exit code, log)."""
    proc = launch(model, log_path, args=["--port", str(free_port()), *args], env=env, tp=tp,
                  extraction_args=extraction_args)
    try:
        rc = proc.wait(timeout)
    finally:
        _kill_group(proc)
    return rc, log_path.read_text(errors="replace")
