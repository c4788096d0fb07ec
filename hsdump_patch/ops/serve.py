"""``hsdump serve``: launch ``python -m sglang.launch_server`` configured for extraction.

It adds what the capture patch needs (eager prefill, no radix cache, the dump directory),
applies the Blackwell profile of :mod:`hsdump_patch.ops.blackwell` unless the user set the
same flag, refuses arguments that contradict extraction, then replaces itself with the server
(so a container's stop signal reaches SGLang directly).

With ``--bridge`` it stays as the parent of two processes instead: the server, and once the
server answers ``/ready``, ``hsdump bridge`` beside it (SpecForge's online capture, see
docs/online.md). The server exiting stops the bridge and ends ``hsdump serve``; the bridge
exiting is logged with its last lines and it alone is restarted (backoff, at most
``BRIDGE_MAX_RESTARTS`` per ``BRIDGE_RESTART_WINDOW``): the server keeps serving.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

from hsdump_patch.capture import guards
from hsdump_patch.client import bridge
from hsdump_patch.ops import blackwell
from hsdump_patch.ops.launch import stop_group
from hsdump_patch.protocol import DEFAULT_DUMP_DIR, ENV_DIR

# Eager prefill (the capture hooks never run in a graph replay) and no prefix cache. The
# per-phase spelling: --disable-cuda-graph is deprecated in 0.5.23 and loses to these flags.
REQUIRED_ARGS = (*guards.DISABLE_GRAPHS_FLAGS.split(), "--disable-radix-cache")
# SGLang flags that hsdump serve sets from its own options.
OWN_FLAGS = {"model_path": "--model", "tp_size": "--tp", "host": "--host", "port": "--port"}
GRAPH_FLAGS = {"cuda_graph_backend_prefill": "--cuda-graph-backend-prefill",
               "cuda_graph_backend_decode": "--cuda-graph-backend-decode",
               "cuda_graph_config": "--cuda-graph-config"}


# The bridge reaches a server bound to every address on loopback.
LOCAL_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
DEFAULT_BRIDGE_WAIT = 3600.0  # a Kimi-K2.5 load plus first-start autotuning (the image's)
BRIDGE_LOG_LINES = 40  # a failed bridge's last lines, repeated when it exits
# The bridge's restarts: 1 s doubling to 30 s, back to 1 s after a run of BRIDGE_HEALTHY_S;
# beyond BRIDGE_MAX_RESTARTS within BRIDGE_RESTART_WINDOW s (a crash loop, logged) the next one
# waits until the window allows it.
BRIDGE_BACKOFF = (1.0, 30.0)
BRIDGE_HEALTHY_S = 60.0
BRIDGE_MAX_RESTARTS = 5
BRIDGE_RESTART_WINDOW = 300.0
SUPERVISE_POLL_S = 0.2


class ServeError(ValueError):
    """The requested server configuration cannot be used for extraction."""


@dataclass
class Launch:
    """What ``hsdump serve`` runs: the command, the environment and the profile it applied."""

    argv: list[str]
    env: dict[str, str]
    profile: str
    applied: list[blackwell.Setting] = field(default_factory=list)
    overridden: list[blackwell.Setting] = field(default_factory=list)
    bridge_argv: list[str] | None = None  # ``hsdump bridge`` beside the server (--bridge)
    ready_url: str = ""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit
        raise ServeError(f"SGLang 0.5.23 rejects the server arguments: {message}")


class _BridgeParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ServeError(f"hsdump bridge rejects the --bridge-arg arguments: {message}")


def bridge_command(args: argparse.Namespace) -> list[str]:
    """The ``hsdump bridge`` command for the server ``args`` describe; raise ServeError."""
    missing = [flag for flag, value in (("--mooncake-master", args.mooncake_master),
                                        ("--mooncake-metadata", args.mooncake_metadata))
               if not value]
    if missing:
        raise ServeError(f"--bridge needs {' and '.join(missing)} (or $HSDUMP_MOONCAKE_MASTER "
                         "/ $HSDUMP_MOONCAKE_METADATA)")
    host = LOCAL_HOSTS.get(args.host, args.host)
    host = f"[{host}]" if ":" in host else host
    flags = ["--server", f"http://{host}:{args.port}", "--dump-dir", args.dump_dir,
             "--host", args.bridge_host, "--port", str(args.bridge_port),
             "--mooncake-master", args.mooncake_master,
             "--mooncake-metadata", args.mooncake_metadata, *args.bridge_arg]
    parser = _BridgeParser(prog="hsdump", add_help=False)
    bridge.add_parser(parser.add_subparsers(parser_class=_BridgeParser))
    parser.parse_args(["bridge", *flags])  # a bad --bridge-arg fails here, before the server
    return [sys.executable, "-m", "hsdump_patch.cli", "bridge", *flags]


class _Explicit(argparse.Namespace):
    """A namespace that claims every attribute exists, so argparse stores no defaults in it:
    after parsing it holds exactly the options the command line set."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return None


