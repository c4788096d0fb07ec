"""``hsdump serve``, the image's entrypoint, and its Blackwell profile, without an engine: the
profile chosen by compute capability, the command it builds, the arguments it refuses
(tests/image/test_image.py runs the image itself)."""

from __future__ import annotations

import http.server
import json
import os
import sys
from pathlib import Path

import pytest

from hsdump_patch import cli
from hsdump_patch.ops import blackwell, serve

DEEPSEEK_FP8 = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512,
                "quantization_config": {"quant_method": "fp8"}}


def _serve_args(argv: list[str]):
    return cli.build_parser().parse_args(["serve", *argv])


def _model_dir(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


# ------------------------------------------------------------------ serve and profile, no engine


def test_profile_is_chosen_by_compute_capability():
    assert blackwell.profile_for((12, 0)) == "sm120"
    assert blackwell.profile_for((12, 1)) == "sm120"
    assert blackwell.profile_for((10, 0)) == "sm100"
    assert blackwell.profile_for((9, 0)) == "none"
    assert blackwell.profile_for(None) == "none"


def test_sm120_profile_for_deepseek_fp8_mla():
    got = {s.dest: s.args for s in blackwell.profile_settings("sm120", DEEPSEEK_FP8, tp=8)}
    assert got == {
        "attention_backend": ("--attention-backend", "triton"),
        "fp8_gemm_runner_backend": ("--fp8-gemm-backend", "triton"),
        "moe_runner_backend": ("--moe-runner-backend", "triton"),
        "disable_custom_all_reduce": ("--disable-custom-all-reduce",),
    }
    # One GPU, an unquantised MHA model: nothing to change.
    assert blackwell.profile_settings("sm120", {"architectures": ["LlamaForCausalLM"]}, 1) == []
    # DSA models (DeepSeek-V3.2) need SGLang's own dsa backend: no MLA override.
    dsa = {**DEEPSEEK_FP8, "index_topk": 2048}
    assert "attention_backend" not in {s.dest for s in blackwell.profile_settings("sm120", dsa, 1)}
    assert blackwell.profile_settings("sm100", DEEPSEEK_FP8, tp=8) == []
    with pytest.raises(ValueError, match="unknown profile"):
        blackwell.profile_settings("sm90", DEEPSEEK_FP8, 1)


def test_profile_flags_are_valid_sglang_flags():
    """Every flag the profile adds parses with SGLang 0.5.23's own parser, into its dest."""
    for s in blackwell.profile_settings("sm120", DEEPSEEK_FP8, tp=8):
        assert s.dest in serve.explicit_options(list(s.args)), s


def test_serve_command_carries_extraction_flags_and_profile(tmp_path):
    model = _model_dir(tmp_path, DEEPSEEK_FP8)
    launch = serve.plan(_serve_args(["--model", str(model), "--tp", "8", "--port", "31000",
                                     "--profile", "sm120", "--", "--mem-fraction-static",
                                     "0.8", "--attention-backend", "flashinfer"]), None)
    argv = launch.argv
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert serve.REQUIRED_ARGS == ("--cuda-graph-backend-prefill", "disabled",
                                   "--cuda-graph-backend-decode", "disabled",
                                   "--disable-radix-cache")
    assert " ".join(serve.REQUIRED_ARGS) in " ".join(argv)
    assert argv[argv.index("--tp-size") + 1] == "8"
    assert argv[argv.index("--port") + 1] == "31000"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[-4:] == ["--mem-fraction-static", "0.8", "--attention-backend", "flashinfer"]
    # The user's --attention-backend wins: the profile's triton is not added.
    assert argv.count("--attention-backend") == 1
    assert [s.dest for s in launch.overridden] == ["attention_backend"]
    assert {s.dest for s in launch.applied} == {"fp8_gemm_runner_backend", "moe_runner_backend",
                                                "disable_custom_all_reduce"}
    assert launch.env["SGLANG_HS_DUMP_DIR"] == serve.DEFAULT_DUMP_DIR


def test_serve_auto_profile_follows_detected_capability(tmp_path):
    args = _serve_args(["--model", str(_model_dir(tmp_path, DEEPSEEK_FP8)), "--tp", "2"])
    assert serve.plan(args, (12, 0)).profile == "sm120"
    assert "--fp8-gemm-backend" in serve.plan(args, (12, 0)).argv
    assert serve.plan(args, (9, 0)).profile == "none"
    none = _serve_args(["--model", str(tmp_path), "--profile", "none"])
    assert "--fp8-gemm-backend" not in serve.plan(none, (12, 0)).argv


@pytest.mark.parametrize(("extra", "message"), [
    (["--tp-size", "2"], "--tp is an option of hsdump serve"),
    (["--model-path", "/m"], "--model is an option of hsdump serve"),
    (["--port", "1"], "--port is an option of hsdump serve"),
    (["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill full turns CUDA"),
    (["--cuda-graph-backend-decode", "breakable"], "--cuda-graph-backend-decode breakable"),
    (["--enable-two-batch-overlap"], "Remove --enable-two-batch-overlap"),
    (["--pipeline-parallel-size", "2"], "pipeline parallel size is 2"),
    (["--enable-dp-attention"], "DP attention is on"),
    (["--enable-prefill-cp"], "prefill context parallel"),
    (["--pp", "2"], "ambiguous option: --pp could match"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_serve_refuses_contradictory_arguments(tmp_path, extra, message):
    with pytest.raises(serve.ServeError) as e:
        serve.plan(_serve_args(["--model", str(tmp_path), "--", *extra]), None)
    assert message in str(e.value)


def test_serve_rejects_relative_dump_dir_and_reports_on_the_cli(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path), "--dump-dir", "rel/dir",
                     "--profile", "none"]) == 2
    assert "--dump-dir must be an absolute path" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(tmp_path), "--profile", "none", "--dry-run",
                     "--", "--enable-two-batch-overlap"]) == 2
    assert "cannot be used for extraction" in capsys.readouterr().err


def test_serve_dry_run_prints_the_command(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path), "--profile", "none", "--dry-run",
                     "--dump-dir", "/dev/shm/x", "--", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "profile                        none" in err
    assert ("--cuda-graph-backend-prefill disabled --cuda-graph-backend-decode disabled "
            "--disable-radix-cache --device cpu") in err
    assert "/dev/shm/x" in err


def test_compute_capability_from_nvidia_smi(tmp_path, monkeypatch):
    """The nvidia-smi query and its parsing (a script answering like 8 RTX PRO 6000 and one
    older GPU): the lowest capability decides."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=compute_cap ] || exit 9\n"
                   "printf '12.0\\n%.0s' 1 2 3 4 5 6 7 8\necho 9.0\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert blackwell.detect_compute_capability() == (9, 0)


# ------------------------------------------- serve --bridge: supervision, small stand-in children

# The server: answers 200 to every GET (so /ready) on the port argv[1], its pid in argv[2].
STAND_IN_SERVER = """
import http.server, os, pathlib, sys
pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
# The bridge: appends its pid to argv[1], prints a line, then exits with 3 ("crash") or sleeps.
STAND_IN_BRIDGE = """
import os, pathlib, sys, time
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
print(f"stand-in bridge {os.getpid()} up", flush=True)
if sys.argv[2] == "crash":
    sys.exit(3)
time.sleep(600)
"""
# Runs serve.supervise on the two stand-ins with a fast restart policy, prints its result.
DRIVER = """
import json, sys
from hsdump_patch.ops import serve
cfg = json.loads(sys.argv[1])
serve.BRIDGE_BACKOFF = (0.2, 0.8)
serve.BRIDGE_MAX_RESTARTS = 3
serve.BRIDGE_RESTART_WINDOW = 60.0
launch = serve.Launch(cfg["server"], dict(__import__("os").environ), "none",
                      bridge_argv=cfg["bridge"], ready_url=cfg["ready"])
print(f"rc={serve.supervise(launch, 60)}", flush=True)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(cond, timeout: float, what: str, log: Path) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}; log:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _supervised(tmp_path: Path, mode: str):
    """``serve.supervise`` in a subprocess (it installs signal handlers) over the stand-ins;
    returns the process, its log, the server's pid file and the bridge's pid list file."""
    import subprocess

    port, pids, spid = _free_port(), tmp_path / "bridge-pids", tmp_path / "server-pid"
    cfg = {"server": [sys.executable, "-c", STAND_IN_SERVER, str(port), str(spid)],
           "bridge": [sys.executable, "-c", STAND_IN_BRIDGE, str(pids), mode],
           "ready": f"http://127.0.0.1:{port}/ready"}
    log = tmp_path / "serve.log"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(cfg)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    return proc, log, spid, pids


def _pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_serve_bridge_crash_loop_restarts_the_bridge_alone_and_keeps_the_server(tmp_path):
    """A bridge that exits at once, every time: each exit is logged with its status and last
    lines and it alone is restarted with a growing backoff; past BRIDGE_MAX_RESTARTS in the
    window the crash loop is logged and restarts wait; the server runs throughout; SIGTERM
    then stops both (exit 0). (Before: the bridge's first exit stopped the server, exit 1.)"""
    import signal

    proc, log, spid, pids = _supervised(tmp_path, "crash")
    try:
        _wait_for(lambda: len(_pids(pids)) >= 4 or proc.poll() is not None, 30,
                  "four bridge starts", log)
        _wait_for(lambda: "crash-looping" in log.read_text() or proc.poll() is not None, 10,
                  "the crash loop logged", log)
        text = log.read_text()
        assert proc.poll() is None, text
        server = int(spid.read_text())
        assert _alive(server), text
        assert text.count("the bridge exited with 3 after") == 4, text
        assert "the server keeps serving" in text and "stand-in bridge" in text, text
        assert "Restarting the bridge in 0.2 s" in text and "in 0.4 s" in text, text
        assert "crash-looping: 3 restarts in the last 60 s (at most 3)" in text, text
        assert len(_pids(pids)) == 4, text  # the fourth restart waits for the window
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "rc=0" in text, text
    _wait_for(lambda: not _alive(server), 10, "the server stopped", log)


def test_serve_bridge_sigkilled_is_restarted_and_the_servers_exit_still_ends_serve(tmp_path):
    """A SIGKILLed bridge is logged as such and restarted while the server keeps running; the
    server's own exit still ends supervision with its exit code and stops the bridge."""
    import signal

    proc, log, spid, pids = _supervised(tmp_path, "sleep")
    try:
        _wait_for(lambda: len(_pids(pids)) >= 1 or proc.poll() is not None, 30,
                  "the bridge started", log)
        first = _pids(pids)[0]
        os.kill(first, signal.SIGKILL)
        _wait_for(lambda: len(_pids(pids)) >= 2 or proc.poll() is not None, 10,
                  "the bridge restarted", log)
        text = log.read_text()
        assert proc.poll() is None, text
        assert "the bridge exited with -9 (SIGKILL)" in text, text
        server, second = int(spid.read_text()), _pids(pids)[1]
        assert _alive(server) and _alive(second), text
        os.kill(server, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "the server exited with -9 (SIGKILL): stopping the bridge" in text, text
    assert "rc=-9" in text, text
    _wait_for(lambda: not _alive(second), 10, "the bridge stopped", log)


class _StandInServer(http.server.BaseHTTPRequestHandler):
    """An SGLang server to the bridge: 200 "ok" to any GET, one row to a POST."""

    protocol_version = "HTTP/1.1"

    def _ok(self, raw: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._ok(b"ok")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._ok(json.dumps([{"meta_info": {"id": "r"}}]).encode())

    def log_message(self, *a) -> None:
        pass


def test_the_bridge_answers_502_while_the_server_is_down_and_serves_once_it_is_back():
    """A server restart needs no bridge restart: the bridge's HTTP service answers a
    spec_capture /generate and a passed-through call; with the server gone it answers both 502
    (SpecForge's retryable batch failure) and stays up; once a server listens on the same port
    again, the same service answers both again."""
    import threading

    import requests

    from hsdump_patch.client import bridge

    port = _free_port()
    upstream = f"http://127.0.0.1:{port}"

    class Capture:  # the engine call of Bridge.generate, without a dump dir or Mooncake
        engine = bridge.SGLangEngine(upstream, timeout=5)

        def generate(self, body):
            return self.engine(body["input_ids"], ["r"], None)

    def start_server() -> http.server.ThreadingHTTPServer:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _StandInServer)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def stop_server(server: http.server.ThreadingHTTPServer) -> None:
        server.shutdown()
        server.server_close()

    front = bridge.make_server(Capture(), "127.0.0.1", 0, upstream, timeout=5)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{front.server_address[1]}"
    capture = {"input_ids": [[1, 2]], "spec_capture": [{}]}
    session = requests.Session()

    def served() -> None:
        assert session.get(f"{url}/health", timeout=10).text == "ok"
        r = session.post(f"{url}/generate", json=capture, timeout=10)
        assert r.status_code == 200 and r.json() == [{"meta_info": {"id": "r"}}], r.text

    try:
        server = start_server()
        try:
            served()
        finally:
            stop_server(server)
        r = session.post(f"{url}/generate", json=capture, timeout=10)
        assert r.status_code == 502 and "ConnectionError" in r.json()["error"], r.text
        r = session.get(f"{url}/health", timeout=10)
        assert r.status_code == 502 and "did not answer GET /health" in r.json()["error"], r.text
        server = start_server()
        try:
            served()
        finally:
            stop_server(server)
    finally:
        front.shutdown()
        front.server_close()
