#!/usr/bin/env python3
"""Forward time with the dump on vs off, through the real capture ordering (issue 17).

A synthetic prefill forward (a loop of ``--layers`` decoder layers, each two matmuls sized so
that the forward takes about ``--us-per-token`` microseconds per token) is run with the dump
off, and on through the project's own capture code, driven in the order
``hsdump_patch/capture/session.py`` uses:

* before the first layer (the pre-hook) the forward's ``_ForwardState`` takes a
  :class:`~hsdump_patch.capture.session.CaptureBuffers` buffer (which orders the stream after
  the copies of the forward that used that buffer last), and every captured layer and the
  final state copy their rows into it (``_ForwardState.store``);
* after the last layer every request's rows (plus ``input_ids`` and ``positions``) are
  submitted in one ``submit_forward`` call to the project's
  :class:`~hsdump_patch.capture.writer.DumpWriter`, then
  ``CaptureBuffers.handed_off`` records the copies;
* then the host waits for the forward, as the scheduler does for its sampled tokens.

Four conditions in one run, in ABBA order (``off, on, thread, old, old, thread, on, off`` per
round): ``off`` (no capture), ``on`` (what ships: two buffers used in turn, and the default
writer mode, the writer process), the other writer mode (``thread``: the writer's threads in
this process) and ``old`` (one buffer and threads, the ordering before issue 17: each forward
waits for all of the previous forward's copies). Each block is ``--warmup`` untimed
forwards then ``--forwards`` timed ones (default 1 + 1: the conditions alternate forward by
forward, and each timed forward follows one of its own condition), after the previous block's
checks and ``--gap`` seconds of idle device. Each timed forward's wall time is one sample; the
table gives medians, the ratios to ``off`` (also paired forward by forward), the stream stall
for earlier copies, the host time blocked on the in-flight cap and the host time of the
hand-off per forward. Every dumped value (hidden states, ids, positions) is read back from
the files and checked against what the forward produced; a failed check exits 1.
``--diagnose`` and ``--profile`` add a breakdown (see their help). ``--order overlap`` enqueues
each timed forward while the forward before it runs, as SGLang's default overlap scheduler
does for consecutive prefill batches, and times its span on the device instead.
``--host-us-per-layer`` makes the forward host-bound as SGLang's eager forward is: before each
layer's matmuls the host spends that long in Python launching tiny kernels (one more grid
dimension), which is where the writer's hand-overs of the GIL can cost.

    python scripts/bench_forward.py                  # cuda: Kimi-K2.5 shapes into /dev/shm
    python scripts/bench_forward.py --device cpu     # tiny shapes, a smoke test anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from hsdump_patch import protocol
from hsdump_patch.capture import config
from hsdump_patch.capture.session import (
    CAPTURE_BUFFERS,
    CaptureBuffers,
    _ForwardState,
    copy_rows,
)
from hsdump_patch.capture.writer import Chunk, DumpWriter

VOCAB = 163_840  # Kimi-K2.5's vocabulary
# "on": two buffers and the writer mode that ships (config.DEFAULT_WRITER_MODE); ALT: the same
# with the other writer mode; "old": one buffer (the ordering before issue 17), thread writer.
ALT = next(m for m in config.WRITER_MODES if m != config.DEFAULT_WRITER_MODE)
CONDITIONS = ("off", "on", ALT, "old")
# --diagnose adds conditions that each leave out or add a part of the thread writer's dump
# ("thread"; their files are not checked): pack: the packing copies (_ForwardState.store),
# no hand-off; nod2h: packing + every submit's host work, but no device-to-host copy and no
# file; nowrite: all of "thread" but the writer threads write no file; onsync / onflush:
# "thread", but after each forward (untimed) the copies / the copies and the writer threads
# finish, so nothing of the dump overlaps the next forward; gil / mem: no dump, but at each
# forward's start 8 threads make the Python calls of the writer threads (~15 syscalls each,
# GIL held between them) / copy a file's bytes in host memory (GIL released): which of the
# two slows the forward; d2h: no dump, but at each forward's start one forward's bytes are
# copied to pinned host memory on a side stream, as the previous forward's copies are; prev:
# "on" with the capture as before 2026-12-02 19:00 UTC (PrevBuffers: a stream wait and a
# slice in every pre-hook; the final state packed on the forward's stream).
DIAGNOSTIC = ("pack", "nod2h", "nowrite", "onsync", "onflush", "gil", "mem", "d2h", "prev")
GOAL = 1.01

# Per-device defaults: Kimi-K2.5 shapes on a GPU (61 layers, EAGLE-3 layers 2, 30, 58 plus the
# final state, hidden 7168, bf16), tiny ones on CPU (the unit test).
DEFAULTS = {
    "cuda": {"hidden": 7168, "layers": 61, "aux": "2,30,58", "chunks": "2048,8192,16384",
             "us": "5,10,20,40", "requests": 8, "forwards": 1, "rounds": 5, "gap": 0.1},
    "cpu": {"hidden": 64, "layers": 6, "aux": "1,3", "chunks": "32,64", "us": "100",
            "requests": 3, "forwards": 3, "rounds": 1, "gap": 0.0},
}
# --host-us-per-layer's grid on a GPU. An eager SGLang 0.5.23 DeepSeek-V3 / Kimi-K2.5 decoder
# layer (deepseek_v2.py: the layer communicator's fused add+RMSNorm, MLA's q_a / kv_a
# projections, their norms, q_b / kv_b, rotary, the attention kernel, o_proj, the TP
# all-reduce, the MoE router and top-k, the fused-MoE kernels, the shared experts, the
# combine) launches roughly 40-60 kernels from Python; at 5-15 us of host time each that is
# ~200-900 us per layer. The grid brackets it, with 0 (today's synthetic forward) as the floor.
HOST_US_CUDA = "0,100,300,1000"
# Layers at which --diagnose records the host's enqueue time and the device's start time.
TIMELINE = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)


class Model:
    """A synthetic forward of ``tokens`` tokens: per layer ``x = (x @ w1) @ w2``; at each
    captured layer the residual ``x`` is overwritten with a known pattern (so the dump can be
    checked exactly), as is the final state (a fresh tensor per forward, as SGLang's final
    norm returns)."""

    def __init__(self, tokens: int, hidden: int, layers: int, inner: int,
                 device: torch.device) -> None:
        self.tokens, self.hidden, self.layers, self.device = tokens, hidden, layers, device
        g = torch.Generator(device="cpu").manual_seed(0)
        scale = 1.0 / hidden**0.5
        self.w1 = (torch.randn(hidden, inner, generator=g) * scale).to(device, torch.bfloat16)
        self.w2 = (torch.randn(inner, hidden, generator=g) * scale).to(device, torch.bfloat16)
        self.x = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device=device)
        self.h = torch.empty(tokens, inner, dtype=torch.bfloat16, device=device)
        self._t = torch.arange(tokens, device=device)
        self._col = (torch.arange(hidden, device=device) % 101).to(torch.bfloat16)
        self.ids = torch.empty(tokens, dtype=torch.int32, device=device)
        self.positions = torch.empty(tokens, dtype=torch.int64, device=device)  # set by Bench
        self.host_us = 0.0  # host work before each layer (--host-us-per-layer)
        self._tiny = torch.ones(8, dtype=torch.float32, device=device)

    def fill(self, out: torch.Tensor, forward: int, slot: int) -> torch.Tensor:
        """Write ``pattern(forward, slot)`` (exact in bf16) into ``out``."""
        row = ((self._t * 7 + slot * 11 + forward * 13) % 97).to(torch.bfloat16)
        torch.add(row[:, None], self._col[None, :], out=out)
        return out

    def layer(self) -> None:
        self.host_work()
        torch.mm(self.x, self.w1, out=self.h)
        torch.mm(self.h, self.w2, out=self.x)

    def host_work(self) -> None:
        """``host_us`` microseconds of Python launching tiny kernels, as an eager layer's
        small ops keep the host (and the GIL) busy between its large kernels."""
        end = time.perf_counter() + self.host_us * 1e-6
        while time.perf_counter() < end:
            self._tiny.mul_(1.0)

    def embed(self, forward: int) -> None:
        torch.remainder(self._t * 31 + forward, VOCAB, out=self.ids)


def expected_hidden(rows: range, slots: int, hidden: int, forward: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """The pattern of ``Model.fill``, ``[len(rows), slots, hidden]`` float32 on ``device``."""
    t = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device)
    s = torch.arange(slots, device=device)
    row = (t[:, None] * 7 + s[None, :] * 11 + forward * 13) % 97
    col = (torch.arange(hidden, device=device) % 101).float()
    return row[:, :, None].float() + col[None, None, :]


class PrevBuffers(CaptureBuffers):
    """:class:`CaptureBuffers` as before 2026-12-02 19:00 UTC (the ``prev`` condition): every
    pre-hook makes the stream wait for the buffer's last copies, ended or not, and slices the
    buffer; the hand-off does not look at the next buffer's copies."""

    def acquire(self, rows: int) -> torch.Tensor:
        i = self._current = self._next
        self._next = (i + 1) % self.count
        buf = self._ensure(i, rows)
        self.views = self._views[i]
        copied = self._copied[i]
        if copied is not None:
            torch.cuda.current_stream().wait_event(copied)
        return buf[:rows]

    def handed_off(self) -> None:
        if self._current is not None:
            self._copied[self._current] = self.writer.copies_event()
            self._current = None


