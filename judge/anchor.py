"""The anchor: the same conversations through SpecForge's own data path, with no hsdump code.

SpecForge 0.2.0 tokenizes and masks a conversation with its own chat-template parser
(``specforge.data.preprocessing.preprocess_conversations``, a template registered the way its
docs say for a model it does not ship), and takes the states from the target itself: here an
HF transformers forward in bfloat16 (its offline capture needs CUDA and SGLang 0.5.14), the
states at the drafter's layers and the final post-norm state, written as its
``scripts/prepare_hidden_states.py`` writes them (``rows_*/data_*.ckpt``). Its vocabulary
mapping is SpecForge's own ``generate_vocab_mapping_file``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2's


def _template():
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate

    name = "hsdump-judge-smollm2"
    if name not in TEMPLATE_REGISTRY.get_all_template_names():
        TEMPLATE_REGISTRY.register(name, ChatTemplate(
            assistant_header="<|im_start|>assistant\n", user_header="<|im_start|>user\n",
            system_prompt=SYSTEM, end_of_turn_token="<|im_end|>\n"))
    return TEMPLATE_REGISTRY.get(name)


def build(rows_path: Path, target: Path, layers: list[int], out: Path, draft_vocab_size: int,
          max_length: int, progress: bool = True) -> dict:
    """Write the anchor records of ``rows_path``'s conversations to ``out``; return its
    counts and timing (tokens per second of tokenizing + forward + writing)."""
    from specforge.data.preprocessing import generate_vocab_mapping_file, preprocess_conversations
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    template = _template()
    start = time.perf_counter()
    ids_all, masks_all, tokens = [], [], 0
    for i, row in enumerate(tqdm(rows, desc="anchor (SpecForge data path)", disable=not progress)):
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        enc = preprocess_conversations(tokenizer, [messages], template, max_length=max_length)
        ids, mask = enc["input_ids"][0], enc["loss_mask"][0]
        with torch.no_grad():
            states = model(input_ids=ids, output_hidden_states=True).hidden_states
        record = {"input_ids": ids[0].clone(), "loss_mask": mask[0].clone(),
                  "hidden_state": states[-1].clone(),
                  "aux_hidden_state": torch.cat([states[k] for k in layers], dim=-1).clone()}
        path = out / f"rows_{i - i % 2000}-{i - i % 2000 + 2000}" / f"data_{i}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(record, path)
        ids_all.append(ids[0])
        masks_all.append(mask[0])
        tokens += ids.shape[1]
    seconds = time.perf_counter() - start
    mapping = generate_vocab_mapping_file(
        {"input_ids": ids_all, "loss_mask": masks_all}, model.config.vocab_size,
        draft_vocab_size, cache_dir=str(out), cache_key="specforge-vocab-mapping")
    return {"records": len(rows), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "vocab_mapping": mapping}
