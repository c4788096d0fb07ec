#!/usr/bin/env python3
"""Benchmark the extraction client's dump-to-record path against the disk limits (issue 9.7).

Needs no server. It writes synthetic requests in the real file protocol (``server.json``,
chunk files with the safetensors header of :mod:`hsdump_patch.protocol`, ``done.json``) into
the dump dir, at Kimi-K2.5 shapes by default (hidden 7168, 3 aux layers + the final state,
bf16, prompts of 2k-16k tokens in prefill chunks of 8k), then runs the client's own
``Extraction.write_record`` (read + cross-check the chunks, assemble the record, write it with
fsync + rename, free the dump) on ``--concurrency`` threads, as ``hsdump extract`` does once a
request is done; by default after an untimed warm-up pass over the same records, so the timed
pass is a long run's steady state. In the same run it measures the raw limits on the same bytes:

* dump-dir read: the chunk files read by ``--concurrency`` threads;
* output-disk write: files of the records' sizes written by ``--concurrency`` threads, each
  fsynced.

It prints one table per format: records/s, GB/s into the output dir, and the ratio to
min(read, write) (goal >= 80%), and writes it as JSON. Sampled records are read back and
compared with the synthetic data.

With ``--chat MESSAGES`` the samples are chat rows instead (scripts/bench_render.py's agent
traces of that many messages, prompts of the same lengths, in a JSONL file) and the timed pass
includes rendering them, as ``hsdump extract`` does: the dataset's rows are read and rendered
(``iter_samples`` with ``--multi-turn``'s renderer and the tiny Kimi-K2.5 tokenizer) on the main
thread while the pool writes the records of those already rendered. ``--tree PATH`` runs the
same workload with another checkout's ``hsdump_patch`` (scripts/bench_ab.py).

    python scripts/bench_client.py --dump-dir /dev/shm/hsdump-bench --out-dir /data/bench
    python scripts/bench_client.py --small          # CPU-sized shapes, runs anywhere
    python scripts/bench_client.py --small --chat 16   # chat rows, rendering included
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import inspect
import json
import os
import platform
import queue
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import benchtree

benchtree.select()

import torch  # noqa: E402 - imports after choosing the tree (--tree)

from hsdump_patch import __version__, protocol  # noqa: E402
from hsdump_patch.client.extract import Extraction  # noqa: E402
from hsdump_patch.client.extract import ExtractSettings as Settings  # noqa: E402
from hsdump_patch.client.output import records  # noqa: E402
from hsdump_patch.client.rows.dataset import Sample, SampleError, index_dataset, iter_samples  # noqa: E402

try:
    from hsdump_patch.client.extract import request_id
except ImportError:  # a --tree from before issue 21: the rid was <prefix><id>
    def request_id(prefix: str, run_id: str, sample_id: str) -> str:
        return prefix + sample_id

GB = 1e9
GOAL = 0.80
RID_PREFIX = "hsdump-"
RUN_ID = "0123456789ab"  # the run id of the synthetic extraction (its rids: request_id)


def server_info(hidden: int, layers: tuple[int, ...]) -> protocol.ServerInfo:
    return protocol.ServerInfo(
        model="synthetic/Kimi-K2.5-shape", architecture="DeepseekV3ForCausalLM", layers=layers,
        layers_source="bench", has_final=True, hidden_size=hidden, num_hidden_layers=61,
        dtype="bfloat16", tp_size=8, rid_prefix=RID_PREFIX, sglang_version="0.5.23",
        hsdump_version=__version__, pid=os.getpid())


def pattern(sample_index: int, length: int, slots: int, hidden: int) -> torch.Tensor:
    """A sample's [L, S, H] bf16 states: cheap to make, distinct per sample and position."""
    row = torch.arange(slots * hidden, dtype=torch.float32).reshape(slots, hidden) / hidden
    pos = torch.arange(length, dtype=torch.float32)[:, None, None]
    return (row[None] + pos * 1e-3 + sample_index).to(torch.bfloat16)


