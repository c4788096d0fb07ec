"""Test-only: real SGLang 0.5.23 servers on CPU, started, awaited and stopped by hsdump's own
launcher (hsdump_patch/ops/launch.py), with the CPU stand-ins and the test-only fault injection
on their path."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import requests

from hsdump_patch.ops import launch as _launch
from hsdump_patch.ops.launch import free_port
from hsdump_patch.ops.serve import REQUIRED_ARGS
from hsdump_patch.protocol import ENV_DIR
from scripts.cpu_server import CPU_SHIM  # the CPU stand-ins (sgl_kernel, the CPU MLA fix)

REPO = Path(__file__).resolve().parents[2]
# The fault injection (test-only) runs before the CPU stand-ins, which `make smoke`, `make
# judge` and `make verify`'s CPU variant put on their servers' path too.
FAULT_SHIM = Path(__file__).resolve().parent / "fault_shim"
# What every CPU test server needs.
CPU_ARGS = [*_launch.CPU_ARGS, "--host", "127.0.0.1"]
# What the capture patch requires (what `hsdump serve` always passes).
EXTRACTION_ARGS = list(REQUIRED_ARGS)

__all__ = ["CPU_ARGS", "CPU_SHIM", "EXTRACTION_ARGS", "Server", "cpu_env", "free_port",
           "inductor_cache", "launch", "run_until_exit", "start"]


def inductor_cache() -> str:
    """torch.compile's on-disk cache for this test run's servers. It is not safe across
    concurrent processes (an importer can read a half-written .so): one cache per test run
    (pytest process), shared by its servers in sequence."""
    return os.path.join(tempfile.gettempdir(), f"hsdump-inductor-{os.getpid()}")


def cpu_env(extra: dict[str, str] | None = None, tp: int = 1) -> dict[str, str]:
    """Environment for a CPU SGLang process: the CPU stand-ins (and the fault injection) on
    PYTHONPATH."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(FAULT_SHIM), str(CPU_SHIM), env.get("PYTHONPATH")) if p)
    env.pop(ENV_DIR, None)
    # Nothing to diagnose on a stopped CPU server: without this, SGLang's parent sleeps 5 s
    # ("before crash diagnostics", py-spy and CUDA core dumps) at every stop.
    env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] = env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] = "0"
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache()
    if tp > 1:
        # One NUMA node: bind one core per rank; no NCCL on CPU: fall back to gloo.
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(tp))
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
    env.update(extra or {})
    return env


@dataclass
class Server(_launch.Server):
    """A running ``python -m sglang.launch_server`` process (its extra arguments in ``args``)."""

    args: list[str] = field(default_factory=list)

    def generate(self, input_ids: list[int], rid: str | None = None, max_new_tokens: int = 0,
                 **extra) -> dict:
        body = {"input_ids": input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}
        if rid is not None:
            body["rid"] = rid
        r = requests.post(f"{self.url}/generate", json=body, timeout=300)
        r.raise_for_status()
        return r.json()


def _argv(model: Path, args: list[str], tp: int, extraction_args: list[str],
          python: str = sys.executable) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", str(model), *CPU_ARGS,
            *extraction_args, "--tp-size", str(tp), *args]


def launch(model: Path, log_path: Path, *, args: list[str] = (), env: dict[str, str] | None = None,
           tp: int = 1, extraction_args: list[str] = EXTRACTION_ARGS,
           python: str = sys.executable):
    """Start a server process without waiting for it (see :func:`start`)."""
    return _launch.spawn(_argv(model, list(args), tp, extraction_args, python),
                         cpu_env(env, tp), log_path)


def start(model: Path, log_path: Path, *, args: list[str] = (), env: dict[str, str] | None = None,
          tp: int = 1, extraction_args: list[str] = EXTRACTION_ARGS,
          timeout: float = 900) -> Server:
    """Start a server and wait until it answers ``/ready``; raise
    :class:`~hsdump_patch.ops.launch.ServerFailed` with its log on failure (the server
    stopped)."""
    port = free_port()
    full_args = ["--port", str(port), *args]
    return Server.launch(_argv(model, full_args, tp, extraction_args), cpu_env(env, tp),
                         log_path, f"http://127.0.0.1:{port}", timeout=timeout, args=full_args)


def run_until_exit(model: Path, log_path: Path, *, args: list[str] = (),
                   env: dict[str, str] | None = None, tp: int = 1,
                   extraction_args: list[str] = EXTRACTION_ARGS,
                   timeout: float = 240) -> tuple[int, str]:
    """Start a server expected to fail at start-up; return (exit code, log); fail the test if it
    still runs after ``timeout`` s."""
    rc, log = _launch.run_until_exit(
        _argv(model, ["--port", str(free_port()), *args], tp, extraction_args),
        cpu_env(env, tp), log_path, timeout=timeout)
    if rc is None:
        raise AssertionError(f"the server still ran after {timeout} s; expected it to refuse "
                             f"at start-up:\n{log[-6000:]}")
    return rc, log
