"""Test-only: write tiny random-weight checkpoints (Llama, DeepSeek-V3) with a BPE tokenizer.

``python -m tests.harness.make_models OUT_DIR [--llama-hidden 64]`` writes
``OUT_DIR/tiny-llama`` and ``OUT_DIR/tiny-deepseek-v3`` in a few seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hsdump_patch.ops import verify_model

# The tokenizer and the DeepSeek-V3 geometry are hsdump verify's (one generator for both).
VOCAB, CHAT_TEMPLATE, _CORPUS = verify_model.VOCAB, verify_model.CHAT_TEMPLATE, verify_model.CORPUS
make_tokenizer = verify_model.make_tokenizer


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


def _deepseek_v3_config(layers: int, vocab: int, bos: int, eos: int, pad: int, dtype: str):
    return verify_model.deepseek_v3_config("cpu", vocab=vocab, bos=bos, eos=eos, pad=pad,
                                           dtype=dtype, layers=layers)


_sglang_deepseek_fields = verify_model.add_sglang_fields


def make_deepseek_v3(path: Path):
    """Write a tiny random DeepSeek-V3 (MLA + MoE, 8 layers, first dense) checkpoint."""
    return verify_model.make_deepseek_v3(path, "cpu")


KIMI_DIR = Path(__file__).parent / "kimi"
KIMI_BASE_VOCAB = 512  # tiktoken ranks; the 258 reserved special ids follow them
# Kimi's special-token layout: offsets from the end of the base vocabulary, as in
# moonshotai/Kimi-K2-Instruct's tokenizer_config.json (163584 + offset there).
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
_KIMI_CORPUS = [
    *_CORPUS,
    "Let me think about this step by step. The user wants the weather in Paris.",
    'I will call the get_weather tool with {"city": "Paris", "unit": "celsius"}.',
    "The tool returned 18 degrees and light rain, so I should answer briefly.",
    "Sure! Here is the answer: it is raining in Paris today.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]


def make_kimi_tokenizer(path: Path) -> None:
    """Write a small tiktoken vocabulary with Kimi's special-token layout, loaded through the
    Kimi-style ``TikTokenTokenizer`` custom code (``trust_remote_code``)."""
    import base64
    import shutil

    from tiktoken._educational import bpe_train

    path.mkdir(parents=True, exist_ok=True)
    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    corpus = "\n".join(_KIMI_CORPUS * 4) + (KIMI_DIR / "chat_template.jinja").read_text()
    ranks = bpe_train(corpus, KIMI_BASE_VOCAB, pat, visualise=None)
    (path / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in ranks.items()))
    shutil.copy(KIMI_DIR / "tokenization_kimi.py", path / "tokenization_kimi.py")
    shutil.copy(KIMI_DIR / "chat_template.jinja", path / "chat_template.jinja")
    specials = {KIMI_BASE_VOCAB + off: name for off, name in KIMI_SPECIALS.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "additional_special_tokens": [n for n in specials.values() if n.startswith("<")],
        "added_tokens_decoder": {str(i): {"content": n, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, n in specials.items()},
        "model_max_length": 1048576,
    }, indent=2))


def make_kimi_k25(path: Path, text_path: Path, layers: int = 4) -> Path:
    """Write a tiny random Kimi-K2.5 (``KimiK25ForConditionalGeneration``: a tiny MoonViT
    vision config + DeepSeek-V3 language model, float32) to ``path``, and the same language
    model weights as a plain DeepSeek-V3 checkpoint to ``text_path`` (the HF reference).

    The vision tower is built from the config but has no weights in the checkpoint: the server
    runs with ``language_model_only``, which skips them (SGLang's Kimi-K2.5 loader).
    """
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    make_kimi_tokenizer(path)
    vocab = KIMI_BASE_VOCAB + 258
    ids = {name: KIMI_BASE_VOCAB + off for off, name in KIMI_SPECIALS.items()}
    text_cfg = _deepseek_v3_config(layers, vocab, ids["[BOS]"], ids["<|im_end|>"], ids["[PAD]"],
                                   "float32")
    text_model = DeepseekV3ForCausalLM(text_cfg).float()
    text_model.save_pretrained(text_path, safe_serialization=True)
    cfg_path = text_path / "config.json"
    text_cj = _sglang_deepseek_fields(json.loads(cfg_path.read_text()))
    cfg_path.write_text(json.dumps(text_cj, indent=2))
    save_file({f"language_model.{k}": v.contiguous() for k, v in text_model.state_dict().items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {**text_cj, "architectures": ["DeepseekV3ForCausalLM"]},
        "vision_config": {
            "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
            "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "num_attention_heads": 2,
            "num_hidden_layers": 1, "hidden_size": 32, "vt_hidden_size": 32,
            "intermediate_size": 64,
            "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal",
            "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
            "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": 64,
        },
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "pad_token_id": ids["[PAD]"], "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32",
    }, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|im_end|>"]}))
    return path

QWEN3_STYLE_TEMPLATE = Path(__file__).parent / "qwen3_style.jinja"
QWEN3_SPECIALS = ["<unk>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                  "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>"]


def make_qwen3_style(path: Path) -> Path:
    """Write a tiny random Llama (float32) with a ChatML tokenizer whose special tokens are
    Qwen3's turn, think and tool markers. Its own chat template is the plain harness one: the
    Qwen3-style template (``QWEN3_STYLE_TEMPLATE``) is what a server is given with
    ``--chat-template``, so a client that ignores the server's template renders wrong."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=QWEN3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*_KIMI_CORPUS, QWEN3_STYLE_TEMPLATE.read_text()] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                   eos_token="<|im_end|>", unk_token="<unk>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=QWEN3_SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)
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
