"""`make smoke` without SERVER: a tiny model, a local CPU SGLang server with the capture patch,
``hsdump smoke`` against it, then the server stopped. Exit code: the smoke's (0 = PASS)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness import make_models  # noqa: E402 - the repo root must be importable first
from tests.harness import server as srv  # noqa: E402

# Small prefill chunks, so the smoke's long prompt is dumped in several chunks.
SERVER_ARGS = ["--chunked-prefill-size", "32"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "smoke",
                        help="model, dump dir, server log and report (default .cache/smoke)")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        print(f"smoke: writing a tiny random Llama to {model}", flush=True)
        make_models.make_llama(model)
    dump = work / "dump"
    log = work / "server.log"
    print(f"smoke: starting a CPU SGLang server (log: {log})", flush=True)
    server = srv.start(model, log, args=SERVER_ARGS,
                       env={"SGLANG_HS_DUMP_DIR": str(dump), "SGLANG_HS_DUMP_FINAL": "1"})
    try:
        return subprocess.call([sys.executable, "-m", "hsdump_patch.cli", "smoke", "--server",
                                server.url, "--dump-dir", str(dump), "--report",
                                str(work / "report.json"), "--no-progress"], cwd=REPO)
    finally:
        server.stop()
        print("smoke: server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
