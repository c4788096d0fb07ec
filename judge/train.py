"""One SpecForge 0.2.0 offline EAGLE-3 training run on a set of records, evaluated on the
held-out records by SpecForge's own evaluator (``eval/simulated_acc_len``)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from judge.target import LM_HEAD_KEY

REPO = Path(__file__).resolve().parents[1]
# A learning rate that moves no weight: Adam's step is about lr, far below a float's resolution
# of any weight, so this run's eval is the untrained drafter's, through the same code path.
UNTRAINED_LR = 1e-30


@dataclass
class Run:
    """What one training run is given."""

    condition: str
    seed: int
    records: Path
    vocab_mapping: Path
    steps: int
    learning_rate: float = 1e-3


@dataclass
class Result:
    """What it measured: SpecForge's eval metrics on the held-out records."""

    condition: str
    seed: int
    simulated_acc_len: float
    per_position_acc: list[float]
    seconds: float
    metrics: dict = field(default_factory=dict)


def config(run: Run, target: Path, draft: Path, eval_records: Path, out: Path,
           max_length: int) -> dict:
    """SpecForge's run config (its ``Config`` schema) for ``run``."""
    return {
        "model": {"target_model_path": str(target), "draft_model_config": str(draft),
                  "vocab_mapping_path": str(run.vocab_mapping), "lm_head_key": LM_HEAD_KEY,
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(run.records),
                 "eval_hidden_states_path": str(eval_records), "max_length": max_length,
                 "dataloader_num_workers": 0},
        "training": {"num_epochs": 1000, "max_steps": run.steps, "batch_size": 1,
                     "learning_rate": run.learning_rate, "ttt_length": 7,
                     "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "log_interval": run.steps, "eval_interval": run.steps, "seed": run.seed},
        "run_id": f"{run.condition}-s{run.seed}",
        "output_dir": str(out),
    }


def eval_metrics(log: str) -> dict:
    """The last ``eval/*`` metrics SpecForge's trainer printed (``step N: {...}``)."""
    found = [line for line in log.splitlines()
             if line.startswith("step ") and "'eval/simulated_acc_len'" in line]
    if not found:
        raise RuntimeError("SpecForge printed no eval metrics; its output ends:\n" + log[-3000:])
    return ast.literal_eval(found[-1].split(": ", 1)[1])


def train(run: Run, target: Path, draft: Path, eval_records: Path, work: Path,
          max_length: int, specforge_path: str, threads: int = 1) -> Result:
    """Train and evaluate one drafter (``specforge train`` through the CPU loss shim)."""
    out = work / "runs" / f"{run.condition}-s{run.seed}"
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "run.json"
    cfg.write_text(json.dumps(config(run, target, draft, eval_records, out / "ckpt",
                                     max_length), indent=1))
    env = dict(os.environ, SPECFORGE_DEVICE="cpu", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([specforge_path, str(REPO)]))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "judge.sf_cpu", "train", "-c", str(cfg)],
                          env=env, cwd=out, capture_output=True, text=True)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"specforge train failed for {run.condition} seed {run.seed} "
                           f"(exit {proc.returncode}); log {out / 'train.log'}:\n"
                           + (proc.stdout + proc.stderr)[-3000:])
    m = eval_metrics(proc.stdout)
    return Result(run.condition, run.seed, m["eval/simulated_acc_len"],
                  m["eval/per_position_acc"], time.perf_counter() - start, m)
