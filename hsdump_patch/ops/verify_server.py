"""The servers ``hsdump verify`` runs: built by ``hsdump serve``'s own planner (the production
profile), started in the background, observed (rank processes, CPU time, GPU memory) and
stopped with everything they spawned."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from hsdump_patch import protocol
from hsdump_patch.ops import launch, serve
from hsdump_patch.protocol import ENV_DIR

# What the CPU variant adds to the production profile.
CPU_SERVER_ARGS = list(launch.CPU_ARGS)
# SGLang's own EAGLE-3 capture, the reference of check (a); both the dump-on and the dump-off
# server run with it, so check (c) compares the dump and nothing else.
AUX_ARGS = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]


def plan_launch(model: Path, tp: int, port: int, dump_dir: Path, *, device: str,
                extra: list[str]) -> serve.Launch:
    """The server command ``hsdump serve`` would run, parsed by its own parser and planner."""
    parser = argparse.ArgumentParser(prog="hsdump")
    serve.add_parser(parser.add_subparsers(dest="command"))
    profile = "auto" if device == "cuda" else "none"
    args = parser.parse_args(["serve", "--model", str(model), "--tp", str(tp), "--host",
                              "127.0.0.1", "--port", str(port), "--dump-dir", str(dump_dir),
                              "--profile", profile, "--", *extra])
    from hsdump_patch.ops import blackwell

    capability = blackwell.detect_compute_capability() if device == "cuda" else None
    return serve.plan(args, capability)


@dataclass
class VerifyServer(launch.Server):
    """One running server of a verify run."""

    name: str
    tp: int
    dump_dir: Path | None
    argv: list[str]
    started_s: float = 0.0
    memory: GpuMemorySampler | None = None

    @classmethod
    def start(cls, name: str, model: Path, tp: int, work: Path, dump_root: Path, *, dump: bool,
              device: str, extra: list[str], env: dict[str, str],
              timeout: float) -> VerifyServer:
        """Start a server with the dump on (into ``dump_root``) or off; wait for ``/ready``;
        raise :class:`launch.ServerFailed` (the server stopped)."""
        port = launch.free_port()
        dump_dir = dump_root / f"dump-{name}"
        plan = plan_launch(model, tp, port, dump_dir, device=device, extra=extra)
        full_env = {**plan.env, **env}
        if not dump:
            full_env.pop(ENV_DIR, None)
            dump_dir = None
        log_path = work / f"server-{name}.log"
        memory = GpuMemorySampler() if device == "cuda" else None
        t0 = time.monotonic()
        server = cls.launch(plan.argv, full_env, log_path, f"http://127.0.0.1:{port}",
                            timeout=timeout, what=f"server {name}", name=name, tp=tp,
                            dump_dir=dump_dir, argv=plan.argv, memory=memory)
        server.started_s = time.monotonic() - t0
        return server

    def post(self, path: str, body: dict[str, Any], timeout: float = 600) -> Any:
        r = requests.post(f"{self.url}{path}", json=body, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def server_info(self) -> dict[str, Any]:
        r = requests.get(f"{self.url}/get_server_info", timeout=30)
        r.raise_for_status()
        return r.json()

    def rank_pids(self) -> dict[int, int]:
        """``{tp rank: pid}`` of the scheduler processes (SGLang titles them
        ``sglang::scheduler[_TP<rank>]``)."""
        import psutil

        ranks: dict[int, int] = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(child.cmdline())
                if not title.startswith("sglang::scheduler"):
                    continue
                tag = title.rsplit("TP", 1)[-1] if "_TP" in title else "0"
                ranks[int(tag.split("_")[0])] = child.pid
        return ranks

    def writer_pid(self) -> int | None:
        """The writer process (``writer.writer_pid`` of the dump dir's ``status.json``), None
        without one (dump off, or nothing published yet)."""
        if self.dump_dir is None:
            return None
        try:
            status = json.loads((self.dump_dir / protocol.STATUS).read_text())
            return int(status["writer"]["writer_pid"]) or None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def rank_cpu_seconds(self) -> dict[int, float]:
        """CPU seconds (user + system, all threads) used so far by each rank's scheduler; the
        writer rank's includes its writer child process (process mode), whose pid is in
        ``status.json``."""
        import psutil

        pids = self.rank_pids()
        procs = {rank: [pid] for rank, pid in pids.items()}
        writer = self.writer_pid()
        if writer is not None and writer not in pids.values():
            with contextlib.suppress(psutil.Error):
                parent = psutil.Process(writer).ppid()
                rank = next((r for r, p in pids.items() if p == parent), 0)
                procs.setdefault(rank, []).append(writer)
        out: dict[int, float] = {}
        for rank, ranked in procs.items():
            for pid in ranked:
                with contextlib.suppress(psutil.Error):
                    t = psutil.Process(pid).cpu_times()
                    out[rank] = out.get(rank, 0.0) + t.user + t.system
        return out

    def __post_init__(self) -> None:
        if self.memory is not None:  # from the moment the server process exists
            self.memory.start()

    def stop(self) -> None:
        """Stop the server's process group and the GPU memory sampler."""
        super().stop()
        if self.memory is not None:
            self.memory.stop()


def run_refused(model: Path, work: Path, name: str, flags: list[str] | None, *, device: str,
                extra: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Launch the server ``hsdump serve`` would, with the dump on, changed by ``flags`` (later
    flags win; None: without --disable-radix-cache), expecting it to refuse at start-up;
    return (exit code, or None if it still ran after ``timeout`` s, and the log)."""
    plan = plan_launch(model, 1, launch.free_port(), work / f"dump-{name}", device=device,
                       extra=extra)
    argv = ([a for a in plan.argv if a != "--disable-radix-cache"] if flags is None
            else [*plan.argv, *flags])
    return launch.run_until_exit(argv, {**plan.env, **env}, work / f"refused-{name}.log",
                                 timeout=timeout)


def cuda_device_uuids() -> dict[int, str]:
    """``{CUDA device id: GPU uuid as nvidia-smi prints it}`` as the servers number their
    devices (this environment's ``CUDA_VISIBLE_DEVICES`` and ordering), asked of torch in a
    child process so this one holds no CUDA context; empty when that fails."""
    code = ("import torch\nfor i in range(torch.cuda.device_count()):\n"
            "    print(i, 'GPU-' + str(torch.cuda.get_device_properties(i).uuid))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=True)
        return {int(i): u for i, u in (line.split() for line in r.stdout.splitlines())}
    except (subprocess.SubprocessError, OSError, ValueError):
        return {}


@dataclass
class GpuMemorySampler:
    """Peak ``memory.used`` per GPU (by uuid), polled from ``nvidia-smi`` in a thread."""

    interval: float = 0.25
    peaks_mib: dict[str, int] = field(default_factory=dict)  # by GPU uuid
    indexes: dict[str, int] = field(default_factory=dict)  # nvidia-smi index of each uuid
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: str | None = None

    def start(self) -> None:
        if shutil.which("nvidia-smi") is None:
            self.error = "nvidia-smi not found"
            return
        self._thread = threading.Thread(target=self._run, name="hsdump-verify-gpumem",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=index,uuid,memory.used",
                     "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=30, check=True).stdout
                for line in out.strip().splitlines():
                    index, uuid, used = (x.strip() for x in line.split(","))
                    self.indexes[uuid] = int(index)
                    self.peaks_mib[uuid] = max(self.peaks_mib.get(uuid, 0), int(used))
            except (subprocess.SubprocessError, ValueError) as e:
                self.error = f"nvidia-smi: {e}"
                return
            self._stop.wait(self.interval)

    def peaks_by_device(self, uuids: dict[int, str]) -> dict[int, int]:
        """Peaks by CUDA device id (``uuids`` from :func:`cuda_device_uuids`); without them,
        by nvidia-smi index (right only when both number the GPUs alike)."""
        if uuids:
            return {d: self.peaks_mib[u] for d, u in uuids.items() if u in self.peaks_mib}
        return {self.indexes[u]: peak for u, peak in self.peaks_mib.items()}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