def write_request(dump: Path, info: protocol.ServerInfo, rid: str, ids: list[int],
                  hidden: torch.Tensor, chunk: int) -> int:
    """Write one finished request in the protocol format; return its chunk bytes."""
    d = protocol.rid_dir(dump, rid)
    protocol.make_private_dir(d)
    total = 0
    for start in range(0, len(ids), chunk):
        part = hidden[start : start + chunk].contiguous()
        n = part.shape[0]
        tensors = [(protocol.HIDDEN_KEY, part),
                   (protocol.INPUT_IDS_KEY, torch.tensor(ids[start : start + n])),
                   (protocol.POSITIONS_KEY, torch.arange(start, start + n))]
        specs = [protocol.TensorSpec(name, protocol.SAFETENSORS_DTYPES[str(t.dtype)[6:]],
                                     tuple(t.shape)) for name, t in tensors]
        meta = protocol.ChunkMeta(rid=rid, prefix_len=start, layers=info.layers,
                                  has_final=info.has_final, model=info.model, tp_size=info.tp_size,
                                  sglang_version=info.sglang_version,
                                  hsdump_version=info.hsdump_version)
        path = d / protocol.chunk_filename(start)
        with open(path, "wb") as f:
            f.write(protocol.safetensors_header(specs, meta.to_strings()))
            for _, t in tensors:
                f.write(t.view(torch.uint8).numpy())
            total += f.tell()
    protocol.write_json_atomic(d / protocol.DONE_MARKER, {"rid": rid, "prompt_len": len(ids)})
    return total


def make_dump(dump: Path, info: protocol.ServerInfo, samples: list[Sample], chunk: int) -> int:
    """(Re)write every sample's request into the dump dir; return the chunk bytes."""
    protocol.make_private_dir(dump)
    protocol.write_json_atomic(dump / protocol.SERVER_INFO, info.to_json())
    slots = len(info.layers) + 1
    return sum(write_request(dump, info, request_id(RID_PREFIX, RUN_ID, s.id), s.input_ids,
                             pattern(i, len(s.input_ids), slots, info.hidden_size), chunk)
               for i, s in enumerate(samples))


def timed_pool(jobs: list, fn, threads: int) -> float:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, jobs))
    return time.perf_counter() - t0


def raw_read(dump: Path, threads: int) -> tuple[int, float]:
    """Read every chunk file of the dump dir (``threads`` at once); return bytes, seconds."""
    files = list(dump.rglob(protocol.CHUNK_PREFIX + "*"))
    sizes = {p: p.stat().st_size for p in files}
    # One buffer per thread, allocated and touched before the clock starts: only reading counts.
    buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    for _ in range(threads):
        buffers.put(bytearray(max(sizes.values())))

    def read(path: Path) -> None:
        buf = buffers.get()
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buf)[: sizes[path]])
        buffers.put(buf)

    return sum(sizes.values()), timed_pool(files, read, threads)


def raw_write(out: Path, sizes: list[int], threads: int) -> float:
    """Write files of these sizes (``threads`` at once), fsync each; return seconds."""
    out.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20) * 16  # 16 MiB

    def write(job: tuple[int, int]) -> None:
        i, size = job
        with open(out / f"raw-{i}", "wb", buffering=0) as f:
            left = size
            while left:
                left -= f.write(memoryview(block)[: min(left, len(block))])
            os.fsync(f.fileno())

    seconds = timed_pool(list(enumerate(sizes)), write, threads)
    shutil.rmtree(out)
    return seconds


def extraction(settings: Settings, info: protocol.ServerInfo) -> Extraction:
    """The client's run object, without HTTP (a --tree from before issue 21 has no run id)."""
    params = inspect.signature(Extraction).parameters
    extra = [RUN_ID] if "run_id" in params else []
    if "render_key" in params:  # records only: no manifest is written here
        extra.append("")
    return Extraction(settings, info, None, *extra)  # type: ignore[arg-type]


def run_client(settings: Settings, info: protocol.ServerInfo, samples: list[Sample],
               threads: int, refill: Callable[[], object] | None,
               timed: Callable[[], Iterable[Sample]] | None = None) -> tuple[list, float]:
    """The client's record path for every sample on ``threads`` threads; (results, seconds).

    With ``refill``, every record is first written once untimed, then the dump refilled and
    the records deleted: the timed pass is a long run's steady state (buffers reused, warm).
    ``timed`` yields the timed pass's samples (default ``samples``): rendering chat rows there
    puts it in the timed pass, overlapped with the writing as in ``hsdump extract``.
    """
    run = extraction(settings, info)
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="hsdump") as pool:
        if refill is not None:
            list(pool.map(run.write_record, samples))
            shutil.rmtree(settings.out)
            settings.out.mkdir()
            refill()
        t0 = time.perf_counter()
        done = list(pool.map(run.write_record, samples if timed is None else timed()))
    return done, time.perf_counter() - t0