@functools.lru_cache(maxsize=1)
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own ``launch_server`` parser (aliases and abbreviations resolved as it does)."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang.launch_server", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def explicit_options(sglang_args: list[str]) -> dict[str, Any]:
    """Return ``{dest: value}`` for every SGLang option that ``sglang_args`` sets."""
    parser = sglang_parser()
    # --model-path is required by SGLang; a placeholder keeps the parse going.
    ns = parser.parse_args(["--model-path", "\0", *sglang_args], namespace=_Explicit())
    found = vars(ns)
    if found.get("model_path") == "\0":
        del found["model_path"]
    return found


def contradictions(explicit: dict[str, Any]) -> list[str]:
    """Messages for user-passed SGLang options that contradict what ``hsdump serve`` sets."""
    problems = [f"{OWN_FLAGS[d]} is an option of hsdump serve: pass it before '--', not as "
                "an SGLang argument" for d in OWN_FLAGS if d in explicit]
    for dest, flag in GRAPH_FLAGS.items():
        if dest in explicit and explicit[dest] != "disabled":
            problems.append(f"{flag} {explicit[dest]} turns CUDA graphs on, but extraction needs "
                            f"eager prefill (hsdump serve passes {guards.DISABLE_GRAPHS_FLAGS}): "
                            "remove it")
    return problems


def plan(args: argparse.Namespace, capability: tuple[int, int] | None) -> Launch:
    """Build the server command for the parsed ``hsdump serve`` options; raise ServeError."""
    sglang_args = list(args.sglang_args)
    if sglang_args[:1] == ["--"]:
        sglang_args = sglang_args[1:]
    if not os.path.isabs(args.dump_dir):
        raise ServeError(f"--dump-dir must be an absolute path, got {args.dump_dir!r}")
    if args.tp < 1:
        raise ServeError(f"--tp must be at least 1, got {args.tp}")
    explicit = explicit_options(sglang_args)
    problems = contradictions(explicit)

    profile = blackwell.profile_for(capability) if args.profile == "auto" else args.profile
    settings = blackwell.profile_settings(
        profile, blackwell.read_model_config(args.model), args.tp)
    applied = [s for s in settings if s.dest not in explicit]
    overridden = [s for s in settings if s.dest in explicit]

    server_args = ["--model-path", args.model, "--tp-size", str(args.tp), "--host", args.host,
                   "--port", str(args.port), *REQUIRED_ARGS,
                   *(a for s in applied for a in s.args), *sglang_args]
    problems += guards.problems_for_cli_args(sglang_parser().parse_args(server_args))
    bridge_argv = None
    if args.bridge:
        try:
            bridge_argv = bridge_command(args)
        except ServeError as e:
            problems.append(str(e))
    if problems:
        raise ServeError("hsdump serve: these server arguments cannot be used for extraction:\n"
                         + "\n".join(f"  - {p}" for p in problems))
    env = {**os.environ, ENV_DIR: args.dump_dir}
    argv = [sys.executable, "-m", "sglang.launch_server", *server_args]
    ready = bridge_argv[bridge_argv.index("--server") + 1] + "/ready" if bridge_argv else ""
    return Launch(argv, env, profile, applied, overridden, bridge_argv, ready)


