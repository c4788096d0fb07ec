#!/usr/bin/env python3
"""Same-run comparison of this checkout's chat rendering and extraction client with another
commit's (issue 16's benchmark: within 10% of the baseline, rendering linear in turns).

    git worktree add --detach /work/wt/base e88eb7d
    python scripts/bench_ab.py --baseline-tree /work/wt/base [--rounds 5] [--json ab.json]
    git worktree remove /work/wt/base

Each round runs the same workload for the baseline tree and for this checkout in turn (AB,
then BA, and so on, so that load on the machine hits both), each in its own processes that
import their own tree's ``hsdump_patch`` (``--tree``), with one tokenizer (the tiny Kimi-K2.5
one, built once):

* ``scripts/bench_render.py --corpus --sweep``: ``ChatRenderer.render`` over a corpus of chat
  rows under each multi-turn policy (rows/s), and agent traces of ``--sweep`` messages (ms per
  message);
* ``scripts/bench_client.py --small --chat``: the extraction client's dataset-to-records path
  with rendering in the timed pass (samples/s, tokens/s).

It prints the medians over rounds (and the best round) of both trees, the ratio current /
baseline of each throughput (goal >= 0.90) and, from the sweep, the per-message time at the
longest conversation over the shortest (goal <= 1.5 for ``auto`` and ``last``; ``per-turn``
samples each hold their own prompt, so their size grows with the square of the turns).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_render import POLICIES, int_list, policy_list
from benchtree import ROOT

SCRIPTS = Path(__file__).resolve().parent
WITHIN = 0.90  # current / baseline throughput
LINEAR = 1.5  # per-message time, longest / shortest conversation
LINEAR_POLICIES = ("auto", "last")


def run_json(cmd: list[str], out: Path) -> dict[str, Any]:
    """Run a benchmark script; its JSON results (bench_client exits 1 on a missed goal of its
    own, which is not an error here)."""
    proc = subprocess.run([sys.executable, *cmd, "--json", str(out)], capture_output=True,
                          text=True, cwd=ROOT)
    if not out.exists():
        raise SystemExit(f"bench_ab: {' '.join(cmd)} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def one_tree(tree: Path, tag: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Both benchmarks for one tree; their JSON results."""
    common = ["--tree", str(tree), "--tokenizer", str(work / "tokenizer")]
    render = run_json([str(SCRIPTS / "bench_render.py"), *common, "--no-table",
                       "--corpus", str(args.corpus), "--sweep", ",".join(map(str, args.sweep)),
                       "--tokens-per-message", str(args.tokens_per_message),
                       "--policies", ",".join(args.policies), "--repeats", str(args.repeats)],
                      work / f"render-{tag}.json")
    client = run_json([str(SCRIPTS / "bench_client.py"), *common, "--hidden", "512",
                       "--chunk", "512", "--min-tokens", str(args.client_tokens[0]),
                       "--max-tokens", str(args.client_tokens[1]), "--gb", str(args.client_gb),
                       "--concurrency", str(args.concurrency),
                       "--chat", str(args.chat), "--multi-turn", args.multi_turn,
                       "--formats", args.formats,
                       "--dump-dir", str(args.dump_root / f"hsdump-ab-{os.getpid()}-{tag}"),
                       "--out-dir", str(work / f"out-{tag}")],
                      work / f"client-{tag}.json")
    for r in (render, client):
        if Path(r["tree"]) != tree:
            raise SystemExit(f"bench_ab: the {tag} run imported hsdump_patch from {r['tree']}, "
                             f"not {tree}")
    return {"render": render, "client": client}


def metrics(run: dict[str, Any]) -> dict[str, float]:
    """The throughputs of one tree's run, by name."""
    out = {}
    for policy, r in run["render"]["corpus"].items():
        out[f"render corpus, --multi-turn {policy}: rows/s"] = r["rows_per_s"]
    chat = run["client"]["chat"]["multi_turn"]
    for fmt, r in run["client"]["formats"].items():
        out[f"extraction, rendering included ({chat}, {fmt}): samples/s"] = r["records_per_s"]
        out[f"extraction, rendering included ({chat}, {fmt}): tokens/s"] = r["tokens_per_s"]
    return out


