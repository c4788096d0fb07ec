"""Test-only: read one request's dump straight from the files (independent of the client)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hsdump_patch import protocol


@dataclass
class Dump:
    hidden: torch.Tensor  # [L, S, H]
    input_ids: list[int]
    positions: list[int]
    prefix_lens: list[int]
    metas: list[dict[str, str]]
    done: dict


def wait_finished(dump_dir: Path, rid: str, timeout: float = 60) -> protocol.RequestStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = protocol.request_status(dump_dir, rid)
        if status.finished or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def read_dump(dump_dir: Path, rid: str) -> Dump:
    """Wait for the done marker, then load and concatenate every chunk of ``rid``."""
    status = wait_finished(dump_dir, rid)
    assert status.error is None, f"{rid}: error marker: {status.error}"
    assert status.done is not None, f"{rid}: no done marker"
    parts, metas, sizes = [], [], []
    for prefix_len, path in protocol.list_chunks(dump_dir, rid):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            parts.append({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        assert int(meta["prefix_len"]) == prefix_len
        metas.append(meta)
        sizes.append((prefix_len, parts[-1][protocol.HIDDEN_KEY].shape[0]))
    protocol.check_coverage(sizes, status.done.prompt_len)
    return Dump(
        hidden=torch.cat([p[protocol.HIDDEN_KEY] for p in parts]),
        input_ids=torch.cat([p[protocol.INPUT_IDS_KEY] for p in parts]).tolist(),
        positions=torch.cat([p[protocol.POSITIONS_KEY] for p in parts]).tolist(),
        prefix_lens=[s[0] for s in sizes],
        metas=metas,
        done=status.done,
    )


def server_layers(dump_dir: Path) -> list[int]:
    return json.loads((dump_dir / protocol.SERVER_INFO).read_text())["layers"]
