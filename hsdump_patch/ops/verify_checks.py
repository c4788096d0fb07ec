"""How dumped hidden states are compared with their references (used by ``hsdump verify`` and
the capture tests): bit for bit against SGLang's own EAGLE-3 capture, and within a stated
bound against an independent HF transformers forward."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# bf16 dump vs a reference: SGLang's kernels and HF's accumulate in different orders and
# round to bf16 at every layer, so elements differ by a few bf16 ulps (2**-7 relative), growing
# through the layers (the worst seen: DeepSeek's post-norm state, max 0.083 where values reach
# ~4, mean ~1 ulp). Bounds are relative to the reference's scale: a wrong layer, shifted rows or
# mixed-up requests are off by ~100% on average, far above them.
BF16_MAX_REL, BF16_MEAN_REL = 0.05, 0.02


@dataclass(frozen=True)
class Closeness:
    """Error of ``actual`` against ``expected``, relative to the reference's scale."""

    max_abs: float
    max_rel: float  # max |error| / max |reference|
    mean_rel: float  # mean |error| / mean |reference|

    def within(self, max_rel: float = BF16_MAX_REL, mean_rel: float = BF16_MEAN_REL) -> bool:
        return self.max_rel <= max_rel and self.mean_rel <= mean_rel

    def describe(self) -> str:
        return (f"max abs error {self.max_abs:.4g} ({self.max_rel:.2%} of max |ref|), "
                f"mean {self.mean_rel:.2%} of mean |ref|")

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items()}


def closeness(actual: torch.Tensor, expected: torch.Tensor) -> Closeness:
    """Compare two same-shaped tensors (any float dtypes) in float32."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    ref = expected.float()
    err = (actual.float() - ref).abs()
    return Closeness(float(err.max()), float(err.max() / ref.abs().max()),
                     float(err.mean() / ref.abs().mean()))


def bitwise_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when both hold exactly the same values (compared in float32, which represents
    every bf16 / fp16 value exactly), else what differs."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"
    a, e = actual.float(), expected.float()
    if torch.equal(a, e):
        return None
    diff = a != e
    return (f"{int(diff.sum())} of {diff.numel()} values differ (first at row "
            f"{int(diff.nonzero()[0][0])}, max abs difference {float((a - e).abs().max()):.4g})")


def load_hf_model(model: Path, dtype: torch.dtype, device: str) -> Any:
    """HF transformers' own implementation of ``model`` (a Kimi-K2.5 checkpoint: its
    language model), in eval mode."""
    from hsdump_patch.ops.verify_model import load_text_model

    return load_text_model(model, dtype).to(device).eval()


def hf_hidden_states(hf_model: Any, input_ids: list[int], chunk: int = 0) -> list[torch.Tensor]:
    """HF ``output_hidden_states`` for one prompt, on the CPU: element i is ``[L, H]``; i <
    n_layers is the input of layer i, the last one the post-final-norm state. With ``chunk``,
    the prompt is fed ``chunk`` tokens at a time through HF's KV cache (the same values, with
    attention memory bounded for long prompts)."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    step = chunk or len(input_ids)
    parts: list[list[torch.Tensor]] = []
    past = None
    with torch.no_grad():
        for start in range(0, len(input_ids), step):
            out = hf_model(ids[:, start:start + step], past_key_values=past, use_cache=chunk > 0,
                           output_hidden_states=True)
            past = out.past_key_values
            parts.append([h[0].cpu() for h in out.hidden_states])
    return [torch.cat(layer) for layer in zip(*parts, strict=True)]