def chat_samples(rows: Path, messages: int, policy: str, tokenizer_dir: Path | None,
                 lengths: list[int]) -> tuple[Callable[[], Iterable[Sample]], dict[str, Any]]:
    """Write one chat row per prompt length to ``rows``; return what renders them into
    samples (``hsdump extract``'s dataset path) and a description of the rows."""
    from bench_render import chat_row, tokenizer

    from hsdump_patch.client.rows.conversation import chat_renderer

    tok = tokenizer(tokenizer_dir)
    with open(rows, "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"id": f"bench-{i}", **chat_row(messages, n, tok)}) + "\n")
    refs, bad = index_dataset(rows)
    renderer = chat_renderer(tok, policy)
    if bad:
        raise SystemExit(f"bench_client: {bad[0].where}: {bad[0].problem}")

    def render() -> Iterable[Sample]:
        for item in iter_samples(rows, refs, renderer, None):
            if isinstance(item, SampleError):
                raise SystemExit(f"bench_client: {item.where}: {item.problem}")
            yield item

    return render, {"rows": len(refs), "messages": messages, "multi_turn": policy}


def check_records(out: Path, fmt: str, samples: list[Sample], info: protocol.ServerInfo) -> None:
    """Read back a few records and compare them with the synthetic states."""
    slots = len(info.layers) + 1
    for i in sorted({0, len(samples) // 2, len(samples) - 1}):
        s = samples[i]
        want = pattern(i, len(s.input_ids), slots, info.hidden_size)
        rec = records.load_record(out / records.record_name(s.id, fmt))
        if fmt == "eagle3":
            got = torch.stack([*rec["hidden_states"], rec["final_hidden_state"]], 1)
        else:
            aux = rec["aux_hidden_state"][0].unflatten(-1, (slots - 1, info.hidden_size))
            got = torch.cat([aux, rec["hidden_state"][0][:, None]], 1)
        if not torch.equal(got, want) or rec["input_ids"].tolist() != s.input_ids:
            raise SystemExit(f"bench_client: {fmt} record of {s.id} differs from its dump")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dump-dir", type=Path, default=Path("/dev/shm/hsdump-bench-client"),
                   help="dump dir to fill (default /dev/shm/hsdump-bench-client; deleted after)")
    p.add_argument("--out-dir", type=Path, default=Path("bench-client-out"),
                   help="output dir on the disk to measure (default ./bench-client-out; "
                        "deleted after)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--layers", default="2,30,58", help="aux layers (default 2,30,58)")
    p.add_argument("--min-tokens", type=int, default=2048, help="shortest prompt (default 2048)")
    p.add_argument("--max-tokens", type=int, default=16384,
                   help="longest prompt (default 16384)")
    p.add_argument("--chunk", type=int, default=8192,
                   help="prefill chunk size (default 8192)")
    p.add_argument("--gb", type=float, default=16.0,
                   help="hidden-state GB per format (default 16)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="client threads, as hsdump extract --concurrency (default 16)")
    p.add_argument("--formats", default=",".join(records.FORMATS),
                   help=f"formats to run (default {','.join(records.FORMATS)})")
    p.add_argument("--small", action="store_true",
                   help="CPU-sized run: hidden 512, 256-2048 tokens, 0.3 GB (default off)")
    p.add_argument("--no-crc32", action="store_true",
                   help="records without zip CRC32s (torch.utils.serialization.config), to "
                        "measure what computing them costs (default: computed)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="write every record once untimed before the timed pass, as in a long "
                        "run (reused buffers warm) (default on)")
    p.add_argument("--chat", type=int, default=0, metavar="MESSAGES",
                   help="samples are chat rows of this many messages (agent traces), rendered "
                        "in the timed pass (default 0: token ids, no rendering)")
    p.add_argument("--multi-turn", choices=("auto", "per-turn", "last"), default="auto",
                   help="the chat rows' multi-turn policy (default auto)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="the chat rows' tokenizer directory (default: the tiny Kimi-K2.5 one, "
                        "built)")
    p.add_argument("--json", type=Path, default=None,
                   help="write the results here too (default: print only)")
    benchtree.add_argument(p)
    args = p.parse_args()
    if args.small:
        args.hidden, args.min_tokens, args.max_tokens = 512, 256, 2048
        args.chunk, args.gb = 512, 0.3
    if args.no_crc32:
        from torch.utils.serialization import config

        config.save.compute_crc32 = False
    layers = tuple(int(x) for x in args.layers.split(","))
    info = server_info(args.hidden, layers)
    rng = random.Random(0)
    lengths: list[int] = []
    while sum(lengths) * info.bytes_per_token < args.gb * GB:
        lengths.append(rng.randint(args.min_tokens, args.max_tokens))
    # One copy of the dump is kept beside it: refilling copies it (cheap) instead of
    # regenerating the states.
    source = args.dump_dir.with_name(args.dump_dir.name + "-source")
    if args.dump_dir.exists() or source.exists() or args.out_dir.exists():
        raise SystemExit(f"bench_client: {args.dump_dir} or {args.out_dir} exists; pick new dirs")
    timed, chat = None, None
    if args.chat:
        args.out_dir.mkdir(parents=True)
        try:
            timed, chat = chat_samples(args.out_dir / "rows.jsonl", args.chat,
                                       args.multi_turn, args.tokenizer, lengths)
            samples = list(timed())
        except BaseException:
            shutil.rmtree(args.out_dir)
            raise
    else:
        samples = []
        for n in lengths:
            ids = [rng.randrange(163_840) for _ in range(n)]
            samples.append(Sample(f"bench-{len(samples)}", "bench", ids, [0] * (n // 4) +
                                  [1] * (n - n // 4)))

    results = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
               "samples": len(samples), "tokens": sum(len(s.input_ids) for s in samples),
               "hidden": args.hidden, "slots": len(layers) + 1, "concurrency": args.concurrency,
               "crc32": not args.no_crc32, "warmup": args.warmup,
               "dump_dir": str(args.dump_dir), "out_dir": str(args.out_dir),
               "tree": benchtree.imported_from(), "chat": chat, "formats": {}}
    try:
        dump_bytes = make_dump(source, info, samples, args.chunk)

        def refill() -> None:
            shutil.rmtree(args.dump_dir, ignore_errors=True)
            shutil.copytree(source, args.dump_dir)

        refill()
        read_bytes, read_s = raw_read(args.dump_dir, args.concurrency)
        write_s = raw_write(args.out_dir / "raw", [len(s.input_ids) * info.bytes_per_token
                                                   for s in samples], args.concurrency)
        read_gbs, write_gbs = read_bytes / read_s / GB, dump_bytes / write_s / GB
        limit = min(read_gbs, write_gbs)
        results.update(dump_gb=dump_bytes / GB, read_gbs=read_gbs, write_gbs=write_gbs,
                       limit_gbs=limit)
        for fmt in args.formats.split(","):
            if fmt != args.formats.split(",")[0]:
                refill()
            out = args.out_dir / fmt
            out.mkdir(parents=True)
            settings = Settings(server="-", dump_dir=args.dump_dir, out=out, fmt=fmt)
            done, seconds = run_client(settings, info, samples, args.concurrency,
                                       refill if args.warmup else None, timed)
            if [(d.sample.id, d.sample.input_ids, d.sample.loss_mask) for d in done] != [
                    (s.id, s.input_ids, s.loss_mask) for s in samples]:
                raise SystemExit("bench_client: the timed pass rendered other samples")
            check_records(out, fmt, samples, info)
            written = sum(d.size for d in done)
            gbs = written / seconds / GB
            results["formats"][fmt] = {"records_per_s": len(done) / seconds, "gbs": gbs,
                                       "tokens_per_s": results["tokens"] / seconds,
                                       "gb": written / GB, "seconds": seconds,
                                       "ratio": gbs / limit}
            shutil.rmtree(out)
    finally:
        shutil.rmtree(args.dump_dir, ignore_errors=True)
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(args.out_dir, ignore_errors=True)

    print(f"# bench_client {results['date']} on {results['machine']}")
    print(f"# {results['samples']} samples, {results['tokens']:,} tokens, hidden {args.hidden}, "
          f"{len(layers)} layers + final, bf16, {args.concurrency} threads"
          f"{', no CRC32' if args.no_crc32 else ''}"
          f"{', after an untimed warm-up pass' if args.warmup else ''}; "
          f"dump {args.dump_dir} -> out {args.out_dir}")
    if chat:
        print(f"# {chat['rows']} chat rows of {chat['messages']} messages, rendered in the timed "
              f"pass (--multi-turn {chat['multi_turn']})")
    print("| what | GB/s | records/s | tokens/s | ratio to min(read, write) |")
    print("|---|---|---|---|---|")
    print(f"| raw dump-dir read | {read_gbs:.2f} | | | |")
    print(f"| raw output write + fsync | {write_gbs:.2f} | | | |")
    ok = True
    for fmt, r in results["formats"].items():
        ok &= r["ratio"] >= GOAL
        print(f"| client `--format {fmt}` | {r['gbs']:.2f} | {r['records_per_s']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {r['ratio']:.0%} |")
    print(f"goal: client >= {GOAL:.0%} of min(read, write) = {limit:.2f} GB/s: "
          f"{'PASS' if ok else 'FAIL'}")
    results["goal_met"] = ok
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
