#!/usr/bin/env python3
"""What the server's prompt check costs ``hsdump extract`` (``--prompt-check server`` vs off).

    python scripts/bench_prompt_check.py --server URL --dump-dir DIR [--rows 16] \
        [--turns 8] [--tokens 2000] [--rounds 3] [--json out.json]

Against a running dump-enabled server, the same dataset of agent traces (``bench_render``'s
rows: ``--turns`` messages, about ``--tokens`` prompt tokens each, rendered with the server's
tokenizer) is extracted with the check off and on, in ABBA rounds into fresh output dirs. It
prints samples/s and tokens/s of each (medians over rounds), their ratio (on / off), the
turns the server checked and the check's added time per checked turn and per 1,000 prompt
tokens checked: on a GPU server, where the forward is far faster than on CPU, that absolute
cost is what to weigh against the forward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_render import chat_row

from hsdump_patch.client import extract as ex
from hsdump_patch.client import options
from hsdump_patch.client.server.api import ServerClient
from hsdump_patch.client.server.tokenizer import load_tokenizer


def run_once(args: argparse.Namespace, dataset: Path, out: Path, check: str) -> dict[str, Any]:
    """One extraction of ``dataset``; its throughput and checked turns."""
    settings = ex.ExtractSettings(server=args.server, dump_dir=args.dump_dir, out=out,
                                  progress=False, concurrency=args.concurrency, on_error="fail")
    t0 = time.perf_counter()
    report = ex.extract(settings, dataset, prompt_check=check, trust_remote_code=True)
    wall = time.perf_counter() - t0
    if report.stopped or report.ok != args.rows:
        raise SystemExit(f"bench_prompt_check: the {check} run stopped: {report.stopped}")
    return {"wall_s": wall, "samples_per_s": report.ok / wall, "tokens_per_s": report.tokens / wall,
            "tokens": report.tokens, "checked": report.prompts_checked_by_server or 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=options.DEFAULT_SERVER,
                   help=f"dump-enabled SGLang server (default {options.DEFAULT_SERVER})")
    p.add_argument("--dump-dir", type=Path, default=Path(ex.DEFAULT_DUMP_DIR),
                   help=f"its dump dir (default {ex.DEFAULT_DUMP_DIR})")
    p.add_argument("--rows", type=int, default=16, help="agent-trace rows (default 16)")
    p.add_argument("--turns", type=int, default=8, help="messages per row (default 8)")
    p.add_argument("--tokens", type=int, default=2000,
                   help="prompt tokens per row, about (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="ABBA rounds (default 3)")
    p.add_argument("--concurrency", type=int, default=ex.DEFAULT_CONCURRENCY,
                   help=f"requests in flight (default {ex.DEFAULT_CONCURRENCY})")
    p.add_argument("--json", type=Path, default=None, help="write results here (default: none)")
    args = p.parse_args(argv)

    client = ServerClient(args.server, request_timeout=600, retries=2, retry_wait=1)
    info = client.model_info()
    tok = load_tokenizer(info.get("tokenizer_path") or info["model_path"], True)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "server": []}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "rows.jsonl"
        row = chat_row(args.turns, args.tokens, tok)
        dataset.write_text("".join(json.dumps({**row, "id": f"r{n}"}) + "\n"
                                   for n in range(args.rows)))
        for r in range(args.rounds):
            for check in (("off", "server") if r % 2 == 0 else ("server", "off")):
                runs[check].append(run_once(args, dataset, Path(tmp) / f"{check}-{r}", check))
    med = {c: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for c, rs in runs.items()}
    checked = med["server"]["checked"]
    extra = med["server"]["wall_s"] - med["off"]["wall_s"]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "rows": args.rows, "turns": args.turns,
        "tokens_per_row": med["off"]["tokens"] / args.rows, "runs": runs, "median": med,
        "ratio_samples_per_s": med["server"]["samples_per_s"] / med["off"]["samples_per_s"],
        "checked_turns": checked,
        "added_ms_per_checked_turn": 1e3 * extra / checked if checked else None,
    }
    print("| --prompt-check | samples/s | tokens/s | wall s | turns checked |")
    print("|---|---|---|---|---|")
    for c in ("off", "server"):
        m = med[c]
        print(f"| {c} | {m['samples_per_s']:.2f} | {m['tokens_per_s']:.0f} | {m['wall_s']:.2f} "
              f"| {int(m['checked'])} |")
    print(f"| server / off | {result['ratio_samples_per_s']:.3f} | | | |")
    if checked:
        print(f"added time per checked turn: {result['added_ms_per_checked_turn']:.1f} ms "
              f"({args.rows} rows x {med['off']['tokens'] / args.rows:.0f} tokens, "
              f"{args.turns} messages)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
