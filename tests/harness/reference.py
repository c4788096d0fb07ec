"""Test-only: independent references for dumped hidden states (HF transformers, through the
same helpers ``hsdump verify`` uses)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hsdump_patch.ops import verify_checks


@functools.lru_cache(maxsize=4)
def _hf_model(path: str, dtype: torch.dtype):
    return verify_checks.load_hf_model(Path(path), dtype, "cpu")


def hf_hidden_states(model: Path, input_ids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """HF ``output_hidden_states`` for one prompt: element i is ``[L, H]``; i < n_layers is the
    input of layer i, the last one is the post-final-norm state."""
    return verify_checks.hf_hidden_states(_hf_model(str(model), dtype), input_ids)
