"""``make judge``: train EAGLE-3 drafters on hsdump's records with SpecForge and measure what
they accept, beside the same conversations through SpecForge's own data path and negative
controls that must lose (docs/judge.md).

A rehearsal of the product loop on one CPU machine: a real 135M target (SmolLM2), a CPU SGLang
0.5.23 server with the capture plugin, ``hsdump regenerate`` / ``extract`` / ``specforge`` as
the README tells users, SpecForge 0.2.0's own trainer and evaluator. SGLang's CPU engine cannot
serve EAGLE-3 here, so the measure is SpecForge's ``eval/simulated_acc_len`` on held-out
records (docs/judge.md says why), not a served accept length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from hsdump_patch.ops import launch
from hsdump_patch.ops.serve import REQUIRED_ARGS
from hsdump_patch.protocol import ENV_DRAFT_CONFIG
from judge import anchor, controls, prompts, report, target
from judge.train import REPO, UNTRAINED_LR, Result, Run, train
from scripts.cpu_server import server_env

HSDUMP = [sys.executable, "-m", "hsdump_patch.cli"]
# What the judge trains on, hsdump's records first; the untrained drafter is run apart.
CONDITIONS = tuple(c for c in report.CONDITIONS if c != "untrained")
MAX_LENGTH = 2048  # SpecForge's data.max_length; `hsdump specforge --max-length` checks it


def hsdump(*args: str, quiet: bool) -> None:
    """Run one ``hsdump`` command as a user would; fail loudly."""
    subprocess.run([*HSDUMP, *args, *(["--no-progress"] if quiet else [])], check=True,
                   cwd=REPO, stdout=subprocess.DEVNULL if quiet else None)


def serve(model: Path, draft: Path, work: Path) -> launch.Server:
    """A CPU SGLang server of the target with the capture plugin, told the drafter's config
    (README step 1: the dump captures exactly the layers SGLang would feed that drafter)."""
    port = launch.free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", *launch.CPU_ARGS,
            *REQUIRED_ARGS]
    env = {**server_env(work / "dump"), ENV_DRAFT_CONFIG: str(draft)}
    return launch.Server.launch(argv, env, work / "server.log", f"http://127.0.0.1:{port}",
                                timeout=900, what="the judge's target server")


def make_data(args: argparse.Namespace, model: Path, draft: Path, work: Path) -> dict:
    """Rows, regenerated answers and every hsdump-made set of records; returns hsdump's
    extraction report for the regenerated training rows (its timing)."""
    train_rows, eval_rows = prompts.split(args.train_rows, args.eval_rows, seed=args.data_seed)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = work / "records"
    server = serve(model, draft, work)
    try:
        url, dump = server.url, str(work / "dump")
        for name in ("train", "eval"):
            hsdump("regenerate", "--server", url, "--dataset", str(data / f"{name}.jsonl"),
                   "--out", str(data / f"regen-{name}.jsonl"), "--max-new-tokens",
                   str(args.max_new_tokens), "--on-error", "skip", quiet=args.quiet)
        extracts = {"hsdump": ("regen-train", "completion"), "eval": ("regen-eval", "drafted"),
                    "drafted": ("regen-train", "drafted"), "original": ("train", "completion")}
        for name, (rows, mask) in extracts.items():
            if name in ("hsdump", "eval") or name in args.conditions:
                hsdump("extract", "--server", url, "--dump-dir", dump, "--dataset",
                       str(data / f"{rows}.jsonl"), "--out", str(rec / name), "--format",
                       "specforge", "--loss-mask", mask, "--on-error", "skip", quiet=args.quiet)
    finally:
        server.stop()
    for name in ("shifted", "layer0"):
        if name in args.conditions:
            controls.write(name, rec / "hsdump", rec / name, model)
    for name in ("hsdump", "drafted", "original", "shifted", "layer0"):
        if name == "hsdump" or name in args.conditions:
            hsdump("specforge", "--out", str(rec / name), "--draft-vocab-size",
                   str(args.draft_vocab_size), "--max-length", str(MAX_LENGTH), quiet=args.quiet)
    return json.loads(next((rec / "hsdump").glob("report.shard-*.json")).read_text())


def runs(args: argparse.Namespace, rec: Path) -> list[Run]:
    """Every training run: each condition at each seed, and the untrained drafter."""
    out = []
    for name in ("hsdump", *(c for c in CONDITIONS[1:] if c in args.conditions)):
        mapping = rec / name / "specforge-vocab-mapping.pt"
        out += [Run(name, seed, rec / name, mapping, args.steps, args.learning_rate)
                for seed in range(args.seeds)]
    out.append(Run("untrained", 0, rec / "hsdump", rec / "hsdump" / "specforge-vocab-mapping.pt",
                   1, UNTRAINED_LR))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make judge", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "judge" / "run",
                   help="rows, records, runs and reports (default .cache/judge/run; emptied "
                        "first)")
    p.add_argument("--cache", type=Path, default=REPO / ".cache" / "judge",
                   help="the converted target, kept between runs (default .cache/judge)")
    p.add_argument("--train-rows", type=int, default=200, help="training rows (default 200)")
    p.add_argument("--eval-rows", type=int, default=40, help="held-out rows (default 40)")
    p.add_argument("--max-new-tokens", type=int, default=96,
                   help="regeneration's limit per turn (default 96)")
    p.add_argument("--steps", type=int, default=300,
                   help="optimizer steps per training run, batch 1 (default 300)")
    p.add_argument("--seeds", type=int, default=3, help="training seeds per condition (default 3)")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="(default 1e-3)")
    p.add_argument("--draft-vocab-size", type=int, default=4096, help="(default 4096)")
    p.add_argument("--conditions", nargs="*", default=list(CONDITIONS[1:]),
                   choices=CONDITIONS[1:],
                   help="what to train beside hsdump's records and the untrained drafter "
                        f"(default: all: {' '.join(CONDITIONS[1:])})")
    p.add_argument("--jobs", type=int, default=2,
                   help="training runs at once, one thread each (default 2)")
    p.add_argument("--data-seed", type=int, default=0, help="the rows' seed (default 0)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or command output (default: shown)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specforge_path = os.environ.get("HSDUMP_SPECFORGE_PATH", "")
    if not Path(specforge_path, "specforge").is_dir():
        sys.exit("make judge: SpecForge 0.2.0's code is not at $HSDUMP_SPECFORGE_PATH "
                 "(`make judge` installs it into .venv; run it through make)")
    sys.path.insert(0, specforge_path)
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    model = target.checkpoint(args.cache.resolve())
    draft = target.draft_config(model, work / "draft" / "config.json", args.draft_vocab_size)
    t0 = time.perf_counter()
    hsdump_report = make_data(args, model, draft, work)
    data_s = time.perf_counter() - t0
    rec = work / "records"
    anchor_timing = None
    if "anchor" in args.conditions:
        anchor_timing = anchor.build(work / "data" / "regen-train.jsonl", model,
                                     target.hf_layers(draft), rec / "anchor",
                                     args.draft_vocab_size, MAX_LENGTH, not args.quiet)
    todo = runs(args, rec)
    results: list[Result] = []
    with ThreadPoolExecutor(args.jobs) as pool, tqdm(total=len(todo), desc="training runs",
                                                     disable=args.quiet) as bar:
        futures = [pool.submit(train, r, model, draft, rec / "eval", work, MAX_LENGTH,
                               specforge_path) for r in todo]
        for f in futures:
            results.append(f.result())
            bar.update(1)
    stats = report.summary(results)
    verdict = report.verdicts(stats)
    text = report.table(stats, verdict)
    title = (f"SmolLM2-135M target, 1-layer EAGLE-3 drafter, {args.steps} steps, "
             f"{args.seeds} seeds, {args.train_rows} train / {args.eval_rows} held-out rows")
    report.plot(stats, work / "judge.png", title)
    speed = {"hsdump_extract": {"tokens": hsdump_report["tokens"],
                                "tokens_per_s": hsdump_report["tokens_per_s"]},
             "specforge_anchor": anchor_timing and {
                 k: anchor_timing[k] for k in ("tokens", "tokens_per_s")}}
    report.write(work / "judge.json", {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        "measure": "SpecForge 0.2.0 eval/simulated_acc_len on held-out records (hsdump "
                   "extract --loss-mask drafted of regenerated held-out rows); not a served "
                   "accept length (docs/judge.md)",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": stats, "verdicts": verdict, "speed": speed,
        "runs": [r.__dict__ for r in results],
        "seconds": {"data": data_s, "total": time.perf_counter() - started}})
    print(text)
    if anchor_timing:
        print(f"data paths: hsdump extract {speed['hsdump_extract']['tokens_per_s']:.0f} tokens/s"
              f" (through the server) | SpecForge path {anchor_timing['tokens_per_s']:.0f} "
              "tokens/s (HF forward in-process)")
    print(f"report: {work / 'judge.json'}  plot: {work / 'judge.png'}  "
          f"({time.perf_counter() - started:.0f} s)")
    return 1 if any(v.startswith("FAIL") for v in verdict.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
