#!/usr/bin/env python3
"""Benchmark the capture writer at Kimi-K2 scale against the hardware limits (issue 6).

Drives the project's own :class:`hsdump_patch.capture.writer.DumpWriter` exactly as the capture
hook calls it: one simulated forward fills the packed ``[T, S, H]`` buffer on the device (one
buffer, reused by every forward once ``wait_for_copies`` has ordered it after the previous
forward's copies), then each request of the chunk is submitted as row slices of it (plus
``input_ids`` and ``positions``). In the same run it measures:

* the raw limits: device-to-host copy into pinned memory, and the dump dir's write
  bandwidth with 1 and N threads (N = the writer's threads);
* the synchronous baseline of the original patch: ``.cpu()`` then ``torch.save``;
* the writer, with the in-flight cap at its default and at a small value: sustained bytes/s
  when the forward outpaces it (saturated), and the forward thread's time blocked in
  ``submit`` per chunk, both saturated and with a forward that offers half the limit (paced);
  peak in-flight bytes, staging memory and RSS growth;
* the CPU cost, for each copy-wait event kind (``--event-kinds``; ``spin`` is the default
  ``torch.cuda.Event()`` of the writer before issue 11, ``blocking`` the current one): CPU
  seconds of the writer threads per GB written (from ``/proc/self/task/<tid>/schedstat``),
  and the forward thread's CPU time inside ``submit`` per chunk.

It prints one table with absolute numbers and ratios, then the goal verdicts. Sampled files
are read back with safetensors and compared with the data that was submitted.

    python scripts/bench_writer.py                       # cuda: Kimi-K2 shapes, /dev/shm
    python scripts/bench_writer.py --device cpu          # small shapes, runs anywhere
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsdump_patch import protocol
from hsdump_patch.capture import config
from hsdump_patch.capture import writer as writer_module
from hsdump_patch.capture.writer import DumpWriter

VOCAB = 163_840  # Kimi-K2's vocabulary; only the ids' dtype matters here
IDS_BYTES = 16  # input_ids + positions, int64, per token
GB = 1e9
MB = 1e6

# Per-device defaults: Kimi-K2 shapes on a GPU, small ones on CPU (what the test runs).
DEFAULTS = {
    "cuda": {"hidden": 7168, "chunks": "2048,8192,16384", "cap": config.DEFAULT_MAX_INFLIGHT,
             "volume": 12 << 30, "raw_volume": 6 << 30, "paced_forwards": 12,
             "sync_forwards": 3},
    "cpu": {"hidden": 256, "chunks": "64,256", "cap": 8 << 20, "volume": 24 << 20,
            "raw_volume": 16 << 20, "paced_forwards": 4, "sync_forwards": 2},
}


# ------------------------------------------------------------------------------ workload


class Workload:
    """Simulated prefill forwards of ``tokens`` tokens split into ``requests`` requests, into
    one reused ``[T, S, H]`` buffer as the capture session keeps it."""

    def __init__(self, tokens: int, requests: int, slots: int, hidden: int,
                 device: torch.device) -> None:
        self.tokens, self.slots, self.hidden, self.device = tokens, slots, hidden, device
        weights = [1 + i % 3 for i in range(requests)]  # unequal requests: 1, 2, 3, 1, ...
        cuts = [0] + [round(tokens * sum(weights[: i + 1]) / sum(weights))
                      for i in range(requests)]
        self.bounds = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
        self.positions = torch.cat([torch.arange(b - a) for a, b in self.bounds]).to(device)
        self.token_bytes = slots * hidden * 2 + IDS_BYTES
        self.nbytes = tokens * self.token_bytes
        self._cycles_per_s = _gpu_cycles_per_s() if device.type == "cuda" else 0.0
        self.buf = torch.empty(tokens, slots, hidden, dtype=torch.bfloat16, device=device)

    def forward(self, seconds: float = 0.0, writer: DumpWriter | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch one forward taking ``seconds``; return its hidden states and input ids.

        With ``writer``, the buffer is reused as the capture session does: its next fill is
        ordered after the writer's copies of the previous one. Without, a fresh buffer.
        """
        if seconds > 0:
            if self.device.type == "cuda":
                torch.cuda._sleep(int(seconds * self._cycles_per_s))
            else:
                time.sleep(seconds)  # on CPU the host is the device
        if writer is None:
            buf = torch.empty_like(self.buf)
        else:
            writer.wait_for_copies()
            buf = self.buf
        buf.normal_()
        ids = torch.randint(0, VOCAB, (self.tokens,), device=self.device)
        return buf, ids

    def tensors(self, buf: torch.Tensor, ids: torch.Tensor, a: int, b: int
                ) -> list[tuple[str, torch.Tensor]]:
        """What the capture hook hands to ``submit`` for the request at rows [a, b)."""
        return [(protocol.HIDDEN_KEY, buf[a:b]), (protocol.INPUT_IDS_KEY, ids[a:b]),
                (protocol.POSITIONS_KEY, self.positions[a:b])]

    def sync(self) -> None:
        """Wait for the forward, as the scheduler does for its sampled tokens."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()


def _gpu_cycles_per_s() -> float:
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1e3)


def _meta(rid: str) -> protocol.ChunkMeta:
    return protocol.ChunkMeta(rid=rid, prefix_len=0, layers=(2, 30, 58), has_final=True,
                              model="bench", tp_size=1, sglang_version="0.5.23",
                              hsdump_version="bench")


# ------------------------------------------------------------------------------ memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """Samples RSS and a writer's in-flight bytes in a thread while active."""

    def __init__(self, inflight: Callable[[], int] = lambda: 0) -> None:
        self._inflight = inflight
        self.base = self.rss_peak = _rss()
        self.inflight_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.rss_peak = max(self.rss_peak, _rss())
            self.inflight_peak = max(self.inflight_peak, self._inflight())

    def stop(self) -> PeakSampler:
        self._stop.set()
        self._thread.join()
        return self