def _summary(launch: Launch, capability: tuple[int, int] | None) -> str:
    cap = "none" if capability is None else f"sm_{capability[0]}{capability[1]}"
    rows = [("GPU compute capability", cap), ("profile", launch.profile),
            (f"dump dir ({ENV_DIR})", launch.env[ENV_DIR])]
    rows += [(" ".join(s.args), "applied") for s in launch.applied]
    rows += [(" ".join(s.args), "overridden by your arguments") for s in launch.overridden]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"hsdump serve: {k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hsdump serve``."""
    capability = blackwell.detect_compute_capability() if args.profile == "auto" else None
    try:
        launch = plan(args, capability)
    except ServeError as e:
        print(e, file=sys.stderr)
        return 2
    print(_summary(launch, capability), file=sys.stderr)
    print("hsdump serve: " + shlex.join(launch.argv), file=sys.stderr, flush=True)
    if launch.bridge_argv is not None:
        print("hsdump serve: once ready, beside it: " + shlex.join(launch.bridge_argv),
              file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    if launch.bridge_argv is None:
        os.execve(launch.argv[0], launch.argv, launch.env)
    return supervise(launch, args.bridge_wait)


def _say(message: str) -> None:
    print(f"hsdump serve: {message}", file=sys.stderr, flush=True)


def _ready(url: str) -> bool:
    with contextlib.suppress(requests.RequestException):
        return requests.get(url, timeout=5).status_code == 200
    return False


def _exit_status(rc: int) -> str:
    """``rc`` as a person reads it: ``3``, or ``-9 (SIGKILL)``."""
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"{rc} ({signal.Signals(-rc).name})"
    return str(rc)


class _Bridge:
    """The supervised ``hsdump bridge``: its process, its output relayed to stderr and its
    last ``BRIDGE_LOG_LINES`` lines kept, its restarts."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.next_start = 0.0  # monotonic time of the next (re)start
        self.delay = BRIDGE_BACKOFF[0]
        self.restarts: collections.deque[float] = collections.deque()
        self.tail: collections.deque[str] = collections.deque(maxlen=BRIDGE_LOG_LINES)
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        assert self.launch.bridge_argv is not None
        self.tail = tail = collections.deque(maxlen=BRIDGE_LOG_LINES)
        self.proc = proc = subprocess.Popen(
            self.launch.bridge_argv, env=self.launch.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.started = time.monotonic()

        def relay() -> None:  # the bridge's output goes to stderr as it comes
            for line in proc.stdout:
                tail.append(line)
                sys.stderr.write(line)
                sys.stderr.flush()

        self._reader = threading.Thread(target=relay, daemon=True)
        self._reader.start()

    def reap(self) -> None:
        """If the bridge exited: log it with its last lines and schedule its restart."""
        if self.proc is None or self.proc.poll() is None:
            return
        rc, ran = self.proc.returncode, time.monotonic() - self.started
        if self._reader is not None:
            self._reader.join(timeout=10)
        self.proc = None
        now = time.monotonic()
        if ran >= BRIDGE_HEALTHY_S:
            self.delay = BRIDGE_BACKOFF[0]
        while self.restarts and now - self.restarts[0] > BRIDGE_RESTART_WINDOW:
            self.restarts.popleft()
        wait = self.delay
        loop = ""
        if len(self.restarts) >= BRIDGE_MAX_RESTARTS:
            wait = max(wait, self.restarts[0] + BRIDGE_RESTART_WINDOW - now)
            loop = (f" The bridge is crash-looping: {len(self.restarts)} restarts in the last "
                    f"{BRIDGE_RESTART_WINDOW:g} s (at most {BRIDGE_MAX_RESTARTS}).")
        self.delay = min(self.delay * 2, BRIDGE_BACKOFF[1])
        self.next_start = now + wait
        _say(f"the bridge exited with {_exit_status(rc)} after {ran:.1f} s; the server keeps "
             f"serving.{loop} Restarting the bridge in {wait:.1f} s; its last lines:\n"
             + "".join(self.tail).rstrip("\n"))

    def due(self) -> bool:
        return self.proc is None and time.monotonic() >= self.next_start

    def restart(self) -> None:
        self.restarts.append(time.monotonic())
        _say(f"restarting the bridge (restart {len(self.restarts)} in the last "
             f"{BRIDGE_RESTART_WINDOW:g} s)")
        self.start()


def supervise(launch: Launch, ready_timeout: float) -> int:
    """Run the server, then (once ``/ready``) the bridge, until the server exits or a SIGTERM /
    SIGINT comes; stop both. The bridge exiting restarts it alone (:class:`_Bridge`). Returns
    the server's exit code (0 after a signal, 1 when it was not ready in time)."""
    assert launch.bridge_argv is not None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = subprocess.Popen(launch.argv, env=launch.env, start_new_session=True)
    sidecar = _Bridge(launch)
    try:
        deadline = time.monotonic() + ready_timeout
        while not _ready(launch.ready_url):
            if server.poll() is not None:
                _say(f"the server exited with {server.returncode} before it was ready")
                return server.returncode
            if time.monotonic() > deadline:
                _say(f"the server was not ready at {launch.ready_url} within "
                     f"{ready_timeout:g} s (--bridge-wait): stopping it")
                return 1
            if stop.wait(2):
                return 0
        _say("the server is ready: starting the bridge")
        sidecar.start()
        while not stop.wait(SUPERVISE_POLL_S):
            if server.poll() is not None:
                _say(f"the server exited with {_exit_status(server.returncode)}: stopping the "
                     "bridge")
                return server.returncode
            sidecar.reap()
            if sidecar.due():
                sidecar.restart()
        return 0
    finally:
        if sidecar.proc is not None:
            stop_group(sidecar.proc)
        stop_group(server)
        if server.returncode not in (None, 0, -signal.SIGTERM):
            _say(f"the server stopped with {server.returncode}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hsdump serve``."""
    env = os.environ.get
    p = subparsers.add_parser(
        "serve", help="launch an SGLang server configured for hidden-state extraction",
        description=f"Launch python -m sglang.launch_server with {guards.DISABLE_GRAPHS_FLAGS} "
        "--disable-radix-cache, the dump directory and the GPU profile. Arguments after '--' "
        "go to SGLang unchanged; a profile setting is skipped when they set the same flag.",
    )
    p.add_argument("--model", default=env("HSDUMP_MODEL"), required=not env("HSDUMP_MODEL"),
                   help="model path or hub id (default: $HSDUMP_MODEL; required without it)")
    p.add_argument("--tp", type=int, default=int(env("HSDUMP_TP", "1")),
                   help="tensor parallel size (default: $HSDUMP_TP or 1)")
    p.add_argument("--host", default=env("HSDUMP_HOST", "127.0.0.1"),
                   help="address to bind (default: $HSDUMP_HOST or 127.0.0.1; 0.0.0.0 to publish "
                        "a container port)")
    p.add_argument("--port", type=int, default=int(env("HSDUMP_PORT", "30000")),
                   help="HTTP port (default: $HSDUMP_PORT or 30000; the image's health check "
                        "reads $HSDUMP_PORT)")
    p.add_argument("--dump-dir", default=env(ENV_DIR, DEFAULT_DUMP_DIR),
                   help=f"absolute dump directory (default: ${ENV_DIR} or "
                        f"{DEFAULT_DUMP_DIR})")
    p.add_argument("--profile", choices=blackwell.PROFILES, default="auto",
                   help="GPU profile: auto detects the compute capability (sm_120 -> sm120, "
                        "sm_100 -> sm100, else none); see docs/image.md (default: auto)")
    p.add_argument("--bridge", action="store_true",
                   default=env("HSDUMP_BRIDGE", "0") == "1",
                   help="also run hsdump bridge (SpecForge's online capture into Mooncake, "
                        "docs/online.md) beside the server, started once the server is ready "
                        "and restarted alone when it exits (default: off; $HSDUMP_BRIDGE=1 "
                        "turns it on)")
    p.add_argument("--mooncake-master", default=env("HSDUMP_MOONCAKE_MASTER"),
                   help="the bridge's Mooncake master, host:port (default: "
                        "$HSDUMP_MOONCAKE_MASTER; required with --bridge)")
    p.add_argument("--mooncake-metadata", default=env("HSDUMP_MOONCAKE_METADATA"),
                   help="the bridge's Mooncake metadata server URL (default: "
                        "$HSDUMP_MOONCAKE_METADATA; required with --bridge)")
    p.add_argument("--bridge-host", default=env("HSDUMP_BRIDGE_HOST", bridge.DEFAULT_HOST),
                   help=f"address the bridge listens on (default: $HSDUMP_BRIDGE_HOST or "
                        f"{bridge.DEFAULT_HOST})")
    p.add_argument("--bridge-port", type=int,
                   default=int(env("HSDUMP_BRIDGE_PORT", str(bridge.DEFAULT_PORT))),
                   help=f"port the bridge listens on (default: $HSDUMP_BRIDGE_PORT or "
                        f"{bridge.DEFAULT_PORT})")
    p.add_argument("--bridge-arg", action="append", default=shlex.split(env("HSDUMP_BRIDGE_ARGS",
                                                                          "")),
                   help="a further hsdump bridge argument, repeatable, e.g. "
                        "--bridge-arg=--segment-size=64GiB (default: $HSDUMP_BRIDGE_ARGS, "
                        "split as a shell does, or none)")
    p.add_argument("--bridge-wait", type=float, default=DEFAULT_BRIDGE_WAIT,
                   help="seconds the server may take to become ready before the bridge starts; "
                        f"past them both stop (default: {DEFAULT_BRIDGE_WAIT:g})")
    p.add_argument("--dry-run", action="store_true",
                   help="print the server command and exit (default: off)")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER,
                   help="after '--': further arguments for sglang.launch_server (default: none)")
    p.set_defaults(func=run)
