"""Chat rows -> serving-faithful samples: token ids plus a loss mask on what the model generates.

A row's conversation is normalized (:func:`parse_conversation`) from the shapes real agent and
thinking datasets use, then each trained assistant turn becomes what the served model sees and
produces:

* its **prompt** is exactly the serving-time prompt (:func:`prompt_ids`): the chat template
  applied to the messages before the turn with the generation prompt, then encoded;
* its **completion** is the turn as the model emits it after that prompt: reasoning inside the
  model's own think markers, content, tool calls, end of turn. It is built from the template's
  rendering of the turn, with the think block rebuilt from the markers when the template empties
  it (Kimi-K2.5 renders the last plain answer as ``<think></think>``) and with the opening marker
  left out when the generation prompt already opened it.

How turns become samples is the multi-turn policy (:data:`POLICIES`, docs/client.md):
``auto`` makes one sample with every turn masked when each turn's prompt + completion is a prefix
of the next turn's prompt and the token stream agrees, else one sample per turn; ``per-turn``
always makes one sample per turn; ``last`` only the last turn.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from hsdump_patch.client.rows import schema as rows

POLICIES = ("auto", "per-turn", "last")
# ShareGPT speaker names -> chat-template roles.
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "bing": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_PROBE = [{"role": "user", "content": "x"}]


class RenderCheckDown(RuntimeError):
    """The check a renderer consults (the server's own prompt ids) cannot answer: the row is
    not at fault, and the run cannot go on."""


class ConversationError(ValueError):
    """A conversation cannot be turned into samples; the message says what and how to fix it."""


@dataclass(frozen=True)
class Conversation:
    """Chat-template messages and the row's tool declarations."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # The messages as a chat request carries them (content not flattened): what the server
    # is asked to render when it checks a prompt.
    request: list[dict[str, Any]] | None = None


# The think markers of SGLang 0.5.23's reasoning parsers, by --reasoning-parser name: the
# ``think_start_token`` / ``think_end_token`` of each detector in ``ReasoningParser.DetectorMap``
# (sglang/srt/parser/reasoning_parser.py; ``response_template`` takes its markers from server
# arguments and is left out). tests/unit/test_client_dataset.py compares every entry with SGLang's.
_THINK = ("<think>", "</think>")
REASONING_MARKERS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(
        ("deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41", "dots", "glm45", "ling3",
         "hunyuan", "kimi_k2", "mimo", "poolside_v1", "qwen3", "qwen3-thinking", "minimax",
         "minimax-append-think", "nanbeige", "step3", "step3p5", "nemotron_3",
         "granite_thinking_parser", "interns1", "gigachat35", "iquest_q1"), _THINK),
    "apertus2509": ("<|inner_prefix|>", "<|inner_suffix|>"),
    "beam": ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"),
    "gpt-oss": ("<|channel|>analysis<|message|>", "<|end|>"),
    "k2_horizon": ("<ifm|think>", "</ifm|think>"),
    "kimi": ("\u25c1think\u25b7", "\u25c1/think\u25b7"),
    "kimi_k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    "muse": (" to=self<|message|>", "<|eom|>"),
    "minimax-m3": ("<mm:think>", "</mm:think>"),
    "mistral": ("[THINK]", "[/THINK]"),
    "gemma4": ("<|channel>", "<channel|>"),
    "inkling": ("<|content_thinking|>", "<|end_message|>"),
    "cohere_command4": ("<|START_THINKING|>", "<|END_THINKING|>"),
}


