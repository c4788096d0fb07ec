"""Benchmark: ``hsdump regenerate`` vs the same prompts sent straight to ``/generate``.

Both paths send the same token ids (rendered once with the chat template) with the same
greedy sampling, ``--max-new-tokens`` and concurrency to one CPU SGLang server (tiny random
Llama, started here unless ``--server``). The baseline is a thread pool posting ``/generate``;
``hsdump regenerate`` adds rendering, the output rows (fsynced) and the bookkeeping. The two run
alternately, ``--rounds`` times each after a warm-up; the table shows the median generated
tokens/s of each and the ratio (goal >= 0.95).

    .venv/bin/python scripts/bench_regenerate.py [--rows 48] [--max-new-tokens 64] \
        [--concurrency 16]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdump_patch.cli import main as cli  # noqa: E402 - the repo root must be importable first
from hsdump_patch.client.rows.conversation import prompt_ids  # noqa: E402
from tests.harness import make_models  # noqa: E402
from tests.harness import server as srv  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "hidden",
         "states", "from", "decoder", "layers", "are", "dumped", "to", "shared", "memory"]


def dataset(n: int) -> list[dict]:
    """``n`` distinct single-turn questions (distinct prompts: no shared prefix effects)."""
    return [{"id": f"b{i}", "messages": [{"role": "user", "content": " ".join(
        WORDS[(i + j) % len(WORDS)] for j in range(8 + i % 9)) + f"? ({i})"}]}
        for i in range(n)]


def baseline(url: str, prompts: list[list[int]], new: int, concurrency: int) -> tuple[float, int]:
    """Straight ``/generate`` calls at ``concurrency``; return (wall s, generated tokens)."""
    sessions: dict[int, requests.Session] = {}

    def one(ids: list[int]) -> int:
        s = sessions.setdefault(threading.get_ident(), requests.Session())
        r = s.post(f"{url}/generate", timeout=3600, json={
            "input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": new,
                                                  "skip_special_tokens": False}})
        r.raise_for_status()
        return len(r.json()["output_ids"])

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return time.perf_counter() - t0, tokens


def regenerate(url: str, data: Path, out: Path, new: int, concurrency: int) -> tuple[float, int]:
    """One ``hsdump regenerate`` run; return its run-loop wall time and generated tokens."""
    rc = cli(["regenerate", "--server", url, "--dataset", str(data), "--out", str(out),
              "--max-new-tokens", str(new), "--concurrency", str(concurrency), "--no-progress",
              "--temperature", "0"])
    assert rc == 0, f"hsdump regenerate exited {rc}"
    rep = json.loads(out.with_suffix(".report.json").read_text())
    return rep["wall_s"], rep["tokens"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None,
                   help="a running server (default: start a tiny CPU Llama here)")
    p.add_argument("--rows", type=int, default=48, help="prompts per pass (default 48)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="generated tokens per prompt (default 64)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed passes of each path, alternating (default 3)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    server = None
    url = args.server
    if url is None:
        model = make_models.make_llama(work / "tiny-llama")
        server = srv.start(model, work / "server.log")  # radix cache off: no reuse across passes
        url = server.url
    try:
        from transformers import AutoTokenizer

        info = requests.get(f"{url}/model_info", timeout=30).json()
        tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
        rows = dataset(args.rows)
        data = work / "d.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        prompts = [prompt_ids(tok, r["messages"]) for r in rows]
        new, conc = args.max_new_tokens, args.concurrency
        baseline(url, prompts[:conc], new, conc)  # warm-up
        results: dict[str, list[tuple[float, int]]] = {"base": [], "regen": []}
        for i in range(args.rounds):
            results["base"].append(baseline(url, prompts, new, conc))
            results["regen"].append(regenerate(url, data, work / f"out-{i}.jsonl", new, conc))
    finally:
        if server is not None:
            server.stop()

    def rate(runs: list[tuple[float, int]]) -> float:
        return statistics.median(tokens / wall for wall, tokens in runs)

    base = rate(results["base"])
    print(f"\n{platform.node()} ({platform.processor() or platform.machine()}), {args.rows} "
          f"prompts x {new} new tokens, concurrency {conc}, median of {args.rounds} rounds\n")
    print("| path                       | tokens | wall s (median) | tokens/s | ratio |")
    print("| -------------------------- | ------ | --------------- | -------- | ----- |")
    for name, key in (("/generate (baseline)", "base"), ("hsdump regenerate", "regen")):
        runs = results[key]
        wall = statistics.median(w for w, _ in runs)
        print(f"| {name:<26} | {runs[0][1]:>6} | {wall:>15.2f} | {rate(runs):>8.1f} | "
              f"{rate(runs) / base:>5.2f} |")
    print("\nall rounds (wall s, tokens): " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
