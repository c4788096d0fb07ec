"""Benchmark: hsdump (binary dump + ``hsdump extract``) vs SGLang's built-in JSON hidden states.

One server configuration serves both paths: the capture patch on, and SGLang's own
``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3``, so a request with
``return_hidden_states`` gets the same EAGLE-3 layers back as JSON lists. The same prompts go
through (a) ``hsdump extract`` and (b) ``/generate`` with ``return_hidden_states`` + JSON
parsing, each ending in the same eagle3 record on disk. Prints tokens/s of both and the ratio.

    .venv/bin/python scripts/bench_vs_json.py [--hidden 2048] [--prompts 16] [--tokens 512]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdump_patch import protocol  # noqa: E402 - the repo root must be importable first
from hsdump_patch.client import extract as ex  # noqa: E402
from hsdump_patch.client.dumps import dumpdir  # noqa: E402
from hsdump_patch.client.output import records  # noqa: E402
from hsdump_patch.client.rows.dataset import Shard  # noqa: E402
from tests.harness import make_models  # noqa: E402
from tests.harness import server as srv  # noqa: E402


def json_path(url: str, rows: list[dict], info: protocol.ServerInfo, out: Path,
              concurrency: int) -> tuple[float, int]:
    """Baseline: hidden states as JSON lists in the response; return (wall s, response bytes)."""
    k, h = len(info.layers), info.hidden_size
    out.mkdir(parents=True, exist_ok=True)
    session = requests.Session()

    def one(row: dict) -> int:
        body = {"rid": f"json-{row['id']}", "input_ids": row["input_ids"],
                "return_hidden_states": True,  # prefill-only requests return none: 1 new token
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        r = session.post(f"{url}/generate", json=body, timeout=3600)
        r.raise_for_status()
        hs = r.json()["meta_info"]["hidden_states"]
        n = len(row["input_ids"])
        t = torch.tensor(hs[0], dtype=torch.bfloat16)  # [0]: the prefill forward's [n, K*H]
        b = records.RecordBuilder("eagle3", n, info)
        b.put(0, t.reshape(n, k, h))
        records.save_atomic(b.record(row["input_ids"], row["loss_mask"]),
                            out / records.record_name(row["id"]))
        return len(r.content)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        size = sum(pool.map(one, rows))
    return time.perf_counter() - t0, size


def decode_costs(url: str, dump: Path, info: protocol.ServerInfo, row: dict,
                 repeats: int = 3) -> tuple[float, float]:
    """Client-side cost per token of getting one prompt's states into tensors (best of
    ``repeats``): JSON parse + tensor build vs reading the chunk files. On a GPU server, where
    the forward is fast, this cost (plus the server's own serialisation) bounds throughput."""
    n, k, h = len(row["input_ids"]), len(info.layers), info.hidden_size
    best_json = best_dump = float("inf")
    for i in range(repeats):
        body = {"input_ids": row["input_ids"], "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        raw = requests.post(f"{url}/generate", json=body, timeout=3600).content
        t0 = time.perf_counter()
        hs = json.loads(raw)["meta_info"]["hidden_states"][0]
        torch.tensor(hs, dtype=torch.bfloat16).reshape(n, k, h)
        best_json = min(best_json, time.perf_counter() - t0)

        rid = f"{info.rid_prefix}probe-{i}"
        body = {"rid": rid, "input_ids": row["input_ids"],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
        requests.post(f"{url}/generate", json=body, timeout=3600).raise_for_status()
        assert dumpdir.wait_for_marker(dump, rid, 60)
        t0 = time.perf_counter()
        dumpdir.read_request(dump, rid, row["input_ids"], info,
                              records.RecordBuilder("eagle3", n, info))
        best_dump = min(best_dump, time.perf_counter() - t0)
        dumpdir.remove_request(dump, rid)
    return best_json / n * 1e6, best_dump / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--work", type=Path, default=None, help="work dir (default: a temp dir)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="hsdump-bench-"))
    model = work / f"llama-h{args.hidden}-l{args.layers}"
    if not (model / "config.json").exists():
        make_models.make_llama(model, hidden=args.hidden, layers=args.layers)
    rng = random.Random(0)
    rows = [{"id": f"b{i}", "input_ids": [rng.randint(10, 1000) for _ in range(args.tokens)],
             "loss_mask": [1] * args.tokens} for i in range(args.prompts)]
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dump = work / "dump"
    # Whole prompts in one prefill chunk: the built-in JSON path drops middle chunks.
    server = srv.start(model, work / "server.log", env={"SGLANG_HS_DUMP_DIR": str(dump)},
                       args=["--chunked-prefill-size", str(max(8192, 2 * args.tokens)),
                             "--enable-return-aux-hidden-states", "--speculative-algorithm",
                             "EAGLE3"])
    try:
        info = protocol.read_server_info(dump)
        warm = [{**rows[0], "id": "warm"}]
        json_path(server.url, warm, info, work / "warm-json", 1)
        settings = ex.ExtractSettings(server=server.url, dump_dir=dump, out=work / "hsdump",
                                      concurrency=args.concurrency, progress=False)
        ex.extract(settings, dataset, shard=Shard())
        settings.out = work / "hsdump-run"
        rep = ex.extract(settings, dataset, shard=Shard())
        assert rep.ok == len(rows), rep.to_json()
        t_json, json_bytes = json_path(server.url, rows, info, work / "json", args.concurrency)
        us_json, us_dump = decode_costs(server.url, dump, info, rows[0])
    finally:
        server.stop()
    worst = 0.0
    for r in rows:
        a = records.load_record(settings.out / records.record_name(r["id"]))["hidden_states"]
        b = records.load_record(work / "json" / records.record_name(r["id"]))["hidden_states"]
        diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True)]
        worst = max(worst, *diffs)
    tokens = args.prompts * args.tokens
    rate_h, rate_j = tokens / rep.wall_s, tokens / t_json
    print(f"hsdump vs JSON hidden states: {args.prompts} prompts x {args.tokens} tokens, hidden "
          f"{args.hidden}, layers {list(info.layers)}, {info.dtype}, concurrency "
          f"{args.concurrency}, CPU server ({platform.processor() or platform.machine()})")
    print(f"  {'path':<34} {'wall s':>8} {'tokens/s':>10} {'ratio':>7}")
    print(f"  {'JSON return_hidden_states':<34} {t_json:>8.2f} {rate_j:>10.1f} {1.0:>7.2f}")
    print(f"  {'hsdump extract (files)':<34} {rep.wall_s:>8.2f} {rate_h:>10.1f} "
          f"{rate_h / rate_j:>7.2f}")
    print(f"  JSON response bytes {json_bytes / 1e6:.1f} MB vs records {rep.bytes / 1e6:.1f} MB; "
          f"max |hsdump - JSON| = {worst:.3g}")
    print(f"  client-side decode per token: JSON {us_json:.1f} us, hsdump {us_dump:.1f} us "
          f"({us_json / us_dump:.1f}x); alone they cap a client at {1e6 / us_json:,.0f} vs "
          f"{1e6 / us_dump:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