@dataclass(frozen=True)
class ThinkMarkers:
    """The model's reasoning delimiters, as its SGLang reasoning parser knows them."""

    start: str
    end: str

    @classmethod
    def from_reasoning_parser(cls, name: str) -> ThinkMarkers:
        """Markers of SGLang's reasoning parser ``name`` (``--reasoning-parser`` of the server),
        from :data:`REASONING_MARKERS` (the client does not need SGLang installed)."""
        try:
            return cls(*REASONING_MARKERS[name])
        except KeyError:
            raise ValueError(
                f"unknown reasoning parser {name!r}: SGLang 0.5.23 has "
                f"{', '.join(sorted(REASONING_MARKERS))}; pass one of them as "
                "--reasoning-parser") from None

    @classmethod
    def from_vocab(cls, tokenizer: Any) -> ThinkMarkers | None:
        """``<think>`` / ``</think>`` when both are single tokens of the tokenizer, else None."""
        vocab = tokenizer.get_vocab()
        if "<think>" in vocab and "</think>" in vocab:
            return cls("<think>", "</think>")
        return None


@dataclass(frozen=True)
class TurnSample:
    """One training sample of a row; ``suffix`` is appended to the row id ("" for the first)."""

    suffix: str
    input_ids: list[int]
    loss_mask: list[int]
    # (message index, prompt length) of each trained turn: input_ids[:length] is its prompt.
    prompts: tuple[tuple[int, int], ...] = ()


def _text(value: Any, where: str, sep: str = "") -> str | None:
    """Message content as text: a string, None, or a list of ``{"type": "text"}`` parts, joined
    with ``sep``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ConversationError(
                    f"{where}[{i}] is a {kind!r} part; only text parts "
                    '({"type": "text", "text": ...}) can be rendered')
        return sep.join(parts)
    raise ConversationError(f"{where} must be a string, null or a list of text parts")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in value):
        raise ConversationError(
            f'{where} must be a list of {{"function": {{"name": ..., "arguments": ...}}}}')
    return value


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if isinstance(value, str):  # some datasets store the declarations as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConversationError(f'"tools" is a string but not JSON ({e})') from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConversationError('"tools" must be a list of tool declarations (objects)')
    # A bare function declaration gets the OpenAI wrapper the templates expect.
    return [t if "function" in t else {"type": "function", "function": t} for t in value] or None


def parse_conversation(obj: dict[str, Any], parts_sep: str = "") -> Conversation:
    """Normalize a row's ``messages`` / ``conversations`` (+ ``tools``, ``system``).

    A list of text parts becomes one string joined with ``parts_sep``: SGLang 0.5.23 joins the
    parts with " " for a template that expects string content (``content_format``); a template
    that loops over the parts prints them one after the other ("").
    """
    key = "messages" if "messages" in obj else "conversations"
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise ConversationError(f'"{key}" must be a non-empty list of turns')
    out: list[dict[str, Any]] = []
    request: list[dict[str, Any]] = []
    for k, turn in enumerate(turns):
        where = f"{key}[{k}]"
        if not isinstance(turn, dict):
            raise ConversationError(f"{where} must be an object")
        if "from" in turn:  # ShareGPT keys; "conversations" rows may also use role/content
            speaker = turn["from"]
            if speaker not in SHAREGPT_ROLES:
                raise ConversationError(f"{where}: unknown speaker {speaker!r} (known: "
                                        f"{', '.join(sorted(SHAREGPT_ROLES))})")
            msg = {k2: v for k2, v in turn.items() if k2 not in ("from", "value")}
            msg.update(role=SHAREGPT_ROLES[speaker], content=turn.get("value"))
        elif "role" in turn:
            role = turn["role"]
            role = SHAREGPT_ROLES.get(role, role) if key == "conversations" else role
            if role not in CHAT_ROLES:
                raise ConversationError(f"{where}: unknown role {role!r} (known: "
                                        f"{', '.join(sorted(CHAT_ROLES))})")
            msg = {**turn, "role": role}
        else:
            raise ConversationError(f'{where} needs "role" (or ShareGPT "from")')
        parts = msg.get("content")
        # SGLang flattens a tool result's text parts with spaces (serving_chat.py,
        # normalize_tool_content); other roles' parts as the template expects them.
        msg["content"] = _text(msg.get("content"), f"{where}.content",
                               " " if msg["role"] == "tool" else parts_sep)
        if msg.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        elif msg["content"] is None:
            raise ConversationError(f'{where} has no "content" (null is allowed only next to '
                                    '"tool_calls")')
        if "reasoning" in msg and "reasoning_content" not in msg:
            msg["reasoning_content"] = msg.pop("reasoning")
        if msg.get("reasoning_content") is not None and not isinstance(
                msg["reasoning_content"], str):
            raise ConversationError(f"{where}.reasoning_content must be a string")
        if msg["content"] is None:
            msg["content"] = ""  # OpenAI tool-call turns; every template renders "" as nothing
        out.append(msg)
        request.append({**msg, "content": parts})
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise ConversationError('"system" must be a string')
        if out[0]["role"] == "system":
            raise ConversationError('the row has both a top-level "system" and a system '
                                    "message; keep one")
        out.insert(0, {"role": "system", "content": system})
        request.insert(0, out[0])
    return Conversation(out, _tools(obj.get("tools")), request)


# Fields of SGLang 0.5.23's request models, in their declaration order
# (sglang/srt/entrypoints/openai/protocol.py: ChatCompletionMessageGenericParam, Function).
MESSAGE_FIELDS = ("role", "content", "tool_call_id", "name", "phase", "reasoning_content",
                  "tool_calls", "tools", "prefix")
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def served_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool declarations as SGLang 0.5.23's chat API hands them to the chat template.

    After its request model (protocol.py ``Tool``/``Function``, dumped with ``model_dump()``):
    unknown keys dropped; the function's given keys in their order, then a missing
    ``description``/``parameters`` as None; ``strict``/``defer_loading`` only when set (a
    tool-level ``defer_loading`` is copied into the function); the tool-level
    ``defer_loading`` always, None when unset. Idempotent.
    """
    if not tools:
        return None
    out = []
    for t in tools:
        f = t["function"]
        defer = t.get("defer_loading")
        fields = {k: f.get(k) for k in _FUNCTION_FIELDS}
        if defer is not None and fields["defer_loading"] is None:
            fields["defer_loading"] = defer
        for k in ("strict", "defer_loading"):
            if fields[k] is None:
                del fields[k]
        order = [k for k in f if k in fields] + [k for k in fields if k not in f]
        out.append({"type": t.get("type", "function"), "function": {k: fields[k] for k in order},
                    "defer_loading": defer})
    return out


