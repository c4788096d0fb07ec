"""A small random-weight model of the production architecture, generated offline.

``hsdump verify`` serves it instead of the real weights: a DeepSeek-V3 checkpoint (the decoder
of Kimi-K2.5 too: MLA attention, routed + shared experts, first layer dense, sigmoid
``noaux_tc`` routing, YaRN RoPE) with a byte-level BPE tokenizer trained here on a few
sentences. Nothing is downloaded. Two shapes:

* ``cpu``: hidden 64, for the CPU variant (seconds to build and serve);
* ``gpu``: DeepSeek-V3's own attention geometry (128 heads, ``kv_lora_rank`` 512,
  ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` / ``v_head_dim`` 128), so the GPU attention,
  MoE and fused all-reduce kernels take the code paths they take for the real model, with a
  narrow residual stream (256) and 16 experts, so a run takes minutes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 1024
# A chat template with explicit turn markers, like real ones.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer for testing SGLang on CPU.",
    "EAGLE speculative decoding drafts tokens with a small model.",
    "Hidden states from decoder layers are dumped to shared memory.",
    "What is the capital of France? Paris is the capital of France.",
]
# DeepSeek-V3's YaRN settings (as in its config.json).
_YARN = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
SHAPES: dict[str, dict[str, Any]] = {
    "cpu": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                qk_nope_head_dim=32, v_head_dim=32),
    "gpu": dict(hidden_size=256, intermediate_size=1024, moe_intermediate_size=512,
                num_hidden_layers=8, num_attention_heads=128, num_key_value_heads=128,
                n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, kv_lora_rank=512, q_lora_rank=512, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128),
}


def make_tokenizer(path: Path) -> Any:
    """Train a byte-level BPE tokenizer (``VOCAB`` ids, chat template) and save it to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=specials[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def deepseek_v3_config(shape: str = "cpu", *, vocab: int = VOCAB, bos: int, eos: int, pad: int,
                       dtype: str = "bfloat16", layers: int | None = None) -> Any:
    """A ``DeepseekV3Config`` of ``shape`` (``layers`` overrides its layer count)."""
    from transformers import DeepseekV3Config

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")
    dims = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    return DeepseekV3Config(
        vocab_size=vocab, first_k_dense_replace=1, max_position_embeddings=163840,
        routed_scaling_factor=1.0, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        tie_word_embeddings=False, torch_dtype=dtype, topk_method="noaux_tc",
        norm_topk_prob=True, scoring_func="sigmoid",
        rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, **_YARN}, **dims,
    )


def add_sglang_fields(cj: dict[str, Any]) -> dict[str, Any]:
    """Add to a DeepSeek-V3 ``config.json`` the fields SGLang reads and transformers 5 does
    not write."""
    cj["moe_layer_freq"] = 1
    cj["rope_scaling"] = {"type": "yarn", **_YARN}
    cj["rope_theta"] = 10000.0
    cj.setdefault("aux_loss_alpha", 0.001)
    return cj


def make_deepseek_v3(path: Path, shape: str = "cpu", seed: int = 0) -> Path:
    """Write a random-weight DeepSeek-V3 checkpoint (bf16) of ``shape`` to ``path``."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    tok = make_tokenizer(path)
    cfg = deepseek_v3_config(shape, bos=tok.bos_token_id, eos=tok.eos_token_id,
                             pad=tok.pad_token_id)
    DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    cfg_path = path / "config.json"
    cfg_path.write_text(json.dumps(add_sglang_fields(json.loads(cfg_path.read_text())), indent=2))
    return path
