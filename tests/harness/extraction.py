"""Test-only: run ``hsdump extract`` against a test server, read its report, make
pre-tokenized rows, and the relative error the record-vs-HF checks use."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import torch

from hsdump_patch.cli import main as cli
from tests.harness import server as srv

# ||record - HF|| / ||HF|| per layer: SGLang's CPU kernels and HF's eager bf16 path round
# differently (measured up to ~4e-3 on the tiny Llama).
REL_TOL = 2e-2


def pre_tokenized(n: int, seed: int, lo: int = 20, hi: int = 150, prefix: str = "p"):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(lo, hi)
        ids = [rng.randint(10, 1000) for _ in range(length)]
        rows.append({"id": f"{prefix}{i}", "input_ids": ids,
                     "loss_mask": [0] * (length // 3) + [1] * (length - length // 3)})
    return rows


def extract(server, dataset: Path, out: Path, *extra: str) -> int:
    return cli(["extract", "--server", server.url, "--dump-dir", str(server.dump_dir),
                "--dataset", str(dataset), "--out", str(out), "--no-progress", *extra])


def read_report(out: Path, shard: str = "shard-0-of-1") -> dict:
    return json.loads((out / f"report.{shard}.json").read_text())


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def make_smoke(tmp_path: Path, *variables: str) -> subprocess.CompletedProcess:
    """``make smoke SMOKE_DIR=tmp_path VARIABLES...`` in the repository; a server it starts
    shares this test run's torch.compile cache (its tiny DeepSeek-V3 is the lane's, whose
    compiled helpers are then built once, not again by gcc)."""
    # -o: the venv stamp counts as fresh (`make test` has just built it; never reinstall here).
    return subprocess.run(["make", "-o", ".venv/.hsdump-installed", "smoke",
                           f"SMOKE_DIR={tmp_path}", *variables], cwd=srv.REPO, capture_output=True,
                          text=True, timeout=900,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": srv.inductor_cache()})
