"""Test-only: independent references for dumped hidden states (HF transformers)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=4)
def _hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def hf_hidden_states(model: Path, input_ids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """HF ``output_hidden_states`` for one prompt: element i is ``[L, H]``; i < n_layers is the
    input of layer i, the last one is the post-final-norm state."""
    m = _hf_model(str(model), dtype)
    with torch.no_grad():
        out = m(torch.tensor([input_ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]
