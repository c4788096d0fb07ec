"""Negative controls: hsdump's records with one data error put in on purpose. A judge that
cannot see these cannot see a real one. Each writes a copy of the records (same layout,
manifests and sidecar, so ``hsdump specforge`` and SpecForge read it as they read the original).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

Record = dict[str, torch.Tensor]


def shifted(record: Record, embed: torch.Tensor) -> Record:
    """The states one position late against the tokens: position t holds the states of t - 1
    (the first position keeps its own)."""
    out = dict(record)
    for key in ("hidden_state", "aux_hidden_state"):
        x = record[key]
        out[key] = torch.cat([x[:, :1], x[:, :-1]], dim=1)
    return out


def layer0(record: Record, embed: torch.Tensor) -> Record:
    """Every aux layer replaced by layer 0 (the input of decoder layer 0: the token
    embeddings), the final state kept."""
    e = embed[record["input_ids"]].unsqueeze(0).to(record["aux_hidden_state"].dtype)
    n = record["aux_hidden_state"].shape[-1] // e.shape[-1]
    return {**record, "aux_hidden_state": torch.cat([e] * n, dim=-1)}


CONTROLS: dict[str, Callable[[Record, torch.Tensor], Record]] = {
    "shifted": shifted, "layer0": layer0}


def embeddings(target: Path) -> torch.Tensor:
    """The target's input embedding matrix."""
    with safe_open(target / "model.safetensors", "pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def write(name: str, src: Path, dst: Path, target: Path) -> Path:
    """Copy the extract output ``src`` to ``dst`` with control ``name`` applied to every
    record."""
    change, embed = CONTROLS[name], embeddings(target)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.ckpt", "*.ckpt.gz", ".lock*",
                                                            "specforge-*"))
    for path in src.rglob("*.ckpt"):
        record = torch.load(path, weights_only=True)
        torch.save(change(record, embed), dst / path.relative_to(src))
    return dst