class Noise:
    """Threads that, at each forward's start (``trigger``), load the forward thread the way
    the writer threads do, without a dump: ``gil``: the Python calls of writing one file each
    (~15 syscalls, the GIL taken back after each); ``mem``: copy one file's bytes into fresh
    host memory each (numpy releases the GIL: only cores and memory bandwidth are shared).
    ``d2h`` (cuda only, no thread): copy ``d2h_bytes`` (one forward's dump) from the device
    into pinned host memory on a side stream, as the previous forward's copies do."""

    def __init__(self, threads: int, nbytes: int, where: Path, d2h_bytes: int = 0) -> None:
        self.kind, self.where, self.nbytes = "", where, nbytes
        self.src = np.ones(nbytes, np.uint8)
        self.go = [threading.Semaphore(0) for _ in range(threads)]
        self.done = threading.Semaphore(0)
        self.pending = 0
        for i in range(threads):
            threading.Thread(target=self._run, args=(i,), daemon=True).start()
        self.d2h: tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor] | None = None
        if d2h_bytes:
            self.d2h = (torch.cuda.Stream(), torch.empty(d2h_bytes, dtype=torch.uint8,
                                                         device="cuda"),
                        torch.empty(d2h_bytes, dtype=torch.uint8, pin_memory=True))

    def trigger(self, kind: str) -> None:
        if kind == "d2h":
            if self.d2h is not None:
                stream, src, dst = self.d2h
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            return
        self.kind = kind
        self.pending += len(self.go)
        for g in self.go:
            g.release()

    def settle(self) -> None:
        if self.d2h is not None:
            self.d2h[0].synchronize()
        while self.pending:
            self.done.acquire()
            self.pending -= 1

    def _run(self, i: int) -> None:
        while True:
            self.go[i].acquire()
            if self.kind == "gil":
                for k in range(15):
                    os.stat(self.where)
                    _ = [str(k) for _ in range(20)]  # the bookkeeping between the calls
            else:
                dst = np.empty(self.nbytes, np.uint8)  # fresh pages, as a tmpfs write
                np.copyto(dst, self.src)
            self.done.release()