@functools.lru_cache(maxsize=8)
def content_format(template: str) -> str:
    """"openai" when the chat template loops over a message's content parts, else "string".

    SGLang 0.5.23's rule (``detect_jinja_template_content_format`` in
    srt/parser/jinja_template_utils.py, after vLLM's): a template naming image, audio, video or
    vision is "openai"; so is one with a ``for`` loop over ``message``/``msg``/``m``'s
    ``content`` (through filters, tests or slices); a template that does not parse is
    "string". For a "string" template SGLang joins a list of text parts with " ".
    """
    if any(word in template for word in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # SGLang treats a template it cannot parse as "string" too
        return "string"
    return "openai" if any(_reads_content(loop.iter)
                           for loop in tree.find_all(jinja2.nodes.For)) else "string"


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """Whether ``node`` is ``message.content`` (or msg / m), possibly filtered, tested or
    sliced."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        if node.node is None:
            return False
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        key, owner = node.attr, node.node
    elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        key, owner = node.arg.value, node.node
    else:
        return False
    return (key == "content" and isinstance(owner, jinja2.nodes.Name) and owner.ctx == "load"
            and owner.name in ("message", "msg", "m"))


def served_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as SGLang 0.5.23's chat API hands them to the chat template.

    After ``OpenAIServingChat._apply_jinja_template``: the request model's fields only, unset
    ones left out; tool calls dumped whole (``id``, ``index``, ``type``, ``function``) with
    their JSON ``arguments`` parsed into an object (``normalize_assistant_tool_call_arguments``;
    arguments that are not a JSON object are a request error there, a
    :class:`ConversationError` here). Idempotent.
    """
    out = []
    for k, m in enumerate(messages):
        msg = {f: m[f] for f in MESSAGE_FIELDS if m.get(f) is not None}
        msg.setdefault("content", "")
        if msg.get("tool_calls"):
            calls = []
            for c in msg["tool_calls"]:
                args = c["function"].get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        args = None
                    if not isinstance(args, dict):
                        raise ConversationError(
                            f"messages[{k}]: tool call arguments must be a JSON object (SGLang "
                            "rejects the request otherwise)")
                calls.append({"id": c.get("id"), "index": c.get("index"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def prompt_text(tokenizer: Any, messages: Sequence[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The serving-time prompt text before the next assistant turn."""
    return tokenizer.apply_chat_template(served_messages(messages), tools=served_tools(tools),
                                         tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))


_ADDS_SPECIALS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _adds_specials(tokenizer: Any) -> bool:
    """Whether ``tokenizer.encode`` adds special tokens on its own (a BOS), probed once."""
    try:
        return _ADDS_SPECIALS[tokenizer]
    except (KeyError, TypeError):
        pass
    adds = len(tokenizer.encode("")) > 0
    with contextlib.suppress(TypeError):  # not weak-referenceable: probe each time
        _ADDS_SPECIALS[tokenizer] = adds
    return adds


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as the server encodes a rendered chat prompt.

    As SGLang 0.5.23 does (``OpenAIServingChat``: ``_tokenizer_auto_adds_specials``, probed
    with ``encode("")``): ``add_special_tokens=False`` only for a tokenizer that adds specials
    by itself, else no keyword at all, which keeps Kimi's ``TikTokenTokenizer`` on its fast
    path (with the keyword it takes the slow generic one and warns on every call).
    """
    if _adds_specials(tokenizer):
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def decode(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids``, exactly (no clean-up of spaces); without keywords when the tokenizer
    cleans up nothing anyway (Kimi's tokenizer takes its slow path on any keyword)."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def decodes_to(tokenizer: Any, ids: list[int], text: str) -> bool:
    """Whether ``ids`` are exactly ``text`` (the plain decode first: it is the fast one)."""
    return tokenizer.decode(ids) == text or decode(tokenizer, ids) == text


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt ids of the assistant turn that follows ``messages``, as the server sees them.

    The one place a turn's prompt is made: extraction and ``hsdump regenerate`` both use it.
    ``template_kwargs`` are the request's ``chat_template_kwargs`` (e.g. ``{"thinking": false}``).
    """
    return encode(tokenizer, prompt_text(tokenizer, messages, tools, template_kwargs))


class ChatRenderer:
    """Turns a conversation into serving-faithful samples under a multi-turn policy."""

    def __init__(self, tokenizer: Any, think: ThinkMarkers | None = None,
                 policy: str = "auto", template_kwargs: dict[str, Any] | None = None,
                 check: Callable[[Conversation, int, list[int]], None] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the model's tokenizer has no chat template: chat rows cannot be rendered; "
                'pre-tokenize the dataset into {"id", "input_ids", "loss_mask"} rows instead')
        if policy not in POLICIES:
            raise ValueError(f"multi-turn policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.tokenizer = tokenizer
        self.think = think if think is not None else ThinkMarkers.from_vocab(tokenizer)
        self.policy = policy
        self.template_kwargs = dict(template_kwargs or {})
        # How SGLang flattens a list of text parts for this template (parse_conversation).
        self.parts_sep = " " if content_format(tokenizer.chat_template) == "string" else ""
        # Called with each trained turn's prompt ids (e.g. ServedPrompts: the server's own).
        self.check = check
        self._probe_cache: tuple[list[dict[str, Any]] | None, str] | None = None
        base = self._render(_PROBE, False)
        with_prompt = self._render(_PROBE, True)
        if not with_prompt.startswith(base) or with_prompt == base:
            raise ValueError("the chat template's generation prompt is not appended to the "
                             "conversation; chat rows cannot be rendered, pre-tokenize them")
        gen = with_prompt[len(base):]
        self.generation_prompt = gen
        # The assistant header: the generation prompt without a think block it opens or
        # closes (thinking off: Kimi-K2.5 ends it with an empty <think></think>).
        # Qwen3's enable_thinking=false ends it with "<think>\n\n</think>\n\n".
        self.opens_think = bool(self.think and gen.endswith(self.think.start))
        self.empty_block = ""  # the closed empty think block ending the generation prompt
        if self.think and not self.opens_think and gen.rstrip().endswith(self.think.end):
            at = gen.rfind(self.think.start)
            if at >= 0 and not gen[at + len(self.think.start):].rstrip()[
                    : -len(self.think.end)].strip():
                self.empty_block = gen[at:]
        self.closes_think = bool(self.empty_block)
        self.header = (gen[: -len(self.think.start)] if self.opens_think  # type: ignore[union-attr]
                       else gen[: len(gen) - len(self.empty_block)])
        # Special tokens are split out before BPE: no token spans a boundary next to one.
        self.specials = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        # What the template puts after an assistant turn's content: the end-of-turn text the
        # model emits last (its stop token), then whitespace that only separates turns (the
        # "\n" after ChatML's <|im_end|>): the model stops before it, the next prompt holds it.
        answer = "hsdump-probe-answer"
        answered = self._render([*_PROBE, {"role": "assistant", "content": answer}], False)
        cut = answered.rfind(answer)
        tail = answered[cut + len(answer):] if cut >= 0 else ""
        self.end_of_turn = tail.rstrip() or tail
        self.turn_separator = tail[len(self.end_of_turn):]

    def fingerprint(self) -> str:
        """A digest of everything besides a row's own bytes that decides its samples: the
        policy, the chat template, its kwargs, the think markers and the vocabulary (with the
        added tokens). A resumed run compares it instead of rendering finished rows again."""
        h = hashlib.sha256()
        h.update(json.dumps([self.policy, self.tokenizer.chat_template, self.template_kwargs,
                             self.think and [self.think.start, self.think.end]],
                            sort_keys=True, default=str).encode())
        h.update(json.dumps(sorted(self.tokenizer.get_vocab().items())).encode())
        return h.hexdigest()[:32]

    def _render(self, messages: Sequence[dict[str, Any]], generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            served_messages(messages), tools=served_tools(tools), tokenize=False,
            add_generation_prompt=generation_prompt, **self.template_kwargs)

    def _probe_render(self, tools: list[dict[str, Any]] | None) -> str:
        """The probe user message rendered with ``tools``, kept for the last tools seen."""
        cached = self._probe_cache
        if cached is None or cached[0] is not tools:
            cached = self._probe_cache = (tools, self._render(_PROBE, False, tools))
        return cached[1]

    def prompt_text(self, conv: Conversation, k: int) -> str:
        """The serving prompt of assistant message ``k``: the messages before it, rendered
        with the generation prompt and the renderer's template options."""
        return prompt_text(self.tokenizer, conv.messages[:k], conv.tools, self.template_kwargs)

    def turn_text(self, conv: Conversation, k: int) -> str:
        """Assistant message ``k`` as the template renders it, without its header.

        No marker is searched for in rendered text (any message may quote any marker): the
        turn is what rendering it after a probe user message adds to the probe's rendering,
        less the generation prompt's header; it must also be exactly how the rendering of
        ``messages[: k + 1]`` ends, i.e. the template renders the turn the same in its own
        conversation. A ``name`` is left out: the model writes the turn after the generation
        prompt, whatever name later prompts give it.
        """
        msg = {key: v for key, v in conv.messages[k].items() if key != "name"}
        base = self._probe_render(conv.tools)
        alone = self._render([*_PROBE, msg], False, conv.tools)
        if not alone.startswith(base) or not alone.startswith(self.header, len(base)):
            raise ConversationError(
                f"messages[{k}]: the template's rendering of this assistant turn does not start "
                f"with its generation prompt {self.header!r}")
        turn = alone[len(base) + len(self.header):]
        if not self._render(conv.messages[: k + 1], False, conv.tools).endswith(turn):
            raise ConversationError(
                f"messages[{k}]: the template renders this assistant turn differently in its "
                "conversation than after a single user message; its tokens cannot be told apart "
                "from the prompt's")
        return turn

    def completion_text(self, conv: Conversation, k: int, prompt: str) -> str:
        """Assistant message ``k`` as the model emits it after ``prompt``."""
        msg = conv.messages[k]
        turn = self.turn_text(conv, k)
        reasoning = msg.get("reasoning_content") or ""
        think = self.think
        if think and think.end in reasoning:
            raise ConversationError(
                f"messages[{k}].reasoning_content holds the think end marker {think.end!r}: the "
                "reasoning parser would end the reasoning there, so the model cannot emit it")
        block, rest = "", turn
        if think and turn.lstrip().startswith(think.start) and think.end in turn:
            open_at = turn.index(think.start)
            close_at = turn.index(think.end, open_at)
            inner = turn[open_at + len(think.start):close_at]
            if reasoning.strip() and not inner.strip():
                inner = reasoning  # the template emptied the reasoning of this turn
            block, rest = think.start + inner + think.end, turn[close_at + len(think.end):]
        elif reasoning.strip() and reasoning.strip() not in turn:
            if not think:
                raise ConversationError(
                    f"messages[{k}] has reasoning_content but the template drops it and the "
                    "model's think markers are unknown; pass --reasoning-parser")
            block = think.start + reasoning + think.end
        text = block + rest
        if think and self.closes_think and prompt.endswith(self.empty_block):
            # Thinking off: the prompt closed an empty think block; the model writes the answer.
            if "".join(block.split()) not in ("", think.start + think.end):
                raise ConversationError(
                    f"messages[{k}] has reasoning but the prompt turns thinking off (the "
                    "generation prompt closes the think block): the model cannot emit it")
            text = rest
        elif self.opens_think and prompt.endswith(think.start):  # type: ignore[union-attr]
            # The prompt opened the think block: the model continues inside it.
            text = text[len(think.start):] if text.startswith(think.start) else think.end + text
        if self.turn_separator and text.endswith(self.end_of_turn + self.turn_separator):
            text = text[: len(text) - len(self.turn_separator)]
        eot = self.end_of_turn.strip()
        if eot and eot in text[: len(text) - len(self.end_of_turn)]:
            raise ConversationError(
                f"messages[{k}] holds the end-of-turn marker {eot!r} inside the turn: generation "
                "stops there, so the model cannot emit this turn")
        return text

    def _turns(self, conv: Conversation) -> list[int]:
        """Indices of trained assistant turns: those after the first user message, less those
        marked ``"train": false`` (kept as prompt, e.g. by ``hsdump regenerate
        --train-only-regenerated``)."""
        first_user = next((i for i, m in enumerate(conv.messages) if m["role"] == "user"), None)
        if first_user is None:
            raise ConversationError("the conversation has no user message, so no assistant "
                                    "turn answers anything; nothing to train on")
        turns = [i for i, m in enumerate(conv.messages)
                 if m["role"] == "assistant" and i > first_user and rows.trained(m)]
        if not turns:
            raise ConversationError("the conversation has no assistant turn to train after a "
                                    'user message (none, or all "train": false); nothing to '
                                    "train on")
        return turns

    def _completion(self, conv: Conversation, k: int, prompt: str) -> tuple[str, list[int]]:
        """Completion text and ids; a regenerated turn's ``token_ids`` are used verbatim."""
        try:
            ids = rows.token_ids(conv.messages[k], k)
        except rows.RowFieldError as e:
            raise ConversationError(str(e)) from None
        if ids is not None:
            return decode(self.tokenizer, ids), ids
        text = self.completion_text(conv, k, prompt)
        ids = encode(self.tokenizer, text)
        if not decodes_to(self.tokenizer, ids, text):
            raise ConversationError(f"messages[{k}]: the completion tokens do not decode back "
                                    "to the completion text; its mask would misalign")
        return text, ids

    def render(self, conv: Conversation) -> list[TurnSample]:
        """The samples of one conversation under the policy."""
        turns = self._turns(conv)
        if self.policy == "last":
            turns = turns[-1:]
        last = turns[-1]
        last_prompt = self.prompt_text(conv, last)
        last_completion = self._completion(conv, last, last_prompt)
        if self.policy == "auto" and len(turns) > 1:
            single = self._single(conv, turns, last_prompt, last_completion)
            try:
                if single is not None:
                    return self._checked(conv, [single])
            except ConversationError:
                # A later turn's served prompt re-encodes the earlier turns' text, which differs
                # from the stream when a regenerated turn's ids are not the canonical split of
                # its text: each turn after its own served prompt is still faithful.
                pass
        out = []
        for n, k in enumerate(turns):
            prompt = last_prompt if k == last else self.prompt_text(conv, k)
            _, c_ids = last_completion if k == last else self._completion(conv, k, prompt)
            p_ids = encode(self.tokenizer, prompt)
            out.append(TurnSample("" if n == 0 else f"#{k}", p_ids + c_ids,
                                  [0] * len(p_ids) + [1] * len(c_ids), ((k, len(p_ids)),)))
        return self._checked(conv, out)

    def _checked(self, conv: Conversation, samples: list[TurnSample]) -> list[TurnSample]:
        """``samples``, once every trained turn's prompt passed the server check (if any)."""
        if self.check is not None:
            for sample in samples:
                for k, n in sample.prompts:
                    self.check(conv, k, sample.input_ids[:n])
        return samples

    def _single(self, conv: Conversation, turns: list[int], last_prompt: str,
                last_completion: tuple[str, list[int]]) -> TurnSample | None:
        """One sample with every turn masked, or None when the turns' serving prompts are not
        prefixes of one token stream (then each turn is a sample of its own).

        Linear in the turns: the stream is the last turn's serving prompt + completion, and each
        earlier turn is found in it after its assistant header, up to the end-of-turn text. An
        earlier turn qualifies only if the stream still holds it as the model emitted it (its
        reasoning, content, or regenerated tokens), so a template that drops or rewrites past
        turns falls back to per-turn samples. Every piece boundary must be a token boundary,
        and the masked tokens must decode to exactly each turn's completion text.
        """
        msgs = conv.messages
        if not self.end_of_turn or _quotes(conv, (self.header, self.end_of_turn.strip())):
            return None  # the markers found in the stream could come from a message's text
        stream = last_prompt + last_completion[0]
        heads = _find_all(last_prompt, self.header)
        assistants = [i for i, m in enumerate(msgs[: turns[-1]]) if m["role"] == "assistant"]
        if len(heads) != len(assistants) + 1:
            return None
        think = self.think
        opener = think.start if self.opens_think else self.empty_block  # type: ignore[union-attr]
        cuts = []  # (start, end) of each earlier turn's completion in the stream
        for k in turns[:-1]:
            start = heads[assistants.index(k)] + len(self.header)
            if not stream.startswith(opener, start):
                return None
            start += len(opener)
            end = stream.find(self.end_of_turn, start)
            if end < 0:
                return None
            end += len(self.end_of_turn)
            if not self._intact(msgs[k], stream[start:end]):
                return None
            cuts.append((start, end))
        cuts.append((len(last_prompt), len(stream)))
        ids: list[int] = []
        mask: list[int] = []
        prompts = []
        done = 0
        for n, (start, end) in enumerate(cuts):
            head = encode(self.tokenizer, stream[done:start])
            tokens = msgs[turns[n]].get(rows.TOKEN_IDS)
            if n == len(cuts) - 1:
                body = last_completion[1]
            elif tokens is not None:
                body = tokens
            else:
                body = encode(self.tokenizer, stream[start:end])
            if not decodes_to(self.tokenizer, body, stream[start:end]):
                return None
            prompts.append((turns[n], len(ids) + len(head)))
            ids += head + body
            mask += [0] * len(head) + [1] * len(body)
            done = end
        internal = [x for start, end in cuts[:-1] for x in (start, end)]
        if not all(self._token_boundary(stream, x) for x in internal):
            return None
        if not decodes_to(self.tokenizer, ids, stream):
            return None
        return TurnSample("", ids, mask, tuple(prompts))

    def _intact(self, msg: dict[str, Any], emitted: str) -> bool:
        """Whether ``emitted`` (a past turn as a later prompt holds it) is the turn as the
        model produced it: regenerated tokens verbatim, else its reasoning and content."""
        if self.header in emitted:
            return False
        if msg.get(rows.TOKEN_IDS) is not None:
            return decodes_to(self.tokenizer, msg[rows.TOKEN_IDS], emitted)
        reasoning = (msg.get("reasoning_content") or "").strip()
        if reasoning and reasoning not in (
                emitted.split(self.think.end)[0] if self.think else emitted):
            return False
        content = (msg.get("content") or "").strip()
        return content in emitted

    def _token_boundary(self, text: str, at: int, window: int = 32) -> bool:
        """Whether encoding does not merge tokens across ``text[at]``: a special token on
        either side, else checked on a window around it."""
        if any(text.startswith(t, at) or text.endswith(t, 0, at) for t in self.specials):
            return True
        left, right = text[max(0, at - window):at], text[at:at + window]
        return encode(self.tokenizer, left + right) == (
            encode(self.tokenizer, left) + encode(self.tokenizer, right))


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (dict keys and values, list items), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _quotes(conv: Conversation, markers: Sequence[str]) -> bool:
    """Whether any text of the conversation (messages, tools) holds one of ``markers``."""
    markers = [m for m in markers if m]
    return any(m in text for text in _strings([conv.messages, conv.tools]) for m in markers)


def _find_all(text: str, needle: str) -> list[int]:
    """Start offsets of the non-overlapping occurrences of ``needle`` in ``text``."""
    out, at = [], text.find(needle)
    while at >= 0:
        out.append(at)
        at = text.find(needle, at + len(needle))
    return out


def chat_renderer(tokenizer: Any, policy: str = "auto", reasoning_parser: str | None = None,
                  template_kwargs: dict[str, Any] | None = None,
                  check: Callable[[Conversation, int, list[int]], None] | None = None
                  ) -> ChatRenderer | None:
    """The renderer for chat rows, or None when the tokenizer has no chat template.

    Think markers come from SGLang's reasoning parser ``reasoning_parser`` (the server's
    ``--reasoning-parser``); without one, ``<think>`` / ``</think>`` when both are tokens.
    ``template_kwargs`` are passed to every chat-template rendering, as the request's
    ``chat_template_kwargs`` are by SGLang (e.g. ``{"thinking": false}``). ``check`` sees each
    trained turn's prompt ids (:class:`ChatRenderer`).
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    think = ThinkMarkers.from_reasoning_parser(reasoning_parser) if reasoning_parser else None
    return ChatRenderer(tokenizer, think, policy, template_kwargs, check)
