"""A small random-weight model of the production architecture, generated offline.

``hsdump verify`` serves it instead of the real weights: a Kimi-K2.5 checkpoint laid out as
the real one (``KimiK25ForConditionalGeneration``: the DeepSeek-V3 language model's config
under ``text_config``, its weights under ``language_model.``, a vision config) with a
byte-level BPE tokenizer trained here on a few sentences. Nothing is downloaded. The language
model has Kimi-K2.5's attention (MLA, 64 heads, ``q_lora_rank`` 1536, ``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` / ``v_head_dim`` 128) and routing (sigmoid
``noaux_tc``, ``n_group`` 1, top-8 of 16 routed experts + 1 shared, first layer dense), a
2048-wide residual stream and 7 layers (SGLang's default EAGLE-3 layers 2, 3, 4). Shapes
(``KIMI_SHAPES``):

* ``kimi-gpu``: ``moe_intermediate_size`` 2048, Kimi-K2.5's own, so each rank's expert slice
  at TP 8 (256) is exactly the real model's: whatever MoE runner serves Kimi-K2.5 at TP 8
  takes it (and 256 is a multiple of the 128 the flashinfer runners align to);
* ``kimi-cpu``: ``moe_intermediate_size`` 256, to keep the CPU variant's servers within
  minutes on a few cores.

``SHAPES`` holds the small plain DeepSeek-V3 the test suite's own servers use.
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


_KIMI_TEXT = dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=7,
                  num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
                  n_routed_experts=16, num_experts_per_tok=8, n_group=1, topk_group=1,
                  kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                  qk_nope_head_dim=128, v_head_dim=128)
KIMI_SHAPES: dict[str, dict[str, Any]] = {
    "kimi-gpu": dict(_KIMI_TEXT, moe_intermediate_size=2048),
    "kimi-cpu": dict(_KIMI_TEXT, moe_intermediate_size=256),
}
# A small MoonViT (the server builds the vision tower; text-only requests never run it).
_VISION = {
    "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "num_attention_heads": 2, "num_hidden_layers": 1,
    "hidden_size": 32, "vt_hidden_size": 32, "intermediate_size": 64, "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
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

    shapes = {**SHAPES, **KIMI_SHAPES}
    if shape not in shapes:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(shapes)}")
    dims = dict(shapes[shape], **({"num_hidden_layers": layers} if layers else {}))
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


def make_kimi_k25(path: Path, shape: str = "kimi-cpu", seed: int = 0) -> Path:
    """Write a random-weight Kimi-K2.5 checkpoint (bf16) of ``shape`` to ``path``: the layout
    of the real one (see the module docstring); :func:`load_text_model` reads its language
    model back with HF transformers."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    if shape not in KIMI_SHAPES:
        raise ValueError(f"unknown Kimi shape {shape!r}; choose one of {', '.join(KIMI_SHAPES)}")
    torch.manual_seed(seed)
    tok = make_tokenizer(path)
    ids = dict(bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id)
    cfg = deepseek_v3_config(shape, **ids)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    save_file({f"language_model.{k}": v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    text = add_sglang_fields(cfg.to_dict())
    text.update(architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": dict(_VISION, text_hidden_size=cfg.hidden_size),
        "media_placeholder_token_id": tok.unk_token_id, "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"], "pad_token_id": ids["pad"], "torch_dtype": "bfloat16",
    }, indent=2))
    return path


def load_text_model(path: Path, dtype: torch.dtype) -> Any:
    """HF transformers' DeepSeek-V3 holding the language model of the checkpoint at ``path``:
    a Kimi-K2.5 one (``text_config``, weights under ``language_model.``) or a plain one."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cj = json.loads((Path(path) / "config.json").read_text())
    if "text_config" not in cj:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    text = {k: v for k, v in cj["text_config"].items() if k not in ("model_type", "architectures")}
    return AutoModelForCausalLM.from_pretrained(
        str(path), config=DeepseekV3Config(**text), dtype=dtype,
        key_mapping={r"^language_model\.": ""})