def _release_host_cache() -> None:
    gc.collect()
    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch.cuda.synchronize()
        torch._C._host_emptyCache()  # pinned blocks cached by torch count in RSS


def thread_cpu_s(tids: list[int]) -> float:
    """CPU seconds used so far by these threads of this process (schedstat: ns, on-CPU)."""
    total = 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


# ------------------------------------------------------------------------------ raw limits


def measure_d2h(wl: Workload, volume: int) -> float:
    """Bytes/s of copying a chunk's hidden states into pinned host memory (host copy on CPU)."""
    buf, _ = wl.forward()
    reps = max(3, math.ceil(volume / buf.nbytes))
    if wl.device.type != "cuda":
        src, dst = buf.view(torch.uint8).numpy().reshape(-1), np.empty(buf.nbytes, np.uint8)
        dst[:] = src
        t0 = time.perf_counter()
        for _ in range(reps):
            dst[:] = src
        return reps * buf.nbytes / (time.perf_counter() - t0)
    dst = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dst.copy_(buf, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(buf, non_blocking=True)
        end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del dst
    _release_host_cache()
    return reps * buf.nbytes / seconds


def measure_write(root: Path, sizes: list[int], threads: int, volume: int) -> float:
    """Bytes/s of writing fresh files of ``sizes`` (cycled) into ``root`` with ``threads``
    threads, each its own files and an equal share of ``volume``.

    The bytes come from a source far larger than the CPU caches, read once per pass, as the
    writer's freshly copied data is: a cache-hot source would overstate the limit.
    """
    src = np.full(max(2 * max(sizes), min(volume, 2 << 30)), 0x5A, dtype=np.uint8)
    per_thread = max(volume // threads, max(sizes))
    plans = []
    for t in range(threads):
        plan, total, i = [], 0, t
        while total < per_thread:
            plan.append(sizes[i % len(sizes)])
            total += plan[-1]
            i += 1
        plans.append(plan)
    barrier = threading.Barrier(threads + 1)
    written = [0] * threads

    def work(t: int) -> None:
        cursor = t * len(src) // threads
        barrier.wait()
        for k, n in enumerate(plans[t]):
            if cursor + n > len(src):
                cursor = 0
            fd = os.open(root / f"raw-{t}-{k}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view, off = memoryview(src)[cursor : cursor + n], 0
                cursor += n
                while off < n:
                    off += os.pwrite(fd, view[off:], off)
            finally:
                os.close(fd)
            written[t] += n
        barrier.wait()

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    barrier.wait()
    seconds = time.perf_counter() - t0
    for th in pool:
        th.join()
    _clear(root)
    return sum(written) / seconds


def _clear(root: Path) -> None:
    for p in root.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


# ------------------------------------------------------------------------------ baseline


def measure_sync(wl: Workload, root: Path, forwards: int) -> list[float]:
    """Per-chunk stall of the original patch: ``.cpu()`` then ``torch.save`` per request."""
    stalls = []
    for f in range(forwards + 1):  # the first one warms up
        buf, ids = wl.forward()
        wl.sync()
        t0 = time.perf_counter()
        for r, (a, b) in enumerate(wl.bounds):
            torch.save({k: t.cpu() for k, t in wl.tensors(buf, ids, a, b)},
                       root / f"sync-{f}-{r}.pt")
        if f:
            stalls.append(time.perf_counter() - t0)
        del buf, ids
        _clear(root)
    return stalls


# ------------------------------------------------------------------------------ writer


@dataclass
class WriterRun:
    """One timed writer phase."""

    stalls: list[float]
    bytes_written: int
    seconds: float
    forward_wait_s: float
    writer_cpu_s: float  # CPU of the writer threads during the phase
    forward_cpu_s: float  # CPU of the forward thread inside submit, over the phase
    device_peak: int  # peak device memory of the phase above what was allocated before
    peak_inflight: int
    staging_peak: int
    rss_growth: int
    page_bytes: int
    verified: int = 0
    errors: list[str] = field(default_factory=list)


def _drive(w: DumpWriter, wl: Workload, forwards: int, tag: str, forward_s: float = 0.0,
           keep: int | None = None
           ) -> tuple[list[float], float, tuple[torch.Tensor, ...] | None]:
    """Run ``forwards`` forwards, submitting every request; return per-forward stalls, the
    forward thread's CPU seconds inside ``submit``, and a copy of forward ``keep``'s data
    (for the read-back check)."""
    stalls, cpu, kept = [], 0.0, None
    for f in range(forwards):
        buf, ids = wl.forward(forward_s, w)
        if f == keep:
            kept = (buf.clone(), ids.clone())
        t0, c0 = time.perf_counter(), time.thread_time()
        for r, (a, b) in enumerate(wl.bounds):
            w.submit(_meta(f"{tag}-{f}-{r}"), wl.tensors(buf, ids, a, b), prompt_len=b - a)
        stalls.append(time.perf_counter() - t0)
        cpu += time.thread_time() - c0
        del buf, ids  # the next forward overwrites the buffer: the writer must not need it
        wl.sync()
    return stalls, cpu, kept


def _verify(root: Path, wl: Workload, tag: str, forwards: int, keep: int,
            kept: tuple[torch.Tensor, ...] | None) -> tuple[int, list[str]]:
    """Check markers for every request, and forward ``keep``'s files byte for byte."""
    errors = []
    names = set(os.listdir(root))
    for f in range(forwards):
        for r in range(len(wl.bounds)):
            rid = f"{tag}-{f}-{r}"
            if protocol.rid_dirname(rid) not in names:
                errors.append(f"{rid}: no directory")
                continue
            status = protocol.request_status(root, rid)
            if status.done is None:
                errors.append(f"{rid}: no done marker ({status.error})")
    if any(n.startswith(".") for n in names):
        errors.append("temp files left in the dump dir")
    if kept is None:
        return 0, errors
    buf, ids = kept
    checked = 0
    for r, (a, b) in enumerate(wl.bounds):
        rid = f"{tag}-{keep}-{r}"
        path = protocol.rid_dir(root, rid) / protocol.chunk_filename(0)
        got = load_file(path)
        with safe_open(path, "pt") as fh:
            meta = protocol.ChunkMeta.from_strings(fh.metadata())
        ref = {k: t.cpu() for k, t in wl.tensors(buf, ids, a, b)}
        if meta.rid != rid or set(got) != set(ref) or not all(
                torch.equal(got[k], ref[k]) for k in ref):
            errors.append(f"{rid}: file content differs from the submitted tensors")
        checked += 1
    return checked, errors


def measure_writer(wl: Workload, root: Path, *, cap: int, threads: int, min_free: int,
                   volume: int, paced_forwards: int, paced_s: float, blocking_events: bool = True
                   ) -> tuple[WriterRun, WriterRun]:
    """Saturated and paced phases with one writer (warmed up first, as in a long-lived server)."""
    _release_host_cache()
    sampler = PeakSampler()
    w = DumpWriter(root, max_inflight_bytes=cap, min_free_bytes=min_free, threads=threads,
                   device=wl.device, blocking_events=blocking_events)
    sampler._inflight = lambda: w.inflight_bytes
    _drive(w, wl, math.ceil((cap + 2 * wl.nbytes) / wl.nbytes), "warm")
    w.flush()
    _clear(root)

    runs = []
    for tag, forwards, forward_s in (("sat", math.ceil(volume / wl.nbytes), 0.0),
                                     ("paced", paced_forwards, paced_s)):
        w.stats.peak_inflight_bytes = 0
        staging_peak = w.stats.staging_bytes
        bytes0, wait0 = w.stats.bytes_written, w.stats.forward_wait_s
        keep = min(1, forwards - 1)
        gc.collect()
        sampler.rss_peak = _rss()
        dev0 = _device_mark(wl.device)
        t0, wcpu0 = time.perf_counter(), thread_cpu_s(w.thread_ids)
        stalls, fcpu, kept = _drive(w, wl, forwards, tag, forward_s, keep=keep)
        w.flush()
        seconds = time.perf_counter() - t0
        writer_cpu = thread_cpu_s(w.thread_ids) - wcpu0
        # Less the read-back check's own device copy of one forward.
        device_peak = _device_peak(wl.device, dev0, sum(t.nbytes for t in kept or ()))
        rss_peak = sampler.rss_peak  # before the read-back check loads files
        checked, errors = _verify(root, wl, tag, forwards, keep, kept)
        runs.append(WriterRun(
            stalls=stalls, bytes_written=w.stats.bytes_written - bytes0, seconds=seconds,
            forward_wait_s=w.stats.forward_wait_s - wait0,
            writer_cpu_s=writer_cpu, forward_cpu_s=fcpu, device_peak=device_peak,
            peak_inflight=w.stats.peak_inflight_bytes,
            # The pool grows only when it has no free page, so its peak is one of these.
            staging_peak=max(staging_peak, w.stats.peak_inflight_bytes),
            rss_growth=rss_peak - sampler.base, page_bytes=w.page_bytes,
            verified=checked, errors=errors))
        del kept
        _clear(root)
    w.close()
    sampler.stop()
    if w.stats.internal_errors or w.stats.requests_failed:
        runs[0].errors.append(f"writer errors: {w.stats.as_dict()}")
    return runs[0], runs[1]


def _device_mark(device: torch.device) -> int:
    """Start a device-memory peak window; return the bytes allocated at its start."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _device_peak(device: torch.device, start: int, excluded: int) -> int:
    """Peak device bytes allocated in the window above its start, less ``excluded`` bytes
    that the benchmark itself held (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.max_memory_allocated() - start - excluded


# ------------------------------------------------------------------------------ report


@dataclass
class Row:
    tokens: int
    chunk_mb: float
    path: str
    gbps: float | None = None
    vs_limit: float | None = None
    stall_mean_ms: float | None = None
    stall_max_ms: float | None = None
    vs_sync: float | None = None
    peak_inflight_mb: float | None = None
    staging_mb: float | None = None
    rss_growth_mb: float | None = None
    writer_cpu_s_per_gb: float | None = None
    fwd_cpu_ms: float | None = None  # forward thread's CPU inside submit, per chunk
    device_peak_mb: float | None = None  # device memory above the reused buffer (JSON only)
    cap_wait_ms: float | None = None  # part of the stall spent waiting for the cap (JSON only)


COLUMNS = [  # (Row field, heading, format)
    ("tokens", "tokens", "{:d}"), ("chunk_mb", "MB/chunk", "{:.0f}"), ("path", "path", "{}"),
    ("gbps", "GB/s", "{:.2f}"), ("vs_limit", "vs limit", "{:.2f}"),
    ("stall_mean_ms", "stall ms/chunk", "{:.2f}"), ("stall_max_ms", "stall max ms", "{:.2f}"),
    ("vs_sync", "stall vs sync", "{:.4f}"), ("peak_inflight_mb", "peak in-flight MB", "{:.0f}"),
    ("staging_mb", "staging MB", "{:.0f}"), ("rss_growth_mb", "RSS growth MB", "{:.0f}"),
    ("writer_cpu_s_per_gb", "writer CPU s/GB", "{:.3f}"),
    ("fwd_cpu_ms", "fwd CPU ms/chunk", "{:.2f}"),
]


def format_table(rows: list[Row]) -> str:
    """Render rows as a Markdown table."""
    cells = [[("" if getattr(r, k) is None else fmt.format(getattr(r, k))) for k, _, fmt in COLUMNS]
             for r in rows]
    heads = [h for _, h, _ in COLUMNS]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    return "\n".join([line(heads), line(["-" * w for w in widths]), *map(line, cells)])


def _size(text: str) -> int:
    return config.parse_size(text, "size argument")


def _mib(n: int) -> str:
    return f"{n / (1 << 30):g}GiB" if n >= 1 << 30 else f"{n / (1 << 20):g}MiB"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the forward's tensors live (default: cuda if available, else cpu)")
    p.add_argument("--hidden", type=int, help="hidden size (default: 7168 on cuda, 256 on cpu)")
    p.add_argument("--slots", type=int, default=4,
                   help="captured states per token: 3 aux layers + final (default: 4)")
    p.add_argument("--chunks", help="tokens per forward, comma separated "
                   "(default: 2048,8192,16384 on cuda, 64,256 on cpu)")
    p.add_argument("--requests", type=int, default=4,
                   help="requests per forward, of unequal lengths (default: 4)")
    p.add_argument("--event-kinds", default="spin,blocking",
                   help="copy-wait events to measure the writer with, comma separated: spin "
                        "(torch.cuda.Event(), the writer before issue 11) and/or blocking "
                        "(blocking=True, the writer now); only the default cap runs both "
                        "(default: spin,blocking)")
    p.add_argument("--threads", type=int, default=config.DEFAULT_WRITER_THREADS,
                   help=f"writer threads, and N of the N-thread write limit "
                        f"(default: {config.DEFAULT_WRITER_THREADS}, the server's default)")
    p.add_argument("--cap", type=_size, help="default in-flight cap "
                   f"(default: {_mib(config.DEFAULT_MAX_INFLIGHT)} on cuda, 8MiB on cpu)")
    p.add_argument("--small-cap", type=_size, help="the small in-flight cap (default: cap/16)")
    p.add_argument("--min-free", type=_size, default=config.DEFAULT_MIN_FREE,
                   help=f"free-space reserve (default: {_mib(config.DEFAULT_MIN_FREE)})")
    p.add_argument("--volume", type=_size, help="bytes per saturated writer phase "
                   "(default: 12GiB on cuda, 24MiB on cpu)")
    p.add_argument("--raw-volume", type=_size, help="bytes per raw-limit measurement "
                   "(default: 6GiB on cuda, 16MiB on cpu)")
    p.add_argument("--paced-forwards", type=int, help="forwards in the paced phase "
                   "(default: 12 on cuda, 4 on cpu)")
    p.add_argument("--paced-load", type=float, default=0.5,
                   help="bytes/s the paced forward offers, as a fraction of the limit "
                        "(default: 0.5)")
    p.add_argument("--sync-forwards", type=int, help="forwards timed for the synchronous "
                   "baseline (default: 3 on cuda, 2 on cpu)")
    p.add_argument("--prefault", type=_size, help="bytes written and deleted first, so a VM "
                   "whose memory grows on first touch is grown before timing "
                   "(default: volume + 2 x cap on cuda, 0 on cpu)")
    p.add_argument("--dump-dir", type=Path,
                   default=Path("/dev/shm") if Path("/dev/shm").is_dir()
                   else Path(tempfile.gettempdir()),
                   help="filesystem to write to; a private subdirectory is used and removed "
                        "(default: /dev/shm, else the temp dir)")
    p.add_argument("--page-mib", type=int, default=writer_module.PAGE_BYTES >> 20,
                   help="writer staging page size in MiB, for profiling "
                        f"(default: {writer_module.PAGE_BYTES >> 20}, the writer's own)")
    p.add_argument("--json", type=Path, help="also write every number here (default: none)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.chunks = [int(c) for c in str(args.chunks).split(",")]
    args.event_kinds = [k.strip() for k in str(args.event_kinds).split(",") if k.strip()]
    if not args.event_kinds or set(args.event_kinds) - {"spin", "blocking"}:
        p.error(f"--event-kinds takes spin and/or blocking, got {args.event_kinds}")
    args.small_cap = args.small_cap or args.cap // 16
    if args.prefault is None:
        args.prefault = args.volume + 2 * args.cap if args.device == "cuda" else 0
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and verdicts. Exit 1 if a read-back check fails."""
    args = parse_args(argv)
    writer_module.PAGE_BYTES = args.page_mib << 20
    device = torch.device(args.device)
    root = Path(tempfile.mkdtemp(prefix="hsdump-bench-", dir=args.dump_dir))
    os.chmod(root, protocol.DIR_MODE)
    rows: list[Row] = []
    verdicts: list[tuple[str, bool, str]] = []
    errors: list[str] = []
    verified = 0
    machine = (torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
               or platform.machine())
    print(f"# bench_writer {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{machine}, {os.cpu_count()} CPUs, torch {torch.__version__}, dump dir "
          f"{args.dump_dir}, threads {args.threads}, caps {_mib(args.cap)} / "
          f"{_mib(args.small_cap)}, pages {args.page_mib} MiB", flush=True)
    try:
        if args.prefault:
            _log(f"prefault {_mib(args.prefault)}")
            measure_write(root, [64 << 20], min(16, os.cpu_count() or 1), args.prefault)
        for tokens in args.chunks:
            wl = Workload(tokens, args.requests, args.slots, args.hidden, device)
            mb = wl.nbytes / MB
            sizes = [(b - a) * wl.token_bytes for a, b in wl.bounds]
            _log(f"{tokens} tokens: raw limits")
            d2h = measure_d2h(wl, args.raw_volume)
            w1 = measure_write(root, sizes, 1, args.raw_volume // 2)
            wn = measure_write(root, sizes, args.threads, args.raw_volume)
            limit = min(d2h, wn)
            d2h_name = "pinned D2H" if device.type == "cuda" else "host copy (cpu)"
            rows += [Row(tokens, mb, d2h_name, d2h / GB, d2h / limit),
                     Row(tokens, mb, "dump-dir write, 1 thread", w1 / GB, w1 / limit),
                     Row(tokens, mb, f"dump-dir write, {args.threads} threads", wn / GB,
                         wn / limit)]
            _log(f"{tokens} tokens: synchronous baseline")
            sync = measure_sync(wl, root, args.sync_forwards)
            sync_mean = statistics.mean(sync)
            rows.append(Row(tokens, mb, "sync .cpu()+torch.save", wl.nbytes / sync_mean / GB,
                            wl.nbytes / sync_mean / limit, sync_mean * 1e3, max(sync) * 1e3, 1.0))
            paced_s = wl.nbytes / (args.paced_load * limit)
            cpu_per_gb: dict[str, float] = {}
            shipped = args.event_kinds[-1]
            phases = [(args.cap, kind) for kind in args.event_kinds] + [(args.small_cap, shipped)]
            for cap, kind in phases:
                _log(f"{tokens} tokens: writer, cap {_mib(cap)}, {kind} events")
                sat, paced = measure_writer(
                    wl, root, cap=cap, threads=args.threads, min_free=args.min_free,
                    volume=args.volume, paced_forwards=args.paced_forwards, paced_s=paced_s,
                    blocking_events=kind == "blocking")
                for name, run in (("saturated", sat), (f"paced {args.paced_load:.0%}", paced)):
                    gbps = run.bytes_written / run.seconds
                    mean = statistics.mean(run.stalls)
                    cpu_gb = run.writer_cpu_s / (run.bytes_written / GB)
                    rows.append(Row(tokens, mb, f"writer cap {_mib(cap)} {kind}, {name}",
                                    gbps / GB, gbps / limit, mean * 1e3, max(run.stalls) * 1e3,
                                    mean / sync_mean, run.peak_inflight / MB,
                                    run.staging_peak / MB, run.rss_growth / MB, cpu_gb,
                                    run.forward_cpu_s / len(run.stalls) * 1e3,
                                    run.device_peak / MB,
                                    run.forward_wait_s / len(run.stalls) * 1e3))
                    errors += run.errors
                    verified += run.verified
                    bound = max(cap, _oversize_bound(wl, run.page_bytes))
                    verdicts.append((f"memory {tokens} tok cap {_mib(cap)} {kind} {name}",
                                     run.peak_inflight <= bound and run.staging_peak <= bound,
                                     f"peak in-flight {run.peak_inflight / MB:.0f} MB, staging "
                                     f"{run.staging_peak / MB:.0f} MB <= {bound / MB:.0f} MB"))
                    if cap != args.cap:
                        continue
                    if name != "saturated":
                        cpu_per_gb[kind] = cpu_gb
                    if kind != shipped:
                        continue
                    if name == "saturated":
                        verdicts.append((f"throughput {tokens} tok", gbps >= 0.9 * limit,
                                         f"{gbps / GB:.2f} GB/s = {gbps / limit:.0%} of "
                                         f"{limit / GB:.2f} GB/s (goal >= 90%)"))
                    verdicts.append((f"stall {tokens} tok {name}", mean <= 0.05 * sync_mean,
                                     f"{mean * 1e3:.2f} ms = {mean / sync_mean:.2%} of "
                                     f"{sync_mean * 1e3:.0f} ms (goal <= 5%)"))
            if {"spin", "blocking"} <= cpu_per_gb.keys():
                spin, blocking = cpu_per_gb["spin"], cpu_per_gb["blocking"]
                verdicts.append((f"writer CPU {tokens} tok paced", blocking <= spin,
                                 f"blocking {blocking:.3f} s/GB vs spin {spin:.3f} s/GB "
                                 f"({blocking / spin:.0%})"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(format_table(rows))
    print()
    for name, ok, detail in verdicts:
        print(f"{'PASS' if ok else 'MISS'}  {name}: {detail}")
    for e in errors:
        print(f"READ-BACK ERROR  {e}")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.UTC).isoformat(), "machine": machine,
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": [r.__dict__ for r in rows],
            "verdicts": [{"goal": n, "ok": ok, "detail": d} for n, ok, d in verdicts],
            "verified_files": verified, "errors": errors}, indent=1))
    return 1 if errors else 0


def _oversize_bound(wl: Workload, page_bytes: int) -> int:
    """Staging bytes of the largest request file, in pages (what one oversize chunk holds)."""
    largest = max(b - a for a, b in wl.bounds) * wl.token_bytes + 4096
    return -(-largest // page_bytes) * page_bytes


def _log(msg: str) -> None:
    print(f"[bench_writer] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
