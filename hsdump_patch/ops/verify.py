"""``hsdump verify``: the acceptance run for a host, before a long extraction.

It generates a small random model of the production architecture (a Kimi-K2.5 checkpoint:
MLA + MoE with Kimi's attention and routing, :mod:`hsdump_patch.ops.verify_model`), serves it
with the ``hsdump serve`` profile at each tensor-parallel size, once with the dump on and once
off, and checks:

a. the dump equals SGLang's own EAGLE-3 capture (``--enable-return-aux-hidden-states``,
   ``return_hidden_states``) of the same forward, bit for bit, every chunk: hsdump's collector
   against SGLang's packer fed the same tensor (the plumbing, not the numerics: that is b);
   batches of at most the fused all-reduce threshold (2,048 tokens on GPU) and larger ones, a
   multi-chunk prompt, many requests in one forward; whether the fused all-reduce + RMSNorm
   ran is reported;
b. the dump equals an independent float32 forward (HF transformers, same weights) within
   ``verify_checks.BF16_MAX_REL`` / ``BF16_MEAN_REL``;
c. outputs (token ids and every logprob) are bitwise identical with the dump on and off, once
   each server has shown it repeats itself;
d. every rank installed the capture and exactly one writes;
e. the configurations the patch must refuse are refused (SGLang's resolved config, and a real
   launch);
f. the dump's cost: on the dump-on server, the same prompts sent with and without the dump
   prefix in ABBA blocks (:mod:`hsdump_patch.ops.verify_cost`; the ratio of SGLang's
   per-request times, its 95% interval and n; fails only when the lower bound is above the
   floor, 1.05 on GPU), prefill tokens/s on vs off, the writer GPU's (by device id) vs the
   other ranks' peak memory, the writer rank's CPU time (its writer child included), and no
   staging page left pageable by a failed ``cudaHostRegister`` (``status.json``).

Prints a verdict table, writes a JSON report, exits 1 on any FAIL. Without a GPU it runs the
CPU variant (TP 1 and 2, proportionally smaller batches).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hsdump_patch import protocol
from hsdump_patch.client.dumps.dumpdir import read_request, wait_for_marker
from hsdump_patch.client.output.records import RecordBuilder
from hsdump_patch.client.output.report import format_table
from hsdump_patch.ops import blackwell, serve, verify_checks, verify_cost, verify_model
from hsdump_patch.ops.verify_server import (
    AUX_ARGS,
    CPU_SERVER_ARGS,
    VerifyServer,
    cuda_device_uuids,
    run_refused,
)
from hsdump_patch.protocol import ENV_DIR

RID = "hsdump-verify-"
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# flashinfer's fused all-reduce + residual + RMSNorm, on by default for DeepSeek-V3 / Kimi-K2.5
# on sm90 / sm100, runs for batches of at most 2,048 tokens; larger ones take the unfused path.
GPU_FUSION_TOKENS = 2048
CPU_FUSION_TOKENS = 64  # the CPU variant's stand-in: same cases, 32x smaller
CPU_CHUNK = 2 * CPU_FUSION_TOKENS
KIMI_HIDDEN = 7168
CHECKS = {
    "a": "dump == SGLang's EAGLE-3 capture, bit for bit",
    "b": "dump vs independent fp32 reference",
    "c": "outputs identical, dump on vs off",
    "d": "capture on every rank, one writer",
    "e": "refused configurations are refused",
    "f": "dump overhead",
}
# (name, extra SGLang flags or None = drop --disable-radix-cache, the flag the message names)
REFUSED = [
    ("radix cache on", None, "--disable-radix-cache"),
    ("prefill graphs over --disable-cuda-graph",
     ["--disable-cuda-graph", "--cuda-graph-backend-prefill", "breakable"],
     "--cuda-graph-backend-prefill"),
    ("PD multiplexing", ["--enable-pdmux"], "--enable-pdmux"),
    ("DWDP (turns on attention DP)", ["--tp-size", "2", "--dwdp-size", "2"], "--dwdp-size"),
    ("two-batch overlap", ["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
    ("pipeline parallel", ["--pp-size", "2"], "--pp-size"),
    ("multi-node --dp-size", ["--nnodes", "2", "--dp-size", "2", "--dist-init-addr",
                              "127.0.0.1:50000"], "--dp-size"),
]


@dataclass
class Verdict:
    """One row of the verdict table."""

    check: str
    scope: str
    verdict: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Settings:
    """What one verify run does (from the command line)."""

    device: str
    tps: list[int]
    work: Path
    dump_root: Path
    fusion_tokens: int
    min_prefill_ratio: float
    max_writer_extra_mib: float
    server_timeout: float
    max_cost_ratio: float = verify_cost.GPU_MAX_RATIO
    cost_blocks: int = verify_cost.GPU_BLOCKS
    capability: tuple[int, int] | None = None  # the GPUs' lowest compute capability
    device_uuids: dict[int, str] = field(default_factory=dict)  # CUDA device id: GPU uuid
    gen_tokens: int = 8
    throughput_rounds: int = 3
    progress: bool = True
    extra_args: list[str] = field(default_factory=list)

    @property
    def production_extra(self) -> list[str]:
        """SGLang arguments of production (plus the CPU variant's), for the refusal checks."""
        cpu = [*CPU_SERVER_ARGS, "--chunked-prefill-size", str(CPU_CHUNK)]
        return text_only([*(cpu if self.device == "cpu" else []), *self.extra_args])

    @property
    def sglang_extra(self) -> list[str]:
        """What the verify servers run with: production plus SGLang's own aux capture."""
        return [*self.production_extra, *AUX_ARGS]


OVERRIDE_FLAG = "--json-model-override-args"


def text_only(args: list[str]) -> list[str]:
    """``args`` with ``language_model_only`` added to SGLang's model config overrides (merged
    into the caller's own ``--json-model-override-args``, if any): the Kimi-K2.5 checkpoint is
    served text-only, as it has no image processor (SGLang 0.5.23's ``--language-model-only``
    does not take Kimi-K2.5)."""
    out, overrides = [], {}
    it = iter(args)
    for a in it:
        if a == OVERRIDE_FLAG or a.startswith(OVERRIDE_FLAG + "="):
            value = a.partition("=")[2] if "=" in a else next(it, "{}")
            try:
                overrides.update(json.loads(value))
            except ValueError as e:
                raise ValueError(f"{OVERRIDE_FLAG} {value!r} is not JSON: {e}") from None
        else:
            out.append(a)
    return [*out, OVERRIDE_FLAG, json.dumps({**overrides, "language_model_only": True})]


def prompt(seed: int, length: int) -> list[int]:
    """Deterministic random token ids (BOS first), valid for the generated tokenizer."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, verify_model.VOCAB - 16) for _ in range(length - 1)]


def aux_cases(t: int, chunk: int) -> dict[str, list[int]]:
    """Prompt lengths per case of check (a), one ``/generate`` call (one batch) each, for a
    fused all-reduce threshold ``t`` and the server's prefill chunk size ``chunk``."""
    return {
        f"one prompt, {3 * t // 4} tokens (<= {t})": [3 * t // 4],
        f"one prompt, {min(3 * t // 2, chunk)} tokens (> {t})": [min(3 * t // 2, chunk)],
        f"multi-chunk prompt, {2 * chunk + t // 4} tokens": [2 * chunk + t // 4],
        f"8 requests x {t // 16} tokens (<= {t})": [t // 16] * 8,
        f"8 requests x {t // 4} tokens (> {t})": [t // 4] * 8,
    }


def say(settings: Settings, msg: str) -> None:
    if settings.progress:
        print(f"hsdump verify: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- one server


@dataclass
class Dumped:
    """A dumped prompt: its ids and the hidden states read back through the client."""

    ids: list[int]
    hidden: torch.Tensor  # [L, S, H], slots in server.json order (layers, then final)
    chunk_starts: list[int]
    layers: list[int]


def read_dumped(dump_dir: Path, rid: str, ids: list[int], timeout: float = 300) -> Dumped:
    """Wait for the request's marker, then read it with the client's own reader."""
    status = wait_for_marker(dump_dir, rid, timeout)
    if status is None or status.error is not None:
        raise protocol.ProtocolError(
            f"{rid}: " + ("no marker" if status is None else f"error marker: {status.error}"))
    info = protocol.read_server_info(dump_dir)
    builder = RecordBuilder("eagle3", len(ids), info)
    read_request(dump_dir, rid, ids, info, builder)
    slots = [*builder.layers, *([builder.final] if builder.final is not None else [])]
    starts = [p for p, _ in protocol.list_chunks(dump_dir, rid)]
    return Dumped(ids, torch.stack(slots, dim=1), starts, list(info.layers))


def _generate(server: VerifyServer, prompts: list[list[int]], rids: list[str],
              **extra: Any) -> list[dict[str, Any]]:
    body = {"input_ids": prompts if len(prompts) > 1 else prompts[0],
            "rid": rids if len(rids) > 1 else rids[0],
            "sampling_params": {"max_new_tokens": extra.pop("max_new_tokens", 1),
                                "temperature": 0}, **extra}
    out = server.post("/generate", body)
    return out if isinstance(out, list) else [out]


def _max_new_seqs(log_tail: str) -> int:
    return max((int(n) for n in re.findall(r"Prefill batch.*?#new-seq: (\d+)", log_tail)),
               default=0)


def _builtin_rows(out: dict[str, Any]) -> torch.Tensor:
    """SGLang's own capture of a request: its last prefill chunk's rows, ``[n, K * H]``."""
    return torch.tensor(out["meta_info"]["hidden_states"][0])


def _dumped_rows(d: Dumped, start: int, end: int, k: int) -> torch.Tensor:
    """The dump's layer slots (no final state) of rows ``[start, end)``, as SGLang packs them."""
    return d.hidden[start:end, :k].reshape(end - start, -1)


def _compare_earlier_chunks(server: VerifyServer, rid: str, d: Dumped, k: int) -> list[str]:
    """SGLang returns only a request's last chunk, so each earlier chunk ``[s, e)`` of a prompt
    that had its forwards to itself is compared through the prompt cut at ``e``, re-sent
    alone: its chunks are the same forwards, and its last one is ``[s, e)``."""
    assert server.dump_dir is not None
    problems = []
    starts = [*d.chunk_starts, len(d.ids)]
    for j in range(len(d.chunk_starts) - 1):
        s, e = starts[j], starts[j + 1]
        cut_rid = f"{rid}-upto{e}"
        out = _generate(server, [d.ids[:e]], [cut_rid], return_hidden_states=True)[0]
        try:
            cut = read_dumped(server.dump_dir, cut_rid, d.ids[:e])
        except protocol.ProtocolError as err:
            problems.append(str(err))
            continue
        if cut.chunk_starts != d.chunk_starts[: j + 1]:
            problems.append(f"{cut_rid}: chunked at {cut.chunk_starts}, the whole prompt at "
                            f"{d.chunk_starts}: not the same forwards")
            continue
        bad = verify_checks.bitwise_mismatch(_dumped_rows(d, s, e, k), _builtin_rows(out))
        if bad:
            problems.append(f"{rid} chunk [{s}, {e}): {bad}")
    return problems


def check_aux(server: VerifyServer, t: int, chunk: int, dumps: dict[str, Dumped]) -> Verdict:
    """Check (a) on a dump-on server, every chunk of every prompt; every dumped prompt is
    kept in ``dumps`` for (b)."""
    assert server.dump_dir is not None
    k = len(protocol.read_server_info(server.dump_dir).layers)
    rows, failures, seed = [], [], 1000 * server.tp
    for case, lengths in aux_cases(t, chunk).items():
        prompts = [prompt(seed + i, n) for i, n in enumerate(lengths)]
        seed += len(lengths)
        rids = [f"{RID}aux-tp{server.tp}-{seed}-{i}" for i in range(len(prompts))]
        log_before = len(server.log())
        outs = _generate(server, prompts, rids, return_hidden_states=True)
        new_seqs = _max_new_seqs(server.log()[log_before:])
        problems = []
        compared = 0
        for rid, ids, out in zip(rids, prompts, outs, strict=True):
            try:
                d = dumps[rid] = read_dumped(server.dump_dir, rid, ids)
            except protocol.ProtocolError as e:
                problems.append(str(e))
                continue
            bad = verify_checks.bitwise_mismatch(
                _dumped_rows(d, d.chunk_starts[-1], len(ids), k), _builtin_rows(out))
            if bad:
                problems.append(f"{rid} last chunk: {bad}")
            compared += 1
            if len(d.chunk_starts) > 1 and len(prompts) > 1:
                problems.append(f"{rid}: split into {len(d.chunk_starts)} chunks in forwards "
                                "shared with other requests: its earlier chunks cannot be "
                                "compared (lower the batch's tokens)")
            elif len(d.chunk_starts) > 1:
                problems += _compare_earlier_chunks(server, rid, d, k)
                compared += len(d.chunk_starts) - 1
        chunks = max((len(dumps[r].chunk_starts) for r in rids if r in dumps), default=0)
        if "multi-chunk" in case and chunks < 2:
            problems.append(f"the prompt was not split (1 chunk at --chunked-prefill-size "
                            f"{chunk})")
        if len(lengths) > 1 and new_seqs < 2:
            problems.append("the requests never shared a forward (server log: at most "
                            f"{new_seqs} new request per prefill batch)")
        rows.append({"case": case, "chunks": chunks, "chunks_compared": compared,
                     "max_requests_per_forward": new_seqs, "ok": not problems,
                     "problems": problems})
        failures += [f"{case}: {p}" for p in problems]
    total = sum(len(v) for v in aux_cases(t, chunk).values())
    detail = (f"{total} prompts in {len(rows)} cases, every chunk ("
              f"{sum(r['chunks_compared'] for r in rows)}), equal SGLang's capture bit for bit"
              if not failures else "; ".join(failures[:3]))
    return Verdict("a", f"tp {server.tp}", FAIL if failures else PASS, detail, {"cases": rows})


def generate_outputs(server: VerifyServer, settings: Settings, run: int) -> dict[str, Any]:
    """Greedy generations with every logprob, one request at a time (check c)."""
    out = {}
    for i, n in enumerate((settings.fusion_tokens // 4, settings.fusion_tokens)):
        r = _generate(server, [prompt(7000 + i, n)], [f"{RID}gen-tp{server.tp}-{i}-run{run}"],
                      max_new_tokens=settings.gen_tokens, return_logprob=True,
                      top_logprobs_num=5, logprob_start_len=0)[0]
        meta = r["meta_info"]
        out[f"prompt {i} ({n} tokens)"] = {
            "output_ids": r["output_ids"],
            **{k: meta[k] for k in ("input_token_logprobs", "output_token_logprobs",
                                    "output_top_logprobs")}}
    return out


def measure_prefill(server: VerifyServer, settings: Settings) -> dict[str, Any]:
    """Prefill throughput of batches of 8 prompts of 3/4 threshold tokens (check f): one warm-up
    round, then ``throughput_rounds`` timed ones; rank CPU seconds over the timed rounds."""
    n = 3 * settings.fusion_tokens // 4
    prompts = [prompt(9000 + i, n) for i in range(8)]
    missing: list[str] = []  # dumped rids without a done marker

    def one_round(r: int) -> float:
        rids = [f"{RID}tput-tp{server.tp}-{r}-{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        _generate(server, prompts, rids)
        wall = time.perf_counter() - t0
        if server.dump_dir is not None:
            for rid in rids:
                status = wait_for_marker(server.dump_dir, rid, 300)
                if status is None or status.error is not None:
                    missing.append(rid)
                shutil.rmtree(protocol.rid_dir(server.dump_dir, rid), ignore_errors=True)
        return wall

    one_round(0)
    deadline = time.monotonic() + 30  # status.json names the writer process (counted in CPU)
    while server.dump_dir is not None and server.writer_pid() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    cpu0 = server.rank_cpu_seconds()
    t0 = time.perf_counter()
    prefill_wall = sum(one_round(r) for r in range(1, settings.throughput_rounds + 1))
    total_wall = time.perf_counter() - t0
    cpu1 = server.rank_cpu_seconds()
    tokens = n * len(prompts) * settings.throughput_rounds
    return {"tokens": tokens, "undumped_requests": missing,
            "prefill_tokens_per_s": tokens / prefill_wall,
            "end_to_end_tokens_per_s": tokens / total_wall,
            "rank_cpu_s": {r: round(cpu1[r] - cpu0.get(r, 0.0), 3) for r in cpu1}}


def check_cost(server: VerifyServer, settings: Settings, chunk: int) -> Verdict:
    """Check (f) on the dump-on server: prompts of two ``chunk``-token forwards sent with and
    without the dump prefix in ABBA blocks (:mod:`hsdump_patch.ops.verify_cost`); fails when
    the lower 95% bound of dumped / undumped is above ``settings.max_cost_ratio`` or a dumped
    request left no done marker."""
    assert server.dump_dir is not None
    scope = f"tp {server.tp} cost (ABBA)"
    prefix = protocol.read_server_info(server.dump_dir).rid_prefix
    prompts = [prompt(11000 + i, 2 * chunk) for i in range(settings.cost_blocks)]
    m = verify_cost.measure(server, prompts, prefix, f"verify-cost-tp{server.tp}")
    stats = verify_cost.abba_stats(m["on_s"], m["off_s"])
    passed, detail = verify_cost.cost_verdict(stats, settings.max_cost_ratio)
    if settings.device != "cuda":
        detail += " (CPU: plumbing, the writer shares the cores with the forward)"
    detail += f"; prompts of {2 * chunk} tokens = 2 forwards at --chunked-prefill-size {chunk}"
    data = {**stats.to_json(), "floor": settings.max_cost_ratio, "chunk": chunk, **m}
    if m["problems"]:
        return Verdict("f", scope, FAIL, "; ".join([*m["problems"][:3], detail]), data)
    return Verdict("f", scope, PASS if passed else FAIL, detail, data)


def check_ranks(server: VerifyServer) -> Verdict:
    """Check (d): every rank logged an installed capture and left its install marker, one as
    the writer; server.json names the writer's process."""
    assert server.dump_dir is not None
    log = server.log()
    writers, others = log.count("; writer rank"), log.count("; non-writer rank")
    pids = server.rank_pids()
    info = protocol.read_server_info(server.dump_dir)
    problems = []
    if writers != 1:
        problems.append(f"{writers} ranks logged an installed writer capture (expected 1)")
    if others != server.tp - 1:
        problems.append(f"{others} ranks logged a non-writer capture (expected {server.tp - 1})")
    if info.tp_size != server.tp:
        problems.append(f"server.json says tp_size {info.tp_size}")
    if pids and info.pid != pids.get(0):
        problems.append(f"server.json was written by pid {info.pid}, not TP rank 0 "
                        f"({pids.get(0)})")
    markers = {}  # the install marker each rank writes
    for rank in range(server.tp):
        path = protocol.install_marker(server.dump_dir, rank)
        try:
            markers[rank] = json.loads(path.read_text())
        except (OSError, ValueError):
            problems.append(f"no install marker {path.name} for TP rank {rank}")
    marker_writers = [r for r, m in markers.items() if m.get("writer")]
    if markers and marker_writers != [0]:
        problems.append(f"install markers name writers {marker_writers} (expected [0])")
    wrong_pid = [r for r, m in markers.items() if pids and m.get("pid") != pids.get(r)]
    if wrong_pid:
        problems.append(f"install markers of ranks {wrong_pid} are not from this server's "
                        "scheduler processes")
    strays = [e.name for e in os.scandir(server.dump_dir)
              if e.is_dir() and not e.name.startswith(protocol.rid_dirname(RID))]
    if strays:
        problems.append(f"request dirs of other rids: {strays[:3]}")
    data = {"writer_lines": writers, "non_writer_lines": others, "rank_pids": pids,
            "install_markers": markers, "server_json_pid": info.pid,
            "layers": list(info.layers), "final": info.has_final}
    detail = (f"{server.tp} of {server.tp} ranks installed the capture (log, install "
              f"markers); rank 0 "
              f"(pid {info.pid}) is the only writer; layers {list(info.layers)}"
              f"{' + final' if info.has_final else ''}")
    return Verdict("d", f"tp {server.tp}", FAIL if problems else PASS,
                   "; ".join(problems) or detail, data)


def writer_status(dump_dir: Path) -> dict[str, Any] | None:
    """The writer rank's ``status.json`` (None: unreadable)."""
    try:
        return json.loads((dump_dir / protocol.STATUS).read_text())
    except (OSError, ValueError):
        return None


def check_staging(status: dict[str, Any] | None, tp: int) -> Verdict:
    """Check (f): no staging page of the writer is pageable memory because
    ``cudaHostRegister`` failed on it (``writer.pin_failed_pages`` of ``status.json``, read
    after the timed rounds): copies into such pages serialise with the host."""
    scope = f"tp {tp} staging"
    writer = (status or {}).get("writer")
    if not writer:
        return Verdict("f", scope, FAIL, "no writer counters in the writer rank's "
                       f"{protocol.STATUS}")
    failed = writer["pin_failed_pages"]
    data = {"writer": writer}
    if failed:
        return Verdict("f", scope, FAIL,
                       f"writer.pin_failed_pages is {failed} in {protocol.STATUS}: "
                       f"cudaHostRegister failed, {failed} staging pages are pageable memory "
                       "and the device-to-host copies into them serialise with the host (the "
                       "server log says why)", data)
    return Verdict("f", scope, PASS, f"writer.pin_failed_pages is 0 in {protocol.STATUS} "
                   f"({writer['mode']} writer, {writer['staging_bytes'] >> 20} MiB staging)",
                   data)


@dataclass
class TpRun:
    """What the dump-on and dump-off servers of one TP size returned."""

    tp: int
    verdicts: list[Verdict] = field(default_factory=list)
    gen: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # on/off: 2 runs
    tput: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory: dict[str, dict[int, int] | str] = field(default_factory=dict)  # by CUDA device id
    devices: list[int] = field(default_factory=list)  # the ranks' CUDA device ids
    dump_bytes_per_token: int = 0
    start_s: dict[str, float] = field(default_factory=dict)  # server start-up times
    capture_buffer: dict[str, Any] | None = None


# SGLang 0.5.23 keeps no count of fused calls; its log says whether the fusion was switched on
# (arg_groups/overrides.py), whether each rank's workspace was made (flashinfer_comm_fusion.py;
# with it, layers/layer_boundary/residual/add_norm.py fuses every batch of at most 2,048
# tokens), and why it was turned off.
_FUSION_ON = re.compile(r"Auto-enabling FlashInfer AllReduce Fusion \((\w+)\)")
_FUSION_READY = re.compile(r"FlashInfer AllReduce Fusion enabled and workspace initialized: "
                           r"backend=(\S+), rank=(\d+), world_size=\d+, max_token_num=(\d+)")
_FUSION_OFF = ("Disabling flashinfer allreduce fusion permanently",
               "FlashInfer AllReduce fusion disabled", "Skipping allreduce fusion",
               "unified allreduce_fusion API is not available",
               "FlashInfer comm not available", "allreduce fusion is forcibly disabled")


def fused_allreduce(log: str, device: str, tp: int,
                    capability: tuple[int, int] | None = None) -> dict[str, Any]:
    """Whether flashinfer's fused all-reduce + residual + RMSNorm ran on a server, from what
    SGLang logs: ``ran`` is True, False or None (not applicable), ``why`` says how it is known.
    SGLang 0.5.23 enables it only on sm90 / sm100 (``arg_groups/overrides.py``)."""
    if device != "cuda":
        return {"ran": None, "why": "not applicable: no GPU"}
    if tp < 2:
        return {"ran": None, "why": "not applicable: TP 1 has no all-reduce"}
    if capability is not None and capability[0] not in (9, 10):
        return {"ran": None, "why": "not applicable: SGLang enables it only on sm90 / sm100, "
                                    f"this GPU is sm{capability[0]}{capability[1]}"}
    off = [m for m in _FUSION_OFF if m in log]
    ready = {int(r): (b, int(n)) for b, r, n in _FUSION_READY.findall(log)}
    on = _FUSION_ON.search(log)
    if off:
        return {"ran": False, "why": f"turned off: SGLang logged {off[0]!r}"}
    if len(ready) == tp:
        backend, tokens = ready[0] if 0 in ready else next(iter(ready.values()))
        return {"ran": True, "backend": backend, "max_tokens": tokens,
                "why": f"workspace made on all {tp} ranks (backend {backend}): batches of at "
                       f"most {tokens} tokens took the fused path"}
    if on is None:
        return {"ran": False, "why": "not switched on for this GPU / configuration (no "
                                     "'Auto-enabling FlashInfer AllReduce Fusion' line)"}
    return {"ran": False, "why": f"switched on ({on.group(1)}) but the workspace was made on "
                                 f"{len(ready)} of {tp} ranks"}


def capture_buffer(log: str) -> dict[str, Any] | None:
    """The writer's device buffers as the capture logs them (the last, largest ones): one
    buffer's shape and size, how many are used in turn, their total, and the writer's device
    (``cuda:N``)."""
    found = re.findall(r"hsdump: capture buffer of (\d+) tokens x (\d+) states x (\d+) "
                       r"\((\d+) MiB\) on (\S+), (\d+) used in turn: (\d+) MiB", log)
    if not found:
        return None
    sizes, device = (*found[-1][:4], *found[-1][5:]), found[-1][4]
    out: dict[str, Any] = dict(zip(("tokens", "states", "hidden", "mib", "count", "total_mib"),
                                   map(int, sizes), strict=True))
    return {**out, "device": device}


def writer_device(buf: dict[str, Any] | None, devices: list[int]) -> int:
    """The writer's CUDA device id: from the capture's log (``cuda:N``), else the first rank's."""
    m = re.fullmatch(r"cuda:(\d+)", str((buf or {}).get("device", "")))
    return int(m.group(1)) if m else devices[0]


def run_tp(settings: Settings, model: Path, tp: int, dumps: dict[str, Dumped]) -> TpRun:
    """Start the dump-on server, then the dump-off one, of one TP size, one at a time."""
    res = TpRun(tp)
    for dump in (True, False):
        name = f"tp{tp}-{'on' if dump else 'off'}"
        say(settings, f"starting the {name} server")
        server = VerifyServer.start(name, model, tp, settings.work, settings.dump_root, dump=dump,
                                    device=settings.device, extra=settings.sglang_extra,
                                    env={}, timeout=settings.server_timeout)
        res.start_s[name] = round(server.started_s, 1)
        try:
            say(settings, f"{name}: ready in {server.started_s:.0f} s; checking")
            key = "on" if dump else "off"
            sinfo = server.server_info()
            base, step = int(sinfo.get("base_gpu_id") or 0), int(sinfo.get("gpu_id_step") or 1)
            res.devices = [base + r * step for r in range(tp)]
            if dump:
                chunk = int(sinfo.get("chunked_prefill_size") or 0)
                chunk = chunk if chunk > 0 else 4 * settings.fusion_tokens
                aux = check_aux(server, settings.fusion_tokens, chunk, dumps)
                fused = fused_allreduce(server.log(), settings.device, tp, settings.capability)
                aux.data["fused_allreduce_rmsnorm"] = fused
                aux.detail += f"; fused all-reduce + RMSNorm: {fused['why']}"
                res.verdicts.append(aux)
                info = protocol.read_server_info(server.dump_dir)
                slots = len(info.layers) + int(info.has_final)
                res.dump_bytes_per_token = slots * info.hidden_size * torch.tensor(
                    [], dtype=getattr(torch, info.dtype)).element_size()
            res.gen[key] = [generate_outputs(server, settings, r) for r in (0, 1)]
            res.tput[key] = measure_prefill(server, settings)
            if dump:
                say(settings, f"{name}: timing the dump's cost (ABBA, with and without the "
                    "dump prefix)")
                try:
                    res.verdicts.append(check_cost(server, settings, chunk))
                except Exception as e:  # (f)'s cost only: the other checks go on
                    res.verdicts.append(Verdict("f", f"tp {tp} cost (ABBA)", FAIL,
                                                f"{type(e).__name__}: {e}"[:2000]))
                res.verdicts.append(check_ranks(server))
                res.verdicts.append(check_staging(writer_status(server.dump_dir), tp))
                res.capture_buffer = capture_buffer(server.log())
            elif "hsdump: capturing" in server.log():
                res.verdicts.append(Verdict("d", f"tp {tp}", FAIL,
                                            "the dump-off server installed the capture"))
        finally:
            server.stop()
            if server.dump_dir is not None:  # everything in it was read
                shutil.rmtree(server.dump_dir, ignore_errors=True)
        if server.memory is not None:
            res.memory[key] = server.memory.error or server.memory.peaks_by_device(
                settings.device_uuids)
    return res


# ---------------------------------------------------------------------------- checks on runs


def check_outputs(res: TpRun) -> Verdict:
    """Check (c): each server repeats itself, then on == off."""
    on, off = res.gen["on"], res.gen["off"]
    if off[0] != off[1]:
        return Verdict("c", f"tp {res.tp}", FAIL, "the dump-off server does not repeat itself "
                       "(nondeterministic kernels): on/off cannot be compared")
    if on[0] != on[1]:
        return Verdict("c", f"tp {res.tp}", FAIL, "the dump-on server does not repeat itself "
                       "while the dump-off one does")
    differ = [k for k in off[0] if on[0][k] != off[0][k]]
    if differ:
        return Verdict("c", f"tp {res.tp}", FAIL, f"outputs differ with the dump on: {differ}")
    n = sum(len(v["output_ids"]) for v in off[0].values())
    return Verdict("c", f"tp {res.tp}", PASS,
                   f"each server repeats itself; {len(off[0])} prompts, {n} generated tokens and "
                   "every input/output/top-5 logprob identical with the dump on and off")


def check_overhead(res: TpRun, settings: Settings) -> Verdict:
    """Check (f): prefill throughput on vs off, writer-rank memory, writer CPU."""
    on, off = res.tput["on"], res.tput["off"]
    ratio = on["prefill_tokens_per_s"] / off["prefill_tokens_per_s"]
    gb = on["tokens"] * res.dump_bytes_per_token / 1e9
    writer_cpu = on["rank_cpu_s"].get(0, 0.0) - off["rank_cpu_s"].get(0, 0.0)
    data: dict[str, Any] = {"prefill_ratio": round(ratio, 3), "on": on, "off": off,
                            "dumped_gb": round(gb, 4),
                            "writer_extra_cpu_s": round(writer_cpu, 3),
                            "writer_extra_cpu_s_per_gb": round(writer_cpu / gb, 2) if gb else None}
    problems = []
    if on["undumped_requests"]:
        problems.append(f"{len(on['undumped_requests'])} requests of the timed rounds got no "
                        f"done marker, e.g. {on['undumped_requests'][0]}")
    if ratio < settings.min_prefill_ratio:
        problems.append(f"prefill with the dump on is {ratio:.0%} of off "
                        f"(< {settings.min_prefill_ratio:.0%})")
    mem = "peak device memory n/a (CPU)"
    if settings.device == "cuda":
        peaks_on, peaks_off = res.memory.get("on"), res.memory.get("off")
        if not isinstance(peaks_on, dict) or not isinstance(peaks_off, dict) or not peaks_on:
            mem = f"peak device memory not measured ({peaks_on or peaks_off})"
        else:
            devices = res.devices or list(range(res.tp))
            wdev = writer_device(res.capture_buffer, devices)
            others = [d for d in devices if d != wdev]

            def excess(peaks: dict[int, int]) -> int:  # the writer's GPU over the others
                rest = [peaks[d] for d in others if d in peaks]
                return peaks.get(wdev, 0) - max(rest) if rest else peaks.get(wdev, 0)

            extra = excess(peaks_on) - excess(peaks_off)
            data.update(peak_mib_on=peaks_on, peak_mib_off=peaks_off, writer_extra_mib=extra,
                        writer_device=wdev)
            rest_on = [peaks_on[d] for d in others if d in peaks_on]
            mem = (f"writer GPU (cuda:{wdev}) peak {peaks_on.get(wdev, 0)} MiB vs "
                   f"{max(rest_on, default=peaks_off.get(wdev, 0))} MiB "
                   f"on {'the other ranks' if others else 'the dump-off server'}: "
                   f"{extra:+d} MiB for the dump")
            if extra > settings.max_writer_extra_mib:
                problems.append(f"the writer rank uses {extra} MiB more device memory than the "
                                f"others (> {settings.max_writer_extra_mib:.0f})")
    buf = res.capture_buffer
    if buf:
        # the same buffer at Kimi-K2.5 / DeepSeek-V3's hidden size, bf16
        kimi_gib = buf["count"] * buf["tokens"] * buf["states"] * KIMI_HIDDEN * 2 / (1 << 30)
        data.update(capture_buffer=buf, capture_buffer_gib_at_hidden_7168=round(kimi_gib, 2))
        mem += (f"; writer's capture buffers {buf['count']} x {buf['tokens']} tokens, "
                f"{buf['total_mib']} MiB ({kimi_gib:.2f} GiB at hidden {KIMI_HIDDEN})")
    detail = (f"prefill {on['prefill_tokens_per_s']:,.0f} tok/s on vs "
              f"{off['prefill_tokens_per_s']:,.0f} off ({ratio:.0%}); {mem}; writer rank CPU "
              f"{writer_cpu:+.2f} s for {gb:.3f} GB dumped")
    return Verdict("f", f"tp {res.tp}", FAIL if problems else PASS,
                   "; ".join([*problems, detail]) if problems else detail, data)


def check_reference(settings: Settings, model: Path, dumps: dict[str, Dumped]) -> Verdict:
    """Check (b): every dumped prompt of check (a) against HF transformers in float32."""
    device = "cuda" if settings.device == "cuda" else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    hf = verify_checks.load_hf_model(model, torch.float32, device)
    n_layers = hf.config.num_hidden_layers
    worst: verify_checks.Closeness | None = None
    failures, checked = [], 0
    by_slot: dict[str, dict[str, float]] = {}
    for rid, d in dumps.items():
        ref = verify_checks.hf_hidden_states(hf, d.ids, chunk=512)
        slots = [*d.layers, n_layers][: d.hidden.shape[1]]
        for s, layer in enumerate(slots):
            c = verify_checks.closeness(d.hidden[:, s], ref[layer])
            name = "final state" if layer == n_layers else f"layer {layer}"
            checked += 1
            if worst is None or c.max_rel > worst.max_rel:
                worst = c
            if name not in by_slot or c.max_rel > by_slot[name]["max_rel"]:
                by_slot[name] = c.to_json()
            if not c.within():
                failures.append(f"{rid} {name}: {c.describe()}")
    del hf
    bound = (f"bound: max error <= {verify_checks.BF16_MAX_REL:.0%} of max |ref|, mean <= "
             f"{verify_checks.BF16_MEAN_REL:.0%} of mean |ref|")
    if not checked:
        return Verdict("b", "all", FAIL, "nothing was dumped to compare")
    assert worst is not None
    data = {"compared": checked, "worst": worst.to_json(), "worst_by_slot": by_slot,
            "max_rel_bound":
            verify_checks.BF16_MAX_REL, "mean_rel_bound": verify_checks.BF16_MEAN_REL}
    if failures:
        return Verdict("b", "all", FAIL, f"{len(failures)} of {checked} out of bound ({bound}); "
                       + "; ".join(failures[:3]), data)
    return Verdict("b", "all", PASS, f"{len(dumps)} prompts x {checked // len(dumps)} slots; "
                   f"worst {worst.describe()} ({bound})", data)


def check_refusals(settings: Settings, model: Path) -> list[Verdict]:
    """Check (e): each refused configuration, through the guard on SGLang's resolved config,
    plus real launches (the patch active in this environment refuses at start-up)."""
    from sglang.srt.server_args import ServerArgs

    from hsdump_patch.capture import guards
    from hsdump_patch.ops.launch import free_port
    from hsdump_patch.ops.verify_server import plan_launch

    plan = plan_launch(model, 1, free_port(), settings.work / "dump-refused",
                       device=settings.device, extra=settings.production_extra)
    base = plan.argv[plan.argv.index("sglang.launch_server") + 1:]
    env_dir = os.environ.pop(ENV_DIR, None)  # resolve in-process without the plugin's hooks
    rows, verdicts = [], []
    try:
        for name, flags, needle in [("production profile (must be accepted)", [], None),
                                    *REFUSED]:
            argv = ([a for a in base if a != "--disable-radix-cache"] if flags is None
                    else [*base, *flags])
            try:
                sa = ServerArgs.from_cli_args(serve.sglang_parser().parse_args(argv))
                sa.resolve_once()
            except Exception as e:  # SGLang itself rejects the combination
                problems = [f"SGLang rejected it: {type(e).__name__}: {e}"]
            else:
                problems = guards.problems_for_server_args(sa)
            ok = (not problems) if needle is None else any(needle in p for p in problems)
            rows.append({"case": name, "flags": flags, "refused": bool(problems), "ok": ok,
                         "message": problems[:1]})
    finally:
        if env_dir is not None:
            os.environ[ENV_DIR] = env_dir
    bad = [r["case"] for r in rows if not r["ok"]]
    verdicts.append(Verdict(
        "e", "resolved config", FAIL if bad else PASS,
        f"wrong for: {bad}" if bad else f"the production profile is accepted; all "
        f"{len(REFUSED)} refused cases are refused, naming the flag", {"cases": rows}))
    real = REFUSED[:2] if settings.device == "cuda" else REFUSED[:1]
    for name, flags, needle in real:
        say(settings, f"launching a server that must refuse: {name}")
        rc, log = run_refused(model, settings.work, name.split()[0], flags,
                              device=settings.device, extra=settings.production_extra, env={},
                              timeout=settings.server_timeout)
        ok = rc not in (None, 0) and "hsdump" in log and needle in log
        verdicts.append(Verdict(
            "e", f"launch: {name}", PASS if ok else FAIL,
            f"exited {rc} naming {needle}" if ok else
            f"exit {rc}; expected a refusal naming {needle}; log tail: {log[-300:]!r}",
            {"exit_code": rc}))
    return verdicts


# ---------------------------------------------------------------------------- the run


def default_tps() -> list[int]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [n] if n else [1, 2]


def run(settings: Settings) -> tuple[list[Verdict], dict[str, Any]]:
    """Every check; returns the verdicts and facts about the run."""
    settings.work.mkdir(parents=True, exist_ok=True)
    model = settings.work / "model"
    shape = "kimi-gpu" if settings.device == "cuda" else "kimi-cpu"
    say(settings, f"writing a random Kimi-K2.5-shaped model ({shape}) to {model}")
    shutil.rmtree(model, ignore_errors=True)
    verify_model.make_kimi_k25(model, shape)
    verdicts: list[Verdict] = []
    dumps: dict[str, Dumped] = {}
    facts: dict[str, Any] = {"device": settings.device, "tp": settings.tps,
                             "fusion_threshold_tokens": settings.fusion_tokens,
                             "model": {"shape": shape,
                                       "architecture": "KimiK25ForConditionalGeneration",
                                       **verify_model.KIMI_SHAPES[shape]},
                             "server_start_s": {}}
    for tp in settings.tps:
        try:
            res = run_tp(settings, model, tp, dumps)
        except Exception as e:  # a server that does not start fails every check of its size
            verdicts += [Verdict(c, f"tp {tp}", FAIL, f"{type(e).__name__}: {e}"[:2000])
                         for c in "acdf"]
            continue
        verdicts += res.verdicts
        facts["server_start_s"].update(res.start_s)
        verdicts += [check_outputs(res), check_overhead(res, settings)]
    say(settings, "checking the refused configurations")
    verdicts += _guarded("e", lambda: check_refusals(settings, model))
    say(settings, f"computing the fp32 reference for {len(dumps)} dumped prompts")
    verdicts += _guarded("b", lambda: [check_reference(settings, model, dumps)])
    order = list(CHECKS)
    verdicts.sort(key=lambda v: order.index(v.check))
    return verdicts, facts


def _guarded(check: str, fn: Callable[[], list[Verdict]]) -> list[Verdict]:
    try:
        return fn()
    except Exception as e:
        return [Verdict(check, "all", FAIL, f"{type(e).__name__}: {e}"[:2000])]


def report_json(verdicts: list[Verdict], facts: dict[str, Any], wall: float) -> dict[str, Any]:
    return {"passed": all(v.verdict != FAIL for v in verdicts), "wall_s": round(wall, 1),
            **facts, "checks": [{"name": CHECKS[v.check], **asdict(v)} for v in verdicts]}


def print_table(verdicts: list[Verdict]) -> None:
    rows = [(f"{v.check}. {CHECKS[v.check]} [{v.scope}]", f"{v.verdict}  {v.detail}")
            for v in verdicts]
    print(format_table(rows))


def main(args: argparse.Namespace) -> int:
    """Entry point of ``hsdump verify``."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
    work = Path(args.work or tempfile.mkdtemp(prefix="hsdump-verify-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm")
    dump_root = Path(tempfile.mkdtemp(
        prefix="hsdump-verify-", dir=args.dump_root or (shm if os.access(shm, os.W_OK) else work)))
    settings = Settings(
        device=device,
        tps=[int(x) for x in args.tp.split(",")] if args.tp else default_tps(),
        work=work,
        dump_root=dump_root,
        fusion_tokens=GPU_FUSION_TOKENS if device == "cuda" else CPU_FUSION_TOKENS,
        min_prefill_ratio=args.min_prefill_ratio if args.min_prefill_ratio is not None
        else (0.9 if device == "cuda" else 0.1),
        max_writer_extra_mib=args.max_writer_extra_mib,
        server_timeout=args.server_timeout,
        max_cost_ratio=args.max_cost_ratio if args.max_cost_ratio is not None
        else (verify_cost.GPU_MAX_RATIO if device == "cuda" else verify_cost.CPU_MAX_RATIO),
        cost_blocks=verify_cost.GPU_BLOCKS if device == "cuda" else verify_cost.CPU_BLOCKS,
        capability=blackwell.detect_compute_capability() if device == "cuda" else None,
        device_uuids=cuda_device_uuids() if device == "cuda" else {},
        # On CPU (f) is a plumbing check with a 0.1 floor: one timed round, not three.
        throughput_rounds=Settings.throughput_rounds if device == "cuda" else 1,
        progress=not args.no_progress,
        extra_args=list(args.sglang_args[1:] if args.sglang_args[:1] == ["--"]
                        else args.sglang_args),
    )
    t0 = time.monotonic()
    try:
        verdicts, facts = run(settings)
    finally:
        shutil.rmtree(dump_root, ignore_errors=True)
    report = report_json(verdicts, facts, time.monotonic() - t0)
    path = Path(args.report) if args.report else work / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    protocol.write_json_atomic(path, report)
    print(f"hsdump verify: {device}, tp {','.join(map(str, settings.tps))}, "
          f"{report['wall_s']:.0f} s")
    print_table(verdicts)
    print(f"hsdump verify: {'PASS' if report['passed'] else 'FAIL'}; report: {path}; "
          f"server logs: {work}")
    return 0 if report["passed"] else 1


def add_parser(subparsers: Any) -> None:
    """Register ``hsdump verify``."""
    p = subparsers.add_parser(
        "verify", help="acceptance run for this host: serve a random model of the production "
        "architecture and check the dump against SGLang's own capture and an fp32 reference",
        description="Serve a random model of the production architecture with the hsdump "
        "serve profile (dump on and off, at each TP size) and check: (a) the dump equals "
        "SGLang's own EAGLE-3 capture bit for bit, (b) an fp32 reference within a bound, (c) "
        "outputs are identical with the dump on and off, (d) every rank installed the capture "
        "and one writes, (e) refused configurations are refused, (f) the dump's cost on "
        "this server (same prompts with and without the dump prefix, ABBA) and overhead. "
        "Prints a verdict table, writes a JSON report; exit 1 on any FAIL.",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when a GPU is visible, else the CPU variant (default: auto)")
    p.add_argument("--tp", default=None,
                   help="comma-separated tensor-parallel sizes, each served dump on and off "
                        "(default: the number of visible GPUs; 1,2 on CPU)")
    p.add_argument("--work", default=None,
                   help="directory for the model, dump dirs and server logs (default: a new "
                        "temporary directory)")
    p.add_argument("--dump-root", default=None,
                   help="where the servers' dump dirs are made, removed after the run (default: "
                        "/dev/shm, as in production; WORK without it)")
    p.add_argument("--report", default=None,
                   help="JSON report path (default: WORK/report.json)")
    p.add_argument("--min-prefill-ratio", type=float, default=None,
                   help="fail (f) when prefill tokens/s with the dump on is below this fraction "
                        "of off (default: 0.9 on GPU; 0.1 on CPU, where the writer shares the "
                        "cores with the forward and timings are noisy)")
    p.add_argument("--max-cost-ratio", type=float, default=None,
                   help="fail (f) when the lower 95%% bound of prefill time with the dump prefix "
                        "over without it (ABBA on the dump-on server) is above this (default: "
                        f"{verify_cost.GPU_MAX_RATIO} on GPU; {verify_cost.CPU_MAX_RATIO} on "
                        "CPU, a plumbing check)")
    p.add_argument("--max-writer-extra-mib", type=float, default=1024,
                   help="fail (f) when the writer rank's peak device memory exceeds the other "
                        "ranks' by more than this, beyond the dump-off difference (default: 1024)")
    p.add_argument("--server-timeout", type=float, default=900,
                   help="seconds a server may take to become ready (default: 900)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress lines on stderr (default: progress on)")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER,
                   help="after '--': further SGLang arguments for every server, as given to "
                        "hsdump serve in production (default: none)")
    p.set_defaults(func=main)
