"""Test-only stand-in for Kimi's custom tokenizer code (``tokenization_kimi.py``, loaded with
``trust_remote_code``): a tiktoken BPE plus reserved special ids after the base vocabulary.

Written for this project after the behaviour of moonshotai/Kimi-K2-Instruct's
``tokenization_kimi.py`` (Hugging Face; a copy is in github troy12x/quasar-kimi,
tokenization_kimi.py @ d47b0df2269dafc52acd984aa7c17f72aa667c3b): the same class name and base
class, pre-tokenizer pattern, special-token layout (``num_reserved_special_tokens`` = 256, ids
``len(ranks)`` .. ``len(ranks) + 257``, named from ``added_tokens_decoder``), ``encode`` that
treats special-token text as special, byte-level token strings, and ``apply_chat_template``
that sorts the tool declarations' keys.
"""

from __future__ import annotations

import os
from shutil import copyfile
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode  # gpt2 module in Kimi's file

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
NUM_RESERVED_SPECIAL_TOKENS = 256
# Kimi's pre-tokenizer pattern (tiktoken / fancy-regex syntax).
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def deep_sort_dict(obj: Any) -> Any:
    """Sort dict keys recursively (tool declarations render in a stable order)."""
    if isinstance(obj, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort_dict(v) for v in obj]
    return obj


class TikTokenTokenizer(PreTrainedTokenizer):
    """Kimi-style tiktoken tokenizer (see the module docstring)."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ("input_ids", "attention_mask")

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 unk_token: str | None = None, pad_token: str | None = None,
                 additional_special_tokens: list[str] | None = None,
                 added_tokens_decoder: dict | None = None, **kwargs: Any) -> None:
        names = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS + 2)}
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in byte_encoder.items()}
        self.decoder = {i: "".join(byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.n_words)}
        self.encoder = {s: i for i, s in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, additional_special_tokens=additional_special_tokens,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Plain calls go straight to tiktoken with special-token text as specials (Kimi's
        behaviour); calls with transformers arguments take the generic path."""
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids: int | list[int], **kwargs: Any) -> str:
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.special_tokens.get(str(self.unk_token), 0))

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "")
                           + VOCAB_FILES_NAMES["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)

    def apply_chat_template(self, conversation, tools: list[dict] | None = None,
                            tokenize: bool = False, add_generation_prompt: bool = True,
                            **kwargs: Any):
        return super().apply_chat_template(
            conversation, tools=deep_sort_dict(tools), tokenize=tokenize,
            add_generation_prompt=add_generation_prompt, **kwargs)
