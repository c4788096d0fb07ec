"""What the server serves: the chat template it renders with, and its own prompt ids.

SGLang 0.5.23 is the reference for prompts. ``follow_chat_template`` makes local rendering use
the server's ``--chat-template`` file; ``ServedPrompts`` asks the server for the prompt ids it
would serve a chat request (``/v1/tokenize`` with ``messages``: the same
``OpenAIServingChat._process_messages`` as ``/v1/chat/completions``, no forward) and refuses a
turn whose locally rendered prompt differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from hsdump_patch.client.rows.conversation import MESSAGE_FIELDS, Conversation, ConversationError

# A server call: (messages, tools, chat_template_kwargs) -> the prompt ids it serves.
Tokenize = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None",
                     "dict[str, Any] | None"], list[int]]


class ServerDown(RuntimeError):
    """The server stayed unreachable through every retry: the run cannot go on."""


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


def request_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat request carries them: the chat API's fields, values untouched
    (hsdump's own keys such as ``token_ids`` and ``train`` left out)."""
    return [{f: m[f] for f in MESSAGE_FIELDS if f in m} for m in messages]


class ServedPrompts:
    """Checks each trained turn's prompt ids against the server's own rendering of the turn's
    request; counts the turns checked."""

    def __init__(self, tokenize: Tokenize, template_kwargs: dict[str, Any] | None) -> None:
        self.tokenize = tokenize
        self.template_kwargs = dict(template_kwargs or {}) or None
        self.checked = 0

    def served(self, conv: Conversation, k: int) -> list[int]:
        """The prompt ids the server serves for the messages before ``k``."""
        return self.tokenize(request_messages((conv.request or conv.messages)[:k]), conv.tools,
                             self.template_kwargs)

    def __call__(self, conv: Conversation, k: int, ids: list[int]) -> None:
        """Raise ConversationError when ``ids`` are not the server's prompt of turn ``k``."""
        served = self.served(conv, k)
        self.checked += 1
        if served == ids:
            return
        at = next((i for i, (a, b) in enumerate(zip(ids, served, strict=False)) if a != b),
                  min(len(ids), len(served)))
        raise ConversationError(
            f"messages[{k}]: the prompt rendered here differs from the one the server serves for "
            f"this turn (its /v1/tokenize of the same messages) at token {at} (here "
            f"{ids[at:at + 4]} of {len(ids)}, server {served[at:at + 4]} of {len(served)}): "
            "the server renders with another template or treats these messages differently; "
            "check --chat-template-kwargs and the server's --chat-template")
