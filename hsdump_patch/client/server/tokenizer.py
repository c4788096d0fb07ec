"""The model's tokenizer as the server uses it: loaded from the served model, with the chat
template the server renders with."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(model: str, trust_remote_code: bool) -> Any:
    """The model's own tokenizer (and chat template); custom code runs only when trusted (the
    ``--trust-remote-code`` flag, or a server that runs with it)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"the tokenizer of {model} needs its own code (custom code in the model dir), and "
            "neither this client nor the server was told to trust it: add --trust-remote-code "
            "to the hsdump command (the server needs --trust-remote-code too)") from None


def follow_chat_template(tokenizer: Any, server_args: dict[str, Any]) -> str | None:
    """Give ``tokenizer`` the Jinja template of the server's ``--chat-template``, if it has one;
    return its path. Read as SGLang 0.5.23's ``TemplateManager._load_jinja_template`` reads it
    (outer newlines stripped, literal ``\\n`` turned into newlines).

    A built-in template name or a JSON conversation template is SGLang's own Python rendering,
    which hsdump cannot reproduce: refused, as is a file this client cannot read.
    """
    path = server_args.get("chat_template")
    if not path:
        return None
    if not str(path).endswith(".jinja"):
        raise ValueError(
            f"the server renders chats with --chat-template {path!r}, a built-in SGLang template "
            "or JSON conversation template that hsdump cannot render: serve a Jinja template "
            "(a .jinja file), or pre-tokenize the dataset into input_ids + loss_mask rows")
    if not os.path.isfile(path):
        raise ValueError(
            f"the server renders chats with --chat-template {path}, which this client cannot "
            "read: run hsdump where that file is at the same path (e.g. mount it at the same "
            "path in the server's container and on the host)")
    with open(path, encoding="utf-8") as f:
        tokenizer.chat_template = f.read().strip("\n").replace("\\n", "\n")
    return str(path)
