#!/usr/bin/env python3
"""Where the host's time goes at the start of a 2k-token forward, per condition (issue 17).

``scripts/bench_forward.py``'s synthetic forward (its model, writers and hand-off), timed more
finely at the start, where the device waits for the host: the host's time after the start
event, the pre-hook, the embedding, layers 0 and 1, the fill and the store at layer 2, layers
2, 3, 4 and 8 (``MARKS``); the device's time at layers 0, 3, 8, 24 and 48; every garbage
collection and every frame the writer process's waiter thread sends, relative to the forward's
start. Blocks of one warm-up and one timed forward in ABBA order, 0.1 s of idle device after
each block, as in bench_forward. Conditions (``CONDITIONS``): ``off``; ``on`` (what ships);
``onold`` (``on`` with the store as before 2026-12-02 23:40 UTC: ``copy_rows`` on fresh
slices); ``pack`` (packing copies only, no hand-off); ``pflush`` / ``psync`` / ``pspin``
(``on``, after each forward, untimed: the writer flushed / the copies synchronized / the host
spinning until the copies and every file are done); ``d2hw`` (no dump, one forward's bytes
copied to pinned memory after each forward in 8 MiB pieces on a side stream); ``packmem``
(``pack``, then 256 MiB copied in host memory after each forward); ``onnogc`` (``on`` with the
garbage collector off); ``offovl`` / ``onovl`` / ``packovl`` (the timed forward enqueued while
the warm-up forward runs; compare device times).

    PYTHONPATH=. python scripts/probe_start.py --us-per-token 5,10 \\
        --conds off,on,onold,pack,pspin,d2hw --json probe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import scripts.bench_forward as bf
from hsdump_patch.capture import writer_proc
from hsdump_patch.capture.session import (
    CAPTURE_BUFFERS,
    CaptureBuffers,
    _ForwardState,
    copy_rows,
)

MARKS = ("start event", "pre-hook", "embed", "layer 0 start", "layer 0", "layer 1", "fill 2",
         "store 2", "layer 2", "layer 3", "layer 4", "layers 5-8")
DEVICE_AT = (0, 3, 8, 24, 48)
CONDITIONS = ("off", "on", "onold", "pack", "pflush", "psync", "pspin", "d2hw", "packmem",
              "onnogc", "offovl", "onovl", "packovl")
_GC: list[tuple[float, float]] = []
_SENDS: list[float] = []


def _watch() -> None:
    """Record every garbage collection and every frame the waiter thread sends."""
    started = [0.0]

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            _GC.append((started[0], time.perf_counter()))

    write_all = writer_proc._write_all

    def sending(fd: int, data: bytes) -> None:
        _SENDS.append(time.perf_counter())
        write_all(fd, data)

    gc.callbacks.append(on_gc)
    writer_proc._write_all = sending


def _base(cond: str) -> str:
    """The condition's dump: "off", "on" or "pack" (d2hw: "off")."""
    base = cond.removesuffix("nogc").removesuffix("ovl").removesuffix("mem")
    return {"onold": "on", "pflush": "on", "psync": "on", "pspin": "on",
            "d2hw": "off"}.get(base, base)


