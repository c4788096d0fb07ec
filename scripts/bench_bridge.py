#!/usr/bin/env python3
"""Online vs offline: ``hsdump bridge`` into Mooncake vs ``hsdump extract`` writing files.

    HSDUMP_SPECFORGE_PATH=/path/to/specforge-0.2.0 python scripts/bench_bridge.py \
        [--prompts 48] [--min-tokens 200] [--max-tokens 800] [--rounds 2] [--json out.json]

In one run, against one CPU SGLang 0.5.23 server it starts (tiny random Llama, bf16, dump on
with the final state, radix cache off, ``--chunked-prefill-size`` 256) and one local Mooncake
(master + HTTP metadata server, TCP), the same pre-tokenized prompts go through both paths, in
ABBA rounds:

* offline: ``hsdump extract --format specforge`` (in process) at ``--concurrency`` requests in
  flight, records written to a directory on disk;
* online: ``hsdump bridge`` (a subprocess, as deployed) and ``--producers`` threads of
  SpecForge 0.2.0's own ``SGLangServerCaptureAdapter.produce_refs``, ``--batch`` tasks per
  request (producers x batch = the offline concurrency), until every ref is readable.

It prints samples/s and feature bytes/s of each (medians over rounds; feature bytes = aux +
final + the int64 passthroughs, what the trainer reads), online / offline ratios, and the
bridge's own CPU seconds per GB published (its process's user + system time). Some refs of
every online round are read back with SpecForge's ``MooncakeFeatureStore.get`` and compared
with the offline record of the same prompt (within 2e-2 relative error per tensor: bf16 CPU
kernels round differently as the batch a prompt's chunks share differs), then every ref is
released.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hsdump_patch import protocol  # noqa: E402
from hsdump_patch.client import extract as ex  # noqa: E402
from hsdump_patch.client.output import records  # noqa: E402
from tests.harness import make_models  # noqa: E402
from tests.harness import server as srv  # noqa: E402
from tests.harness.needs import specforge_on_path  # noqa: E402
from tests.harness.online import local_mooncake, sf_adapter, sf_capture  # noqa: E402

CHUNK = 256


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[dict[str, Any]]:
    """Pre-tokenized rows (random ids, a third of each masked out)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(lo, hi)
        rows.append({"id": f"p{i}", "input_ids": [rng.randint(10, 1000) for _ in range(length)],
                     "loss_mask": [0] * (length // 3) + [1] * (length - length // 3)})
    return rows


def feature_bytes(tokens: int, info: protocol.ServerInfo) -> int:
    """What one path delivers for ``tokens`` tokens: aux + final in the model dtype, and three
    int64 passthroughs (input ids, loss mask, attention mask)."""
    itemsize = torch.empty(0, dtype=getattr(torch, info.dtype)).element_size()
    return tokens * ((len(info.layers) + 1) * info.hidden_size * itemsize + 3 * 8)


def offline(args: argparse.Namespace, server: srv.Server, dump_dir: Path, dataset: Path,
            out: Path) -> dict[str, float]:
    settings = ex.ExtractSettings(server=server.url, dump_dir=dump_dir, out=out, fmt="specforge",
                                  concurrency=args.producers * args.batch, progress=False)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    report = ex.extract(settings, dataset, prompt_check="off")
    wall = time.perf_counter() - t0
    if report.stopped or report.ok != args.prompts:
        raise SystemExit(f"bench_bridge: the offline run stopped: {report.stopped}")
    files = sum(p.stat().st_size for p in out.rglob("*.ckpt"))
    return {"wall_s": wall, "samples": report.ok, "tokens": report.tokens,
            "file_bytes": files, "client_cpu_s": time.process_time() - cpu0}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def online(args: argparse.Namespace, url: str, bridge_pid: int, store, rows, round_no: int,
           capture) -> tuple[dict[str, float], list]:
    from specforge.runtime.contracts import PromptTask

    tasks = [PromptTask(task_id=f"r{round_no}-{r['id']}", run_id="run", source_id=r["id"],
                        payload={"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]},
                        max_length=1 << 16) for r in rows]
    batches: queue.Queue = queue.Queue()
    for i in range(0, len(tasks), args.batch):
        batches.put(tasks[i:i + args.batch])
    refs: list = []
    errors: list[BaseException] = []

    def produce() -> None:
        adapter = sf_adapter(store, None, url=url)
        while True:
            try:
                batch = batches.get_nowait()
            except queue.Empty:
                return
            try:
                refs.extend(zip(batch, adapter.produce_refs(batch, capture=capture),
                                strict=True))
            except BaseException as e:  # reported after the round
                errors.append(e)
                return

    cpu0 = cpu_seconds(bridge_pid)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=produce) for _ in range(args.producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(bridge_pid) - cpu0
    failed = [ref for _, ref in refs if not hasattr(ref, "feature_specs")]
    if errors or failed or len(refs) != len(tasks):
        raise SystemExit(f"bench_bridge: the online round failed: {errors[:1]} {failed[:1]}")
    return {"wall_s": wall, "samples": len(refs),
            "tokens": sum(len(t.payload["input_ids"]) for t, _ in refs),
            "bridge_cpu_s": cpu}, refs


REL_TOL = 2e-2


def check_and_release(store, refs, out: Path, sample: int) -> float:
    """Read every ref with SpecForge's get (then release it); the first ``sample`` are
    compared with the offline records of the same prompts; the worst relative error."""
    worst = 0.0
    for n, (task, ref) in enumerate(refs):
        got, handle = store.get(ref)
        if n < sample:
            rec = torch.load(out / records.record_name(task.source_id, "specforge"),
                             weights_only=True)
            if got["input_ids"].flatten().tolist() != rec["input_ids"].flatten().tolist():
                raise SystemExit(f"bench_bridge: {task.source_id}: other token ids")
            for a, b in ((got["hidden_state"], rec["aux_hidden_state"]),
                         (got["target"], rec["hidden_state"])):
                b = b.float().view(a.shape)
                worst = max(worst, ((a.float() - b).norm() / b.norm()).item())
        store.release(handle)
    if worst > REL_TOL:
        raise SystemExit(f"bench_bridge: Mooncake and the offline records differ ({worst:.2e})")
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=48, help="prompts per pass (default 48)")
    p.add_argument("--min-tokens", type=int, default=200, help="shortest prompt (default 200)")
    p.add_argument("--max-tokens", type=int, default=800, help="longest prompt (default 800)")
    p.add_argument("--hidden", type=int, default=256, help="the model's hidden size (default 256)")
    p.add_argument("--producers", type=int, default=4,
                   help="SpecForge producer threads (default 4)")
    p.add_argument("--batch", type=int, default=4, help="tasks per request (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (default 2)")
    p.add_argument("--work", type=Path, default=None,
                   help="work dir for the model, logs and records (default: a temporary dir)")
    p.add_argument("--json", type=Path, default=None, help="write results here (default: none)")
    args = p.parse_args(argv)
    specforge_on_path()
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        model = make_models.make_llama(work / "tiny-llama", hidden=args.hidden)
        dump_dir = work / "dump"
        server = srv.start(model, work / "server.log",
                           args=["--chunked-prefill-size", str(CHUNK)],
                           env={"SGLANG_HS_DUMP_DIR": str(dump_dir), "SGLANG_HS_DUMP_FINAL": "1"})
        try:
            with local_mooncake(work) as mc:
                return run(args, server, dump_dir, work, mc, MooncakeFeatureStore)
        finally:
            server.stop()


def run(args: argparse.Namespace, server: srv.Server, dump_dir: Path, work: Path,
        mc: dict[str, str], store_cls) -> int:
    info = protocol.read_server_info(dump_dir)
    rows = prompts(args.prompts, args.min_tokens, args.max_tokens)
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(work / "bridge.err", "w") as err:
        bridge = subprocess.Popen(
            [sys.executable, "-m", "hsdump_patch.cli", "bridge", "--server", server.url,
             "--dump-dir", str(dump_dir), "--port", "0", "--mooncake-master", mc["master"],
             "--mooncake-metadata", mc["metadata"], "--segment-size", "1GiB",
             "--progress-interval", "0"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
            stderr=err, text=True)
    try:
        line = bridge.stdout.readline()
        if "serving on " not in line:
            raise SystemExit(f"bench_bridge: hsdump bridge did not start: "
                             f"{(work / 'bridge.err').read_text()[-2000:]}")
        url = line.split("serving on ")[1].split()[0]
        store = store_cls(store_id="bench", setup_kwargs={
            "local_hostname": "127.0.0.1", "metadata_server": mc["metadata"],
            "master_server_addr": mc["master"], "global_segment_size": 0,
            "local_buffer_size": 64 << 20})
        capture = sf_capture(layers=tuple(lay - 1 for lay in sorted(info.layers)),
                             hidden=info.hidden_size)
        # Warm-up of both paths (not timed): the server's first forwards, imports, buffers.
        offline(args, server, dump_dir, dataset, work / "warm")
        worst = check_and_release(
            store, online(args, url, bridge.pid, store, rows, -1, capture)[1], work / "warm",
            args.prompts)
        print(f"Mooncake vs the offline records, worst relative error: {worst:.2e}")
        runs: dict[str, list[dict[str, float]]] = {"offline": [], "online": []}
        for r in range(args.rounds * 2):
            for path in (("offline", "online") if r % 2 == 0 else ("online", "offline")):
                if path == "offline":
                    runs[path].append(offline(args, server, dump_dir, dataset, work / f"o{r}"))
                else:
                    res, refs = online(args, url, bridge.pid, store, rows, r, capture)
                    check_and_release(store, refs, work / "warm", 4)
                    runs[path].append(res)
    finally:
        bridge.terminate()
        bridge.communicate(timeout=60)
    return report(args, info, runs)


def report(args: argparse.Namespace, info: protocol.ServerInfo,
           runs: dict[str, list[dict[str, float]]]) -> int:
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in runs.items()}
    nbytes = feature_bytes(med["offline"]["tokens"], info)
    table = {}
    for path, m in med.items():
        table[path] = {"samples_per_s": m["samples"] / m["wall_s"],
                       "tokens_per_s": m["tokens"] / m["wall_s"],
                       "feature_MB_per_s": nbytes / m["wall_s"] / 1e6, "wall_s": m["wall_s"]}
    ratio = table["online"]["samples_per_s"] / table["offline"]["samples_per_s"]
    cpu_per_gb = med["online"]["bridge_cpu_s"] / (nbytes / 1e9)
    print(f"{args.prompts} prompts x {args.min_tokens}-{args.max_tokens} tokens "
          f"({med['offline']['tokens']:.0f} tokens, {nbytes / 1e6:.1f} MB of features), hidden "
          f"{info.hidden_size}, {len(info.layers)} aux layers + final, {info.dtype}; "
          f"{args.producers} producers x {args.batch} tasks vs extract --concurrency "
          f"{args.producers * args.batch}; medians of {args.rounds * 2} passes each")
    print("| path | samples/s | tokens/s | feature MB/s | wall s |")
    print("|---|---|---|---|---|")
    for path, t in table.items():
        print(f"| {path} | {t['samples_per_s']:.2f} | {t['tokens_per_s']:.0f} | "
              f"{t['feature_MB_per_s']:.2f} | {t['wall_s']:.2f} |")
    print(f"online / offline: {ratio:.3f}; bridge CPU {cpu_per_gb:.1f} s per GB published; "
          f"offline client CPU {med['offline']['client_cpu_s'] / (nbytes / 1e9):.1f} s per GB, "
          f"record files {med['offline']['file_bytes'] / 1e6:.1f} MB")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
            "args": {k: str(v) for k, v in vars(args).items()}, "medians": med, "table": table,
            "online_over_offline": ratio, "bridge_cpu_s_per_gb": cpu_per_gb}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
