"""Check (f)'s cost of the dump, measured where it happens: on the running dump-on server.

The capture dumps only rids that start with the dump prefix, so the same prompts are sent
alternately with and without it, one request at a time (one request per forward), in ABBA
blocks (on, off, off, on: a linear drift cancels within a block). Each request asks for one
new token, so its time is its prefill: SGLang 0.5.23 returns no per-request prefill or forward
time in ``meta_info`` (those are in its metrics only), so the time is its own per-request
``e2e_latency`` (received by the tokenizer manager to finished, server side), which for a
one-token request is the prefill forwards of its chunks and their scheduling. The prompts are
two production chunks long, so each forward is a full chunk. A block's ratio is its dumped
time over its undumped one; the verdict fails only when the 95% lower confidence bound of the
mean ratio is above the floor (a noisy host widens the interval, it does not fail). The
writer's file writing after the forward is not timed (the done marker is awaited between
requests); its CPU is reported by the rank-CPU part of (f).
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from hsdump_patch import protocol
from hsdump_patch.client.dumps.dumpdir import wait_for_marker

GPU_MAX_RATIO = 1.05  # fail when the dump makes prefill surely (95%) more than 5% slower
CPU_MAX_RATIO = 3.0  # the CPU variant: plumbing (the writer shares the cores), numbers printed
GPU_BLOCKS, CPU_BLOCKS = 10, 4
ORDER = (True, False, False, True)  # one ABBA block: dumped, undumped, undumped, dumped

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (past 30: the
    Cornish-Fisher expansion around 1.96, within 0.001)."""
    if df < 1:
        raise ValueError("t needs at least one degree of freedom")
    return _T975[df - 1] if df <= len(_T975) else 1.95996 + 2.3722 / df


@dataclass(frozen=True)
class CostStats:
    """Per-block ratios (dumped time / undumped time) and the mean's 95% t interval."""

    ratios: list[float]
    n: int
    mean: float
    sd: float
    low: float  # 95% confidence bounds of the mean ratio
    high: float

    def to_json(self) -> dict[str, Any]:
        return {k: ([round(x, 4) for x in v] if isinstance(v, list) else
                    round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def abba_stats(on: list[float], off: list[float]) -> CostStats:
    """Statistics of ABBA blocks: ``on[i]`` and ``off[i]`` are block i's summed dumped and
    undumped times (two requests each); at least two blocks."""
    if len(on) != len(off) or len(on) < 2:
        raise ValueError(f"need two or more blocks of on and off times, got {len(on)}, "
                         f"{len(off)}")
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    n, mean, sd = len(ratios), statistics.fmean(ratios), statistics.stdev(ratios)
    half = t975(n - 1) * sd / math.sqrt(n)
    return CostStats(ratios, n, mean, sd, mean - half, mean + half)


def cost_verdict(stats: CostStats, floor: float) -> tuple[bool, str]:
    """(passed, detail): it fails only when the interval's lower bound is above ``floor``."""
    failed = stats.low > floor
    detail = (f"prefill dumped / undumped {stats.mean:.3f} (95% CI {stats.low:.3f}-"
              f"{stats.high:.3f}, sd {stats.sd:.3f}, n {stats.n} ABBA blocks); "
              + (f"the lower bound is above the floor {floor}" if failed else
                 f"floor {floor}: fails only when the lower bound is above it"))
    return not failed, detail


class _Server(Protocol):
    dump_dir: Any

    def post(self, path: str, body: dict[str, Any], timeout: float = 600) -> Any: ...


def _one(server: _Server, ids: list[int], rid: str) -> tuple[float, float]:
    """Send one request for one new token: (SGLang's e2e_latency, the client's wall)."""
    t0 = time.perf_counter()
    out = server.post("/generate", {"input_ids": ids, "rid": rid, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}})
    wall = time.perf_counter() - t0
    return float(out["meta_info"].get("e2e_latency") or wall), wall


def measure(server: _Server, prompts: list[list[int]], rid_prefix: str, tag: str,
            marker_timeout: float = 300) -> dict[str, Any]:
    """One warm-up pair, then an ABBA block per prompt, the dumped rids ``rid_prefix`` +
    ``tag``..., the undumped ones without the prefix; every dumped request must leave a done
    marker (then its files are removed) and no undumped one a directory."""
    assert server.dump_dir is not None
    problems: list[str] = []

    def send(ids: list[int], dumped: bool, name: str) -> tuple[float, float]:
        rid = f"{rid_prefix}{tag}-{name}-on" if dumped else f"{tag}-{name}-off"
        assert rid.startswith(rid_prefix) == dumped, (rid, rid_prefix)
        timed = _one(server, ids, rid)
        path = protocol.rid_dir(server.dump_dir, rid)
        if dumped:
            status = wait_for_marker(server.dump_dir, rid, marker_timeout)
            if status is None or status.error is not None:
                problems.append(f"{rid}: no done marker" if status is None
                                else f"{rid}: error marker: {status.error}")
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            problems.append(f"{rid}: dumped without the prefix {rid_prefix!r}")
        return timed

    send(prompts[0], True, "warmup")
    send(prompts[0], False, "warmup")
    on, off, rows = [], [], []
    for i, ids in enumerate(prompts):
        times = [send(ids, dumped, f"b{i}r{j}") for j, dumped in enumerate(ORDER)]
        on.append(sum(t[0] for t, d in zip(times, ORDER, strict=True) if d))
        off.append(sum(t[0] for t, d in zip(times, ORDER, strict=True) if not d))
        rows.append({"tokens": len(ids), "e2e_s": [round(t[0], 5) for t in times],
                     "client_s": [round(t[1], 5) for t in times]})
    return {"on_s": on, "off_s": off, "blocks": rows, "problems": problems,
            "timing": "meta_info.e2e_latency of max_new_tokens=1 requests, one at a time"}