class Probe(bf.Bench):
    """bench_forward's Bench with the finer timing of the forward's start."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        super().__init__(args, device)
        self.records: dict[str, list[dict[str, Any] | None]] = {}
        self._d2h: tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor] | None = None
        self._host: tuple[np.ndarray, np.ndarray] | None = None

    def forward(self, model: bf.Model, buffers: CaptureBuffers | None, tag: str,
                noise: str = "", wait: bool = True) -> tuple[bf.Sample, int]:
        f = self.forward_no = self.forward_no + 1
        cond = tag
        if cond.endswith("nogc"):
            gc.disable()
        t0 = time.perf_counter()
        marks = []
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        marks.append(time.perf_counter())
        state = _ForwardState(buffers, None, model.tokens) if buffers is not None else None
        marks.append(time.perf_counter())
        model.embed(f)
        marks.append(time.perf_counter())
        devs = []
        slot_of = {layer: slot for slot, layer in enumerate(self.aux)}
        for i in range(model.layers):
            if i == 0:
                marks.append(time.perf_counter())
            if i in DEVICE_AT:
                devs.append(torch.cuda.Event(enable_timing=True))
                devs[-1].record()
            slot = slot_of.get(i)
            if slot is not None:
                model.fill(model.x, f, slot)
                if i == 2:
                    marks.append(time.perf_counter())
                if state is not None and cond == "onold":
                    assert state.buf is not None
                    copy_rows(state.buf[: state.rows, slot], model.x[: state.rows])
                    state.captured.add(slot)
                elif state is not None:
                    state.store(slot, model.x)
                if i == 2:
                    marks.append(time.perf_counter())
            model.layer()
            if i in (0, 1, 2, 3, 4, 8):
                marks.append(time.perf_counter())
        final = model.fill(torch.empty_like(model.x), f, self.slots - 1)
        t1 = time.perf_counter()
        if cond == "d2hw":
            self._copy_to_host()
        if state is not None and _base(cond) == "pack":
            state.store_final(self.slots - 1, final)
            assert state.buffers is not None
            state.buffers.handed_off()
        elif state is not None:
            self.hand_off(state, model, final, f, tag)
        handoff = (time.perf_counter() - t1) * 1e3
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        if not wait:  # the next forward is enqueued while this one runs
            self.records.setdefault(cond, []).append(None)
            return bf.Sample(0.0, 0.0, 0.0, 0.0, handoff), f
        end.synchronize()
        t2 = time.perf_counter()
        if cond.endswith("nogc"):
            gc.enable()
        self.records.setdefault(cond, []).append({
            "wall": (t2 - t0) * 1e3, "gpu": start.elapsed_time(end), "handoff": handoff,
            "marks": [(x - t0) * 1e3 for x in marks],
            "dev": [start.elapsed_time(e) for e in devs],
            "gc": [(a - t0) * 1e3 for a, _ in _GC if t0 <= a <= t2],
            "sends": [(s - t0) * 1e3 for s in _SENDS if t0 <= s <= t2]})
        return bf.Sample((t2 - t0) * 1e3, start.elapsed_time(end), 0.0, 0.0, handoff), f

    def _copy_to_host(self) -> None:
        """d2hw: one forward's bytes, device to pinned host memory in 8 MiB pieces on a side
        stream after the forward's work, as the hand-off's copies are (no writer)."""
        if self._d2h is None:
            n = 2048 * self.slots * self.args.hidden * 2
            self._d2h = (torch.cuda.Stream(), torch.ones(n, dtype=torch.uint8, device="cuda"),
                         torch.empty(n, dtype=torch.uint8, pin_memory=True))
        stream, src, dst = self._d2h
        stream.wait_stream(torch.cuda.current_stream())
        piece = 8 << 20
        with torch.cuda.stream(stream):
            for a in range(0, src.numel(), piece):
                dst[a : a + piece].copy_(src[a : a + piece], non_blocking=True)

    def after(self, cond: str) -> None:
        w = self.writer
        if cond == "packmem":
            if self._host is None:
                self._host = (np.ones(256 << 20, np.uint8), np.empty(256 << 20, np.uint8))
            np.copyto(self._host[1], self._host[0])
        elif cond == "pspin":
            copies = w.copies_event()
            assert copies is not None
            while not copies.query():
                pass
            t = time.perf_counter()
            while not w._files.idle() and time.perf_counter() - t < 5:
                pass
        elif cond == "pflush":
            w.flush(timeout=600)
        elif cond == "psync":
            assert w._side_stream is not None
            w._side_stream.synchronize()


def point(b: Probe, tokens: int, us: float, conds: list[str], rounds: int) -> dict[str, Any]:
    """Measure ``conds`` at one point; return the medians per condition."""
    model, _ = b.calibrate(tokens, us)
    bufs = {name: CaptureBuffers(w, b.slots, model.hidden, torch.bfloat16, b.device,
                                 CAPTURE_BUFFERS)
            for name, w in (("on", b.writer), ("pack", b.alt_writer))}
    for x in bufs.values():
        x.reserve(tokens)
    b.records = {}
    for _ in range(rounds):
        for cond in conds + conds[::-1]:
            base = _base(cond)
            buf = None if base == "off" else bufs[base]
            dumped = []
            for k in range(2):
                _, f = b.forward(model, buf, cond, wait=not (cond.endswith("ovl") and k == 0))
                if buf is not None:
                    dumped.append((cond, f))
                b.after(cond)
            b.discard(model, dumped)
            torch.cuda.synchronize()
            time.sleep(0.1)
    row: dict[str, Any] = {"marks": MARKS, "device_at": DEVICE_AT}
    for c in conds:
        timed = [r for r in b.records[c][1::2] if r is not None]
        med: dict[str, Any] = {key: round(statistics.median(r[key] for r in timed), 4)
                               for key in ("wall", "gpu", "handoff")}
        for key in ("marks", "dev"):
            med[key] = [round(statistics.median(v), 4)
                        for v in zip(*(r[key] for r in timed), strict=True)]
        med["gc_in_timed"] = sum(len(r["gc"]) for r in timed)
        med["first_send_ms"] = [round(r["sends"][0], 3) for r in timed if r["sends"]]
        base, key = ("offovl", "gpu") if c.endswith("ovl") else ("off", "wall")
        if base in b.records and c != base:
            other = [r for r in b.records[base][1::2] if r is not None]
            med[f"paired_{key}_vs_{base}"] = round(statistics.median(
                a[key] / o[key] for a, o in zip(timed, other, strict=True)), 4)
        row[c] = med
    row["us_per_token_off"] = round(row[conds[0]]["wall"] * 1e3 / tokens, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--us-per-token", default="5,10", help="targets (default: 5,10)")
    ap.add_argument("--conds", default="off,on,pack",
                    help=f"comma-separated, the first is the base (one of {', '.join(CONDITIONS)}; "
                         "default: off,on,pack)")
    ap.add_argument("--rounds", type=int, default=10, help="ABBA rounds (default: 10)")
    ap.add_argument("--json", type=Path, required=True, help="results (no default)")
    opts = ap.parse_args(argv)
    conds = opts.conds.split(",")
    if set(conds) - set(CONDITIONS) or not torch.cuda.is_available():
        ap.error(f"conditions must be among {CONDITIONS}, on a CUDA machine")
    args = bf.parse_args(["--device", "cuda", "--chunks", "2048"])
    args.dump_dir = Path(tempfile.mkdtemp(prefix="hsdump-probe-", dir="/dev/shm"))
    torch.cuda.set_device(0)
    _watch()
    b = Probe(args, torch.device("cuda", 0))
    results = {}
    try:
        for us in (float(x) for x in opts.us_per_token.split(",")):
            results[us] = point(b, 2048, us, conds, opts.rounds)
            print(json.dumps({us: results[us]}), flush=True)
            opts.json.write_text(json.dumps(results, indent=1))
    finally:
        for w in b.writers.values():
            w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
