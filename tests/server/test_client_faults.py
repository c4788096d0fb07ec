"""Faults during an extraction (issue 21), against real CPU SGLang servers: a server killed and
restarted mid-run, two extractions sharing a server and sample ids, a client-side timeout."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from hsdump_patch import protocol
from hsdump_patch.client.output import records
from tests.harness import server as srv
from tests.harness.dump_server import CHUNK
from tests.harness.extraction import extract, pre_tokenized, read_report
from tests.harness.rows import write_jsonl

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]


def extract_cmd(server, dataset: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hsdump_patch.cli", "extract", "--server", server.url,
            "--dump-dir", str(server.dump_dir), "--dataset", str(dataset), "--out", str(out),
            "--no-progress", *extra]


def request_dirs(dump_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(dump_dir) if (dump_dir / n).is_dir())


def check_records(out: Path, rows: list[dict]) -> None:
    for row in rows:
        rec = torch.load(out / f"{row['id']}.pt", weights_only=True)
        assert rec["input_ids"].tolist() == row["input_ids"]


@pytest.mark.last_on("llama_server")
def test_a_server_killed_and_restarted_mid_run_finishes_every_sample_in_the_same_run(
        tmp_path, llama_server):
    """SIGKILL the server while a sample is half dumped, restart it on the same port and dump
    dir: the client re-sends, and the new attempt never meets the old attempt's chunks. The
    server is the session's tiny-Llama one at the end of its life (``last_on``), and only this
    run's request directories are looked at."""
    server = llama_server
    dump = server.dump_dir
    earlier = set(request_dirs(dump))
    try:
        # Short and long prompts, no length a multiple of the chunk: batches mix them, so a
        # prompt's chunk boundaries depend on what shared its batches.
        rows = pre_tokenized(6, seed=31, lo=40, hi=70, prefix="rs")
        for i in (1, 3, 5):
            rows[i] = pre_tokenized(1, seed=40 + i, lo=300, hi=450, prefix="x")[0] | {
                "id": f"rs{i}"}
        dataset = write_jsonl(tmp_path / "d.jsonl", rows)
        out = tmp_path / "out"
        proc = subprocess.Popen(
            extract_cmd(server, dataset, out, "--concurrency", "6", "--retries", "12",
                        "--retry-wait", "0.5", "--dump-timeout", "120"),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while True:  # a request half dumped, at a boundary that is not a multiple of the chunk
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no sample was ever caught half dumped"
            half = []
            for name in set(request_dirs(dump)) - earlier:
                files = set(os.listdir(dump / name)) if (dump / name).exists() else set()
                starts = [int(f[6:16]) for f in files if f.startswith("chunk-")]
                if not {"done.json", "error.json"} & files and any(p % CHUNK for p in starts):
                    half.append(name)
            if half:
                break
            time.sleep(0.005)
        os.killpg(server.server.proc.pid, signal.SIGKILL)
        server.server.proc.wait()
        log = tmp_path / "server-restart.log"
        again = srv.Server(srv.launch(server.model, log, args=server.server.args,
                                      env=server.env),
                           server.server.url, log, server.server.args)
        server.server = again
        try:
            output, _ = proc.communicate(timeout=420)
        finally:
            proc.kill()
        assert proc.returncode == 0, f"{output}\n{again.log()[-3000:]}"
        rep = read_report(out)
        assert (rep["ok"], rep["failed"]) == (len(rows), 0), rep["issues"]
        check_records(out, rows)
        assert set(request_dirs(dump)) - earlier == set()
    finally:
        server.server.stop()


def test_two_extractions_with_the_same_ids_on_one_server_never_touch_each_others_dumps(
        tmp_path, llama_server):
    """Same sample ids, different outputs, one server, at the same time: each run has its own
    rids, so neither clears the other's dumps nor waits for them."""
    rows = pre_tokenized(8, seed=32, lo=60, hi=120, prefix="same")
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    dump_timeout = 150  # a run whose dump was taken fails after waiting this long
    outs = [tmp_path / "a", tmp_path / "b"]
    with cf.ThreadPoolExecutor(2) as pool:  # two runs at once, each with its own client
        codes = list(pool.map(lambda out: extract(
            llama_server, dataset, out, "--concurrency", "4", "--dump-timeout",
            str(dump_timeout)), outs))
    assert codes == [0, 0]
    for out in outs:
        rep = read_report(out)
        assert (rep["ok"], rep["failed"]) == (len(rows), 0), rep["issues"]
        assert rep["wall_s"] < dump_timeout / 3, "a run waited for a dump that was not its own"
        check_records(out, rows)
    run_ids = {json.loads((out / records.META_FILE).read_text())["run_id"] for out in outs}
    assert len(run_ids) == 2
    left = [protocol.rid_dirname(f"hsdump-{r}-{len(i)}-{i}") for r in run_ids
            for i in (row["id"] for row in rows)]
    assert set(left).isdisjoint(os.listdir(llama_server.dump_dir))


def server_busy(url: str) -> int:
    """Requests the server is running or has queued."""
    loads = requests.get(f"{url}/v1/loads", params={"include": "core"}, timeout=30).json()
    return sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in loads["loads"])


def test_a_timed_out_request_is_aborted_and_leaves_no_directory_behind(tmp_path, llama_server):
    """A prompt of ~110 prefill chunks and a request timeout far shorter than its prefill: the
    client aborts it on the server and removes its directory once the server stopped writing."""
    row = pre_tokenized(1, seed=33, lo=3500, hi=3500, prefix="slow")[0]
    dataset = write_jsonl(tmp_path / "d.jsonl", [row])
    out = tmp_path / "out"
    log = llama_server.server.log_path
    code = extract(llama_server, dataset, out, "--request-timeout", "0.3", "--on-error", "skip")
    seen = log.stat().st_size
    assert code == 3
    rep = read_report(out)
    assert rep["failed"] == 1 and "--request-timeout 0.3s" in rep["issues"][0]["reason"]
    run_id = json.loads((out / records.META_FILE).read_text())["run_id"]
    name = protocol.rid_dirname(f"hsdump-{run_id}-{len(row['id'])}-{row['id']}")
    assert server_busy(llama_server.url) == 0
    assert name not in os.listdir(llama_server.dump_dir)
    time.sleep(2)  # nothing more is prefilled or written for it
    assert name not in os.listdir(llama_server.dump_dir)
    with open(log, errors="replace") as f:
        f.seek(seen)
        assert "Prefill batch" not in f.read()