def sweep_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-message ms of each sweep point and policy, median over rounds; longest / shortest."""
    first = runs[0]["render"]["sweep"]
    whats = list(first["ratio"])
    points = []
    for i, p in enumerate(first["points"]):
        points.append({"messages": p["messages"], **{
            w: statistics.median(r["render"]["sweep"]["points"][i][w] for r in runs)
            for w in whats}})
    return {"points": points, "ratio": {w: points[-1][w] / points[0][w] for w in whats}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-tree", type=Path, required=True,
                   help="checkout of the baseline commit, e.g. a git worktree (required)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds, each running both trees (default 5)")
    p.add_argument("--corpus", type=int, default=24, help="chat rows rendered (default 24)")
    p.add_argument("--sweep", type=int_list, default=[8, 16, 32, 64, 128],
                   help="messages of the sweep's conversations (default 8,16,32,64,128)")
    p.add_argument("--tokens-per-message", type=int, default=420,
                   help="tokens per message of the corpus and sweep rows (default 420)")
    p.add_argument("--policies", type=policy_list, default=list(POLICIES),
                   help=f"policies rendered (default {','.join(POLICIES)})")
    p.add_argument("--repeats", type=int, default=3,
                   help="best of N inside each render run (default 3)")
    p.add_argument("--chat", type=int, default=16,
                   help="messages per chat row of the extraction run (default 16)")
    p.add_argument("--multi-turn", choices=POLICIES, default="auto",
                   help="the extraction run's multi-turn policy (default auto)")
    p.add_argument("--client-gb", type=float, default=0.1,
                   help="hidden-state GB of the extraction run, at bench_client's --small "
                        "shapes (hidden 512, 3 layers + final, 512-token chunks) (default 0.1)")
    p.add_argument("--client-tokens", type=int_list, default=[256, 2048], metavar="MIN,MAX",
                   help="shortest and longest prompt of the extraction run (default 256,2048)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="client threads of the extraction run (default 4)")
    p.add_argument("--formats", default="eagle3", help="record formats (default eagle3)")
    p.add_argument("--dump-root", type=Path, default=Path("/dev/shm"),
                   help="where the extraction run's dump dirs go (default /dev/shm)")
    p.add_argument("--json", type=Path, default=None,
                   help="write every round's results and the summary here (default: print "
                        "only)")
    args = p.parse_args()
    base, cur = args.baseline_tree.resolve(), ROOT
    if not (base / "hsdump_patch").is_dir():
        raise SystemExit(f"bench_ab: --baseline-tree {base} has no hsdump_patch")
    if len(args.client_tokens) != 2 or args.client_tokens[0] > args.client_tokens[1]:
        raise SystemExit("bench_ab: --client-tokens takes MIN,MAX")
    if args.rounds < 1:
        raise SystemExit("bench_ab: --rounds must be at least 1")

    sys.path.insert(0, str(ROOT))
    from tests.harness.make_models import make_kimi_tokenizer

    load = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    work = Path(tempfile.mkdtemp(prefix="hsdump-bench-ab-"))
    try:
        make_kimi_tokenizer(work / "tokenizer")
        for r in range(args.rounds):
            order = [("baseline", base), ("current", cur)]
            for name, tree in order if r % 2 == 0 else order[::-1]:
                runs[name].append(one_tree(tree, f"{name}-{r}", args, work))
                print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load += os.getloadavg()

    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores"
    print(f"# bench_ab {date} on {machine}, load average {min(load):.1f}-{max(load):.1f}")
    print(f"# baseline {base} vs current {cur}; {args.rounds} rounds (AB, BA, ...); "
          f"corpus {args.corpus} rows, best of {args.repeats} per run; extraction: "
          f"{runs['current'][0]['client']['samples']} samples of {args.chat}-message chat rows, "
          f"{args.client_gb} GB, {args.concurrency} threads")
    m = {name: [metrics(x) for x in rs] for name, rs in runs.items()}
    rows = []
    print("| throughput | baseline median (best) | current median (best) | current / baseline |")
    print("|---|---|---|---|")
    for key in m["current"][0]:
        b = [x[key] for x in m["baseline"]]
        c = [x[key] for x in m["current"]]
        ratio = statistics.median(c) / statistics.median(b)
        rows.append({"what": key, "baseline": b, "current": c, "ratio": ratio})
        print(f"| {key} | {statistics.median(b):,.1f} ({max(b):,.1f}) | "
              f"{statistics.median(c):,.1f} ({max(c):,.1f}) | {ratio:.2f} |")
    sweeps = {name: sweep_medians(rs) for name, rs in runs.items()}
    whats = list(sweeps["current"]["ratio"])
    print("\n| messages | " + " | ".join(f"{w} ms/message (baseline / current)" for w in whats)
          + " |")
    print("|---" * (len(whats) + 1) + "|")
    for pb, pc in zip(sweeps["baseline"]["points"], sweeps["current"]["points"], strict=True):
        print(f"| {pc['messages']} | " + " | ".join(f"{pb[w]:.3f} / {pc[w]:.3f}" for w in whats)
              + " |")
    print("| longest / shortest | " + " | ".join(
        f"{sweeps['baseline']['ratio'][w]:.2f} / {sweeps['current']['ratio'][w]:.2f}"
        for w in whats) + " |")
    within = all(row["ratio"] >= WITHIN for row in rows)
    linear = all(sweeps["current"]["ratio"][w] <= LINEAR for w in LINEAR_POLICIES if w in whats)
    print(f"\nwithin 10% (every current / baseline >= {WITHIN}): {'MET' if within else 'MISSED'}")
    print(f"linear in turns ({', '.join(LINEAR_POLICIES)}: longest / shortest <= {LINEAR}): "
          f"{'MET' if linear else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(
            {"date": date, "machine": machine, "load": load, "args": {
                k: str(v) for k, v in vars(args).items()}, "rows": rows, "sweep": sweeps,
             "within": within, "linear": linear, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