@dataclass
class Sample:
    wall_ms: float
    gpu_ms: float
    stall_ms: float  # stream time of the buffer's wait for earlier copies (see forward)
    host_wait_ms: float  # the forward thread blocked in the hand-off (in-flight cap)
    handoff_ms: float  # host time of the hand-off
    enqueue_ms: float = 0.0  # host time to enqueue the layers (before the hand-off)
    host_at: list[float] = field(default_factory=list)  # --diagnose: host ms at TIMELINE layers
    dev_at: list[float] = field(default_factory=list)  # device ms at their start


@dataclass
class Point:
    tokens: int
    us_target: float
    inner: int
    host_us: float = 0.0
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def median(self, cond: str, attr: str = "wall_ms") -> float:
        return statistics.median(getattr(s, attr) for s in self.samples[cond])


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.aux = [int(x) for x in args.aux_layers.split(",")]
        self.slots = len(self.aux) + 1
        self.writers = {mode: DumpWriter(args.dump_dir, max_inflight_bytes=args.cap,
                                         min_free_bytes=args.min_free, threads=args.threads,
                                         device=device, mode=mode)
                        for mode in config.WRITER_MODES}
        self.writer = self.writers[config.DEFAULT_WRITER_MODE]  # what ships
        self.alt_writer = self.writers[ALT]
        self.forward_no = 0
        self.verified_values = 0
        self.verified_files = 0
        self.errors: list[str] = []
        self.noise: Noise | None = None  # --diagnose: made per point (its bytes per file)

    # ---------------------------------------------------------------- one forward

    def bounds(self, tokens: int) -> list[tuple[int, int]]:
        n = min(self.args.requests, tokens)
        cuts = [round(tokens * i / n) for i in range(n + 1)]
        return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def forward(self, model: Model, buffers: CaptureBuffers | None, tag: str,
                noise: str = "", wait: bool = True) -> tuple[Sample, int]:
        """One forward (dumped when ``buffers`` is given; ``tag`` "pack" stores without a
        hand-off; ``noise``: the :class:`Noise` kind to trigger at its start); return its
        sample and number. ``wait=False``: return once it is enqueued, without a sample (the
        next forward is enqueued while it runs: ``--order overlap``)."""
        f = self.forward_no = self.forward_no + 1
        ev = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None
        marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        timeline = bool(self.args.diagnose) and ev is not None
        at: list[tuple[float, torch.cuda.Event]] = []
        writer = buffers.writer if buffers is not None else self.writer
        wait0 = writer.stats.forward_wait_s
        t0 = time.perf_counter()
        start = ev() if ev else None
        if start is not None:
            start.record()
        if noise:
            self.noise.trigger(noise)
        # The pre-hook: the state takes its buffer before the first layer.
        pre = (ev(), ev()) if ev else None
        if pre is not None:
            pre[0].record()
        state = _ForwardState(buffers, None, model.tokens) if buffers is not None else None
        if pre is not None:
            pre[1].record()
        model.embed(f)
        slot_of = {layer: slot for slot, layer in enumerate(self.aux)}
        for i in range(model.layers):
            if timeline and i in TIMELINE:
                at.append((time.perf_counter(), ev()))
                at[-1][1].record()
            slot = slot_of.get(i)
            if slot is not None:
                model.fill(model.x, f, slot)
                # Events around the store in every condition (their host time is the same).
                a, b = (ev(), ev()) if ev else (None, None)
                if a is not None:
                    a.record()
                if state is not None:
                    state.store(slot, model.x)
                if a is not None and b is not None:
                    b.record()
                    marks.append((a, b))
            model.layer()
        final = model.fill(torch.empty_like(model.x), f, self.slots - 1)  # final norm output
        t1 = time.perf_counter()
        if state is not None and tag == "pack":
            state.store_final(self.slots - 1, final)
            state.buffers.handed_off()
        elif state is not None:
            self.hand_off(state, model, final, f, tag)
        handoff = (time.perf_counter() - t1) * 1e3
        end = ev() if ev else None
        if end is not None:
            end.record()
            if not wait:
                return Sample(0.0, 0.0, 0.0, 0.0, handoff), f
            end.synchronize()  # the scheduler waits for the sampled tokens, not for the copies
        wall = (time.perf_counter() - t0) * 1e3
        gpu = start.elapsed_time(end) if start is not None and end is not None else wall
        if self.args.order == "overlap" and start is not None:
            wall = gpu  # it was enqueued while the one before ran: its span on the device
        # The stall: the stream time of the pre-hook (where the buffer is taken and the stream
        # waits for the copies of the forward that used it last) plus how much longer the
        # first store took than a later one.
        stall = 0.0
        if pre is not None:
            stall = pre[0].elapsed_time(pre[1])
        if len(marks) > 1:
            times = [a.elapsed_time(b) for a, b in marks]
            stall += max(0.0, times[0] - statistics.median(times[1:]))
        host = (writer.stats.forward_wait_s - wait0) * 1e3
        sample = Sample(wall, gpu, stall, host, handoff, (t1 - t0) * 1e3)
        if at:
            assert start is not None
            sample.host_at = [(t - t0) * 1e3 for t, _ in at]
            sample.dev_at = [start.elapsed_time(e) for _, e in at]
        return sample, f

    def hand_off(self, state: _ForwardState, model: Model, final: torch.Tensor, f: int,
                 tag: str) -> None:
        """What ``CaptureSession._hand_off`` does, for one request per row range."""
        assert state.buffers is not None
        writer = state.buffers.writer
        try:
            if tag == "prev":  # as before 2026-12-02 19:00 UTC: on the forward's stream
                state.store(self.slots - 1, final)
            else:
                state.store_final(self.slots - 1, final)
            if state.error is not None or len(state.captured) != self.slots:
                raise RuntimeError(state.error or f"captured slots {sorted(state.captured)}")
            assert state.buf is not None
            ids = model.ids[: state.rows].to(torch.int64, copy=True)
            positions = model.positions[: state.rows].to(torch.int64, copy=True)
            chunks = []
            for r, (a, b) in enumerate(self.bounds(model.tokens)):
                rid = f"bench-{tag}-{f}-{r}"
                writer.begin_request(rid)
                meta = protocol.ChunkMeta(
                    rid=rid, prefix_len=0, layers=tuple(self.aux), has_final=True,
                    model="bench_forward", tp_size=1, sglang_version="0.5.23",
                    hsdump_version="bench")
                chunks.append(Chunk(meta, a, b, b - a))
            writer.submit_forward([(protocol.HIDDEN_KEY, state.buf[: state.rows]),
                                   (protocol.INPUT_IDS_KEY, ids),
                                   (protocol.POSITIONS_KEY, positions)], chunks)
        finally:
            state.buffers.handed_off()

    # ---------------------------------------------------------------- checks

    def verify(self, model: Model, dumped: list[tuple[str, int]]) -> None:
        """Read back every file of ``dumped`` forwards and compare every value; delete them."""
        if not self.drain():
            return
        for tag, f in dumped:
            for r, (a, b) in enumerate(self.bounds(model.tokens)):
                rid = f"bench-{tag}-{f}-{r}"
                d = protocol.rid_dir(self.args.dump_dir, rid)
                try:
                    if not (d / protocol.DONE_MARKER).is_file():
                        raise RuntimeError(f"no {protocol.DONE_MARKER}")
                    t = load_file(d / protocol.chunk_filename(0))
                    hidden = t[protocol.HIDDEN_KEY].to(self.device)  # compared on the device
                    want = expected_hidden(range(a, b), self.slots, model.hidden, f,
                                           self.device)
                    if hidden.shape != want.shape or not torch.equal(hidden.float(), want):
                        raise RuntimeError("hidden states differ from the forward's")
                    ids = (torch.arange(a, b) * 31 + f) % VOCAB
                    if not torch.equal(t[protocol.INPUT_IDS_KEY], ids):
                        raise RuntimeError("input_ids differ")
                    if not torch.equal(t[protocol.POSITIONS_KEY], torch.arange(b - a)):
                        raise RuntimeError("positions differ")
                    self.verified_values += hidden.numel() + 2 * (b - a)
                    self.verified_files += 1
                except Exception as e:
                    self.errors.append(f"{rid}: {type(e).__name__}: {e}")
                shutil.rmtree(d, ignore_errors=True)

    # ---------------------------------------------------------------- one point

    def model(self, tokens: int, inner: int) -> Model:
        """A :class:`Model` whose positions restart at 0 for each request (as in a batch)."""
        model = Model(tokens, self.args.hidden, self.args.layers, inner, self.device)
        model.positions.copy_(torch.cat([torch.arange(b - a) for a, b in self.bounds(tokens)]))
        return model

    def calibrate(self, tokens: int, us: float) -> tuple[Model, int]:
        """A model whose forward (dump off) takes about ``us`` microseconds per token: the
        matmuls' inner size is scaled by target / measured, up to three tries."""
        inner = self.args.hidden
        for attempt in range(3):
            inner = max(64, round(inner / 64) * 64)
            model = self.model(tokens, inner)
            self.forward(model, None, "cal")
            t = statistics.median(self.forward(model, None, "cal")[0].gpu_ms for _ in range(3))
            per_token = t * 1e3 / tokens
            if abs(per_token / us - 1) < 0.1 or attempt == 2:
                return model, inner
            del model
            inner = inner * us / per_token
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def leaving_out(self, cond: str):
        """For a diagnostic condition: the writer stages no copy (nod2h) and writes no file
        (nod2h, nowrite); it still waits for the copies and writes the markers."""
        w = self.writers["thread"]  # the diagnostic conditions take the thread writer apart
        if cond in ("nod2h", "nowrite"):
            w._files._write_file = (lambda job: job.ready.synchronize()
                                    if job.ready is not None else None)
        if cond == "nod2h":
            w._stage = lambda tensors, staged: [None] * len(staged)
        try:
            yield
        finally:
            w._files.__dict__.pop("_write_file", None)
            w.__dict__.pop("_stage", None)

    def drain(self) -> bool:
        """Wait until both writers have written everything (an error after 600 s)."""
        for w in self.writers.values():
            if not w.flush(timeout=600):
                self.errors.append(f"the {w.mode} writer did not drain in 600 s")
                return False
        return True

    def discard(self, model: Model, dumped: list[tuple[str, int]]) -> None:
        """Drain the writer and remove the marker folders of a diagnostic condition."""
        self.drain()
        for tag, f in dumped:
            for r in range(len(self.bounds(model.tokens))):
                shutil.rmtree(protocol.rid_dir(self.args.dump_dir, f"bench-{tag}-{f}-{r}"),
                              ignore_errors=True)

    def pack_micro(self, tokens: int) -> dict[str, float]:
        """Device us per packing copy of one ``[tokens, H]`` state into a ``[T, S, H]`` slot."""
        h = self.args.hidden
        src = torch.randn(tokens, h, device=self.device).to(torch.bfloat16)
        buf = torch.empty(tokens, self.slots, h, dtype=torch.bfloat16, device=self.device)
        flat = torch.empty(self.slots, tokens, h, dtype=torch.bfloat16, device=self.device)
        out = {}
        for name, fn in (("bf16 copy_", lambda: buf[:, 1].copy_(src)),
                         ("copy_rows", lambda: copy_rows(buf[:, 1], src)),
                         ("contiguous", lambda: flat[1].copy_(src))):
            fn()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                fn()
            b.record()
            b.synchronize()
            out[name] = round(a.elapsed_time(b) / 20 * 1e3, 1)
        assert torch.equal(buf[:, 1], src)
        return out

    def hook_micro(self, tokens: int) -> dict[str, float]:
        """Host us of the pre-hook's ``_ForwardState`` as shipped and as before (``prev``),
        the buffer's last copies ended (median of 200)."""
        out = {}
        for name, cls in (("on", CaptureBuffers), ("prev", PrevBuffers)):
            buffers = cls(self.writer, self.slots, self.args.hidden, torch.bfloat16,
                          self.device)
            buffers.reserve(tokens)
            times = []
            for _ in range(200):
                t = time.perf_counter()
                _ForwardState(buffers, None, tokens)
                times.append(time.perf_counter() - t)
                buffers.handed_off()
                torch.cuda.synchronize()
            out[name] = round(statistics.median(times) * 1e6, 1)
        return out

    def profile(self, model: Model, buffers: CaptureBuffers) -> None:
        """Print the device time per kernel of 3 forwards with the dump on, then off."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        for cond, buf in (("on", buffers), ("off", None)):
            self.forward(model, buf, "prof")
            with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
                for _ in range(3):
                    self.forward(model, buf, "prof")
            print(f"## profile {model.tokens} tokens, {cond}, 3 forwards", flush=True)
            print(pr.key_averages().table(sort_by="self_device_time_total", row_limit=14),
                  flush=True)
        self.discard(model, [("prof", f) for f in range(self.forward_no - 8, self.forward_no + 1)])

    def after(self, cond: str) -> None:
        """Untimed, after each forward of ``cond``: onsync lets the copies finish, onflush the
        copies and the writer threads."""
        w = self.writers["thread"]
        if cond == "onsync" and w._side_stream is not None:
            w._side_stream.synchronize()
        elif cond == "onflush" and not w.flush(timeout=600):
            self.errors.append("the writer did not drain in 600 s")

    def point(self, tokens: int, us: float, host_us: float = 0.0) -> Point:
        """Measure one point: per ABBA round, each condition runs one block of ``--warmup``
        untimed forwards then ``--forwards`` timed ones (so every timed forward follows one of
        its own condition, as in steady state), from an idle writer (drained and checked
        between blocks, untimed, then ``--gap`` seconds of idle device, so that no block starts
        right after another's forwards). With one timed forward per block the conditions
        alternate forward by forward, so the drift of the machine cancels to well under 1%."""
        model, inner = self.calibrate(tokens, us)  # the device's work, without host work
        model.host_us = host_us
        p = Point(tokens, us, inner, host_us)
        conds = CONDITIONS + tuple(self.args.diagnose)
        abba = conds + conds[::-1]
        p.samples = {c: [] for c in conds}
        if self.args.diagnose:
            if self.cuda:
                print(f"## packing copy us, {tokens} tokens: {self.pack_micro(tokens)}; "
                      f"pre-hook host us: {self.hook_micro(tokens)}", flush=True)
            per_file = tokens // len(self.bounds(tokens)) * self.slots * model.hidden * 2
            d2h = per_file * len(self.bounds(tokens)) if self.cuda and "d2h" in conds else 0
            self.noise = Noise(self.args.threads, per_file, self.args.dump_dir, d2h)
        buffers = {"on": CaptureBuffers(self.writer, self.slots, model.hidden, torch.bfloat16,
                                        self.device, CAPTURE_BUFFERS),
                   ALT: CaptureBuffers(self.alt_writer, self.slots, model.hidden,
                                       torch.bfloat16, self.device, CAPTURE_BUFFERS),
                   "old": CaptureBuffers(self.writers["thread"], self.slots, model.hidden,
                                         torch.bfloat16, self.device, 1)}
        buffers.setdefault("thread", buffers["on"])  # the diagnostic conditions' writer
        if "prev" in self.args.diagnose:
            buffers["prev"] = PrevBuffers(self.writer, self.slots, model.hidden,
                                          torch.bfloat16, self.device, CAPTURE_BUFFERS)
        for b in buffers.values():
            b.reserve(tokens)
        dumping = ("pack", "nod2h", "nowrite", "onsync", "onflush")  # "thread"'s buffers
        for _ in range(self.args.rounds):
            for cond in abba:
                buf = buffers.get(cond, buffers["thread"] if cond in dumping else None)
                noise = cond if cond in ("gil", "mem", "d2h") else ""
                dumped = []
                with self.leaving_out(cond):
                    for k in range(self.args.warmup + self.args.forwards):
                        wait = self.args.order == "sync" or k >= self.args.warmup
                        sample, f = self.forward(model, buf, cond, noise, wait)
                        if buf is not None:
                            dumped.append((cond, f))
                        if k >= self.args.warmup:
                            p.samples[cond].append(sample)
                        self.after(cond)
                if self.noise is not None:
                    self.noise.settle()
                if cond in DIAGNOSTIC and cond != "prev":
                    self.discard(model, dumped)
                else:
                    self.verify(model, dumped)  # also drains the writer before the next block
                if buf is not None and self.cuda:
                    buf.writer._side_stream.synchronize()
                time.sleep(self.args.gap)
        if self.args.profile and self.cuda:
            self.profile(model, buffers["on"])
        del model, buffers
        if self.cuda:
            torch.cuda.empty_cache()
        return p


def table(points: list[Point]) -> list[dict]:
    rows = []
    for p in points:
        off = p.median("off")
        rows.append({
            "tokens": p.tokens, "us_per_token_target": p.us_target,
            "host_us_per_layer": p.host_us,
            "us_per_token_off": round(off * 1e3 / p.tokens, 2), "inner": p.inner,
            "off_ms": round(off, 2), "on_ms": round(p.median("on"), 2),
            "old_ms": round(p.median("old"), 2),
            "on_mode": config.DEFAULT_WRITER_MODE,
            f"{ALT}_ms": round(p.median(ALT), 2),
            f"{ALT}_vs_off": round(p.median(ALT) / off, 4),
            f"gpu_{ALT}_ms": round(p.median(ALT, "gpu_ms"), 2),
            f"handoff_{ALT}_ms": round(p.median(ALT, "handoff_ms"), 3),
            f"host_wait_{ALT}_ms": round(max(s.host_wait_ms for s in p.samples[ALT]), 3),
            f"{ALT}_vs_off_paired": _paired(p, ALT),
            f"on_vs_{ALT}_paired": _paired(p, "on", ALT),
            "on_vs_off": round(p.median("on") / off, 4),
            "old_vs_off": round(p.median("old") / off, 4),
            "gpu_off_ms": round(p.median("off", "gpu_ms"), 2),
            "gpu_on_ms": round(p.median("on", "gpu_ms"), 2),
            "gpu_old_ms": round(p.median("old", "gpu_ms"), 2),
            "handoff_on_ms": round(p.median("on", "handoff_ms"), 3),
            "stall_on_ms": round(p.median("on", "stall_ms"), 3),
            "stall_off_ms": round(p.median("off", "stall_ms"), 3),
            "stall_old_ms": round(p.median("old", "stall_ms"), 3),
            "host_wait_on_ms": round(max(s.host_wait_ms for s in p.samples["on"]), 3),
            "enqueue_on_ms": round(p.median("on", "enqueue_ms"), 3),
            "enqueue_off_ms": round(p.median("off", "enqueue_ms"), 3),
            "samples": {c: len(p.samples[c]) for c in CONDITIONS},
            # Forward i of a condition and forward i of "off" ran in the same ABBA round at
            # mirrored places: their ratios, paired, show the spread the medians stand on.
            "on_vs_off_paired": _paired(p, "on"),
            "old_vs_off_paired": _paired(p, "old"),
            "wall_ms_all": {c: [round(s.wall_ms, 3) for s in p.samples[c]] for c in p.samples},
        })
        for c in p.samples:
            if c not in CONDITIONS:
                rows[-1][f"diag_{c}"] = {
                    "ms": round(p.median(c), 2), "vs_off": round(p.median(c) / off, 4),
                    "paired_vs_off": _paired(p, c), "stall_ms": round(p.median(c, "stall_ms"), 3),
                    "gpu_ms": round(p.median(c, "gpu_ms"), 2),
                    "handoff_ms": round(p.median(c, "handoff_ms"), 3),
                    "enqueue_ms": round(p.median(c, "enqueue_ms"), 3)}
        if "prev" in p.samples:
            rows[-1]["on_vs_prev_paired"] = _paired(p, "on", "prev")
        timeline = {c: {"host_ms": _medians(p.samples[c], "host_at"),
                        "device_ms": _medians(p.samples[c], "dev_at")}
                    for c in p.samples if p.samples[c] and p.samples[c][0].host_at}
        if timeline:
            rows[-1]["timeline_layers"] = list(TIMELINE)
            rows[-1]["timeline"] = timeline
    return rows


def _paired(p: Point, cond: str, base: str = "off") -> dict[str, float]:
    """Median and quartiles of ``cond``'s wall time over ``base``'s, forward by forward."""
    r = sorted(a.wall_ms / b.wall_ms for a, b in zip(p.samples[cond], p.samples[base],
                                                     strict=True))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return {"median": round(statistics.median(r), 4), "q1": round(q[0], 4),
            "q3": round(q[2], 4)}


def _medians(samples: list[Sample], attr: str) -> list[float]:
    """Per position, the median over ``samples`` of the list ``attr``."""
    return [round(statistics.median(v), 3) for v in zip(*(getattr(s, attr) for s in samples),
                                                        strict=True)]


def print_table(rows: list[dict]) -> None:
    on, alt = config.DEFAULT_WRITER_MODE, ALT
    print(f"| tokens | host us/layer | us/token (off) | off ms | on ms ({on}) | on/off | "
          f"{alt} ms | {alt}/off | old/off (1 buffer) | paired on/off: median (q1-q3) | "
          f"paired {alt}/off: median (q1-q3) | paired on/{alt} | max host wait ms on / {alt} | "
          f"device ms off / on / {alt} | hand-off host ms on / {alt} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pon, palt, pvs = (r["on_vs_off_paired"], r[f"{alt}_vs_off_paired"],
                          r[f"on_vs_{alt}_paired"])
        print(f"| {r['tokens']} | {r['host_us_per_layer']:g} | {r['us_per_token_off']:.1f} | "
              f"{r['off_ms']:.2f} | "
              f"{r['on_ms']:.2f} | {r['on_vs_off']:.3f} | {r[f'{alt}_ms']:.2f} | "
              f"{r[f'{alt}_vs_off']:.3f} | {r['old_vs_off']:.3f} | "
              f"{pon['median']:.3f} ({pon['q1']:.3f}-{pon['q3']:.3f}) | "
              f"{palt['median']:.3f} ({palt['q1']:.3f}-{palt['q3']:.3f}) | "
              f"{pvs['median']:.3f} | "
              f"{r['host_wait_on_ms']:.2f} / {r[f'host_wait_{alt}_ms']:.2f} | "
              f"{r['gpu_off_ms']:.2f} / {r['gpu_on_ms']:.2f} / {r[f'gpu_{alt}_ms']:.2f} | "
              f"{r['handoff_on_ms']:.2f} / {r[f'handoff_{alt}_ms']:.2f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="where the forward runs (default: cuda if available, else cpu)")
    for name, help_ in (("hidden", "hidden size"), ("layers", "decoder layers"),
                        ("requests", "requests per forward (each a file)"),
                        ("forwards", "timed forwards per block (after --warmup untimed ones)"),
                        ("rounds", "ABBA rounds (samples per condition: 2 x rounds x forwards)")):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"{help_} (default: {DEFAULTS['cuda'][name]} on cuda, "
                             f"{DEFAULTS['cpu'][name]} on cpu)")
    for name, key, help_ in (("aux-layers", "aux", "captured layers"),
                             ("chunks", "chunks", "tokens per forward, comma-separated"),
                             ("us-per-token", "us", "target forward us per token, "
                                                    "comma-separated")):
        ap.add_argument(f"--{name}", default=None,
                        help=f"{help_} (default: {DEFAULTS['cuda'][key]} on cuda, "
                             f"{DEFAULTS['cpu'][key]} on cpu)")
    ap.add_argument("--host-us-per-layer", default=None,
                    help="host microseconds of Python and tiny kernel launches before each "
                         "layer, comma-separated: a grid dimension (an eager SGLang DeepSeek / "
                         "Kimi layer: ~200-900 us, see HOST_US_CUDA's comment) (default: "
                         f"{HOST_US_CUDA} on cuda, 0 on cpu)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed forwards at the start of each block (default: 1)")
    ap.add_argument("--gap", type=float, default=None,
                    help="seconds the device idles after each block's checks, so that every "
                         "block starts from the same idle time: a forward right after another "
                         "block ran up to 10%% slower than one after a block's checks "
                         f"(default: {DEFAULTS['cuda']['gap']} on cuda, "
                         f"{DEFAULTS['cpu']['gap']} on cpu)")
    ap.add_argument("--order", choices=("sync", "overlap"), default="sync",
                    help="sync: the host waits for each forward before it enqueues the next, "
                         "so every forward starts on an idle device and its first layers wait "
                         "for the host (as with SGLang's overlap scheduler off, or "
                         "SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP=1); overlap: the timed "
                         "forward is enqueued while the warm-up forward before it runs (SGLang's "
                         "default overlap scheduler for consecutive prefill batches), and its "
                         "sample is its span on the device; needs --forwards 1 (default: sync)")
    ap.add_argument("--threads", type=int, default=config.DEFAULT_WRITER_THREADS,
                    help=f"writer threads (default: {config.DEFAULT_WRITER_THREADS})")
    ap.add_argument("--cap", type=int, default=config.DEFAULT_MAX_INFLIGHT,
                    help=f"writer in-flight cap, bytes (default: {config.DEFAULT_MAX_INFLIGHT})")
    ap.add_argument("--min-free", type=int, default=0,
                    help="writer free-space reserve, bytes (default: 0)")
    ap.add_argument("--dump-dir", type=Path, default=None,
                    help="where the files go (default: a fresh folder under /dev/shm if it "
                         "exists, else the temp dir; removed afterwards)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here "
                    "(default: none)")
    ap.add_argument("--diagnose", nargs="?", const=",".join(DIAGNOSTIC), default="",
                    metavar="CONDS",
                    help="also measure conditions that each leave out or add one part of the "
                         f"dump (CONDS, comma-separated; without it all: {', '.join(DIAGNOSTIC)}; "
                         "see the source), record the host's enqueue time and the device's "
                         "time at a few layers of every forward and time the packing copy and "
                         "the pre-hook alone (default: off)")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's device time per kernel for 3 forwards on "
                         "and off at each point (default: off)")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    d = DEFAULTS[args.device]
    for name, key in (("hidden", "hidden"), ("layers", "layers"), ("requests", "requests"),
                      ("forwards", "forwards"), ("rounds", "rounds"), ("aux_layers", "aux"),
                      ("chunks", "chunks"), ("us_per_token", "us"), ("gap", "gap")):
        if getattr(args, name) is None:
            setattr(args, name, d[key])
    if args.host_us_per_layer is None:
        args.host_us_per_layer = HOST_US_CUDA if args.device == "cuda" else "0"
    args.diagnose = [c for c in args.diagnose.split(",") if c]
    unknown = sorted(set(args.diagnose) - set(DIAGNOSTIC))
    if unknown:
        ap.error(f"--diagnose: unknown conditions {unknown}")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.order == "overlap" and (args.forwards != 1 or args.warmup < 1):
        ap.error("--order overlap needs --forwards 1 and --warmup >= 1")
    if 2 * args.rounds * args.forwards < 5:
        ap.error("fewer than 5 samples per condition: raise --forwards or --rounds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    own_dir = args.dump_dir is None
    if own_dir:
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        args.dump_dir = Path(tempfile.mkdtemp(prefix="hsdump-bench-forward-", dir=base))
    args.dump_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, device)
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else platform.processor() or platform.machine())
    print(f"# bench_forward {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on "
          f"{machine}, torch {torch.__version__}; hidden {args.hidden}, {args.layers} layers, "
          f"captured {args.aux_layers} + final, {args.requests} requests per forward, "
          f"{2 * args.rounds * args.forwards} forwards per condition, order {args.order}, "
          f"writer {args.threads} threads into {args.dump_dir}", flush=True)
    points = []
    try:
        for tokens in (int(x) for x in args.chunks.split(",")):
            for us, host in itertools.product(
                    (float(x) for x in args.us_per_token.split(",")),
                    [float(x) for x in args.host_us_per_layer.split(",")]):
                t0 = time.perf_counter()
                points.append(bench.point(tokens, us, host))
                r = table(points[-1:])[0]
                print(f"# {tokens} tokens, ~{us:g} us/token, {host:g} host us/layer: "
                      f"{json.dumps(r)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        for w in bench.writers.values():
            w.close()
        if own_dir:
            shutil.rmtree(args.dump_dir, ignore_errors=True)
    rows = table(points)
    print_table(rows)
    verdicts = {}
    for cond in ("on", ALT):
        worst = max(r[f"{cond}_vs_off"] for r in rows)
        verdicts[cond] = worst <= GOAL
        print(f"goal {cond}/off <= {GOAL} at every point: "
              f"{'met' if verdicts[cond] else 'NOT met'} (worst {worst:.3f})")
    met = verdicts["on"]
    print(f"verified {bench.verified_values:,} values in {bench.verified_files} files; "
          f"errors: {len(bench.errors)}")
    for e in bench.errors[:20]:
        print(f"error: {e}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "machine": machine, "torch": torch.__version__, "order": args.order, "rows": rows,
            "goal_met": met,
            f"goal_met_{ALT}": verdicts[ALT], "verified_values": bench.verified_values,
            "verified_files": bench.verified_files, "errors": bench.errors,
            "writers": {m: w.stats.as_dict() for m, w in bench.writers.items()}}, indent=1))
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
