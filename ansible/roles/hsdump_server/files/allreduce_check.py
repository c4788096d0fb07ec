"""All-reduce check run by hsdump_server before the server starts: every rank sums a buffer; the result must be exact.

Run with ``python3 -m torch.distributed.run --standalone --nproc-per-node N allreduce_check.py --backend nccl --mib 64``.
Prints one JSON line from rank 0 (size, time, bus bandwidth); exits non-zero on a wrong sum.
A hang here (killed by the timeout) is the PCIe P2P/IOMMU problem of docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="nccl", help="nccl (GPUs) or gloo (CPU); default nccl")
    parser.add_argument("--mib", type=int, default=64, help="buffer size in MiB (default 64)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    n = args.mib * 2**20 // 4
    buf = torch.full((n,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up, and the correctness check
    expected = world * (world + 1) / 2
    ok = bool(torch.all(buf == expected).item())
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    # nccl-tests' bus bandwidth for all-reduce: bytes * 2 (n-1) / n per second.
    busbw = n * 4 * 2 * (world - 1) / world / seconds / 1e9
    if rank == 0:
        print(json.dumps({"ok": ok, "world": world, "backend": args.backend, "mib": args.mib,
                          "seconds": round(seconds, 6), "busbw_gbps": round(busbw, 2)}))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
