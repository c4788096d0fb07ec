"""`make smoke` without SERVER: a tiny model, a local CPU SGLang server with the capture patch,
``hsdump smoke`` against it, then the server stopped. Exit code: the smoke's (0 = PASS)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdump_patch.ops import launch, verify_model  # noqa: E402 - the repo root first
from hsdump_patch.ops.serve import REQUIRED_ARGS  # noqa: E402
from scripts.cpu_server import server_env  # noqa: E402

# Small prefill chunks, so the smoke's long prompt is dumped in several chunks.
SERVER_ARGS = ["--chunked-prefill-size", "32"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "smoke",
                        help="model, dump dir, server log and report (default .cache/smoke)")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint to serve (default: hsdump verify's tiny random "
                             "DeepSeek-V3, written to WORK/tiny-deepseek-v3)")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = args.model.resolve() if args.model else work / "tiny-deepseek-v3"
    if args.model is None and not (model / "config.json").exists():
        print(f"smoke: writing a tiny random DeepSeek-V3 to {model}", flush=True)
        verify_model.make_deepseek_v3(model, "cpu")
    elif not (model / "config.json").is_file():
        parser.error(f"--model {model}: no config.json there (a Hugging Face checkpoint dir)")
    dump = work / "dump"
    log = work / "server.log"
    port = launch.free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port), *launch.CPU_ARGS, *REQUIRED_ARGS,
            *SERVER_ARGS]
    print(f"smoke: starting a CPU SGLang server (log: {log})", flush=True)
    try:
        server = launch.Server.launch(argv, server_env(dump), log, f"http://127.0.0.1:{port}",
                                      timeout=900, what="the smoke's server")
    except launch.ServerFailed as e:
        print(f"smoke: {e}", file=sys.stderr)
        return 1
    try:
        return subprocess.call([sys.executable, "-m", "hsdump_patch.cli", "smoke", "--server",
                                server.url, "--dump-dir", str(dump), "--report",
                                str(work / "report.json"), "--no-progress"], cwd=REPO)
    finally:
        server.stop()
        print("smoke: server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
