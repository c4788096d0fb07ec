"""Test-only: write tiny random-weight checkpoints (Llama, DeepSeek-V3) with a BPE tokenizer.

``python -m tests.harness.make_models OUT_DIR [--llama-hidden 64]`` writes
``OUT_DIR/tiny-llama`` and ``OUT_DIR/tiny-deepseek-v3`` in a few seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VOCAB = 1024
# A chat template with explicit turn markers, like real ones (no {% generation %} tags).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer for testing SGLang on CPU.",
    "EAGLE speculative decoding drafts tokens with a small model.",
    "Hidden states from decoder layers are dumped to shared memory.",
    "What is the capital of France? Paris is the capital of France.",
]


def make_tokenizer(path: Path):
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
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=specials[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_llama(path: Path, hidden: int = 64, layers: int = 8, intermediate: int | None = None):
    """Write a tiny random Llama checkpoint (bf16) to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = make_tokenizer(path)
    heads = max(4, hidden // 64)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        head_dim=hidden // heads, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def make_deepseek_v3(path: Path):
    """Write a tiny random DeepSeek-V3 (MLA + MoE, 8 layers, first dense) checkpoint."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    tok = make_tokenizer(path)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=163840,
        routed_scaling_factor=1.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, torch_dtype="bfloat16",
        topk_method="noaux_tc", norm_topk_prob=True, scoring_func="sigmoid",
        rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                      "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    # SGLang reads fields that transformers 5 does not write.
    cfg_path = path / "config.json"
    cj = json.loads(cfg_path.read_text())
    cj["moe_layer_freq"] = 1
    cj["rope_scaling"] = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cj["rope_theta"] = 10000.0
    cj.setdefault("aux_loss_alpha", 0.001)
    cfg_path.write_text(json.dumps(cj, indent=2))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--llama-hidden", type=int, default=64,
                        help="Llama hidden size (default 64)")
    parser.add_argument("--llama-layers", type=int, default=8, help="Llama layers (default 8)")
    args = parser.parse_args()
    make_llama(args.out / "tiny-llama", args.llama_hidden, args.llama_layers)
    make_deepseek_v3(args.out / "tiny-deepseek-v3")


if __name__ == "__main__":
    main()
