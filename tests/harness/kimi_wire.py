"""Test-only: Kimi-K2.5's wire format spelled out segment by segment (independent of the chat
template and of the renderer), the (ids, loss mask) a list of segments tokenizes to, and a
battery of real-shaped rows (every shape of issue 9) with the samples each must give."""

from __future__ import annotations

import json

SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"  # noqa: E501
GEN = "<|im_assistant|>assistant<|im_middle|><think>"


def user(text: str) -> str:
    return f"<|im_user|>user<|im_middle|>{text}<|im_end|>"


def past(content: str, section: str = "", reasoning: str = "") -> str:
    """An earlier assistant turn as the template renders it in a later prompt."""
    return f"<|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{content}{section}<|im_end|>"  # noqa: E501


def emitted(reasoning: str, content: str, section: str = "") -> str:
    """An assistant turn as the model generates it after GEN."""
    return f"{reasoning}</think>{content}{section}<|im_end|>"


def expected(tok, segments) -> tuple[list[int], list[int]]:
    ids, mask = [], []
    for text, trained in segments:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        mask += [trained] * len(seg)
    return ids, mask


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _sorted(obj):
    if isinstance(obj, dict):
        return {k: _sorted(v) for k, v in sorted(obj.items())}
    return [_sorted(v) for v in obj] if isinstance(obj, list) else obj


def tools_decl(tools) -> str:
    """The declaration as served: SGLang's chat API dumps each tool through its request model."""
    from sglang.srt.entrypoints.openai.protocol import Tool

    served = [Tool.model_validate(t).model_dump() for t in tools]
    return ("<|im_system|>tool_declare<|im_middle|>"
            + json.dumps(_sorted(served), separators=(",", ":")) + "<|im_end|>")


def system(text: str) -> str:
    return f"<|im_system|>system<|im_middle|>{text}<|im_end|>"


def tool(call_id: str, text: str) -> str:
    return f"<|im_system|>tool<|im_middle|>## Return of {call_id}\n{text}<|im_end|>"


def calls(*items: tuple[str, str]) -> str:
    return ("<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
        for i, a in items) + "<|tool_calls_section_end|>")


WEATHER_CALL = calls(("functions.get_weather:0", '{"city": "Paris"}'))


# (row, [(sample id suffix, [(text, trained), ...]), ...]): every shape of issue 9.
BATTERY = [
    ({"id": "tool-null-content", "system": "Be brief.", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I need the tool.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C, rain"},
        {"role": "assistant", "content": "Rainy, 18C.", "reasoning_content": "Tool says rain."},
    ]}, [("", [(tools_decl(TOOLS) + system("Be brief.") + user("Weather in Paris?") + GEN, 0),
               (emitted("I need the tool.", "", WEATHER_CALL), 1),
               (tool("functions.get_weather:0", "18C, rain") + GEN, 0),
               (emitted("Tool says rain.", "Rainy, 18C."), 1)])]),
    ({"id": "list-of-parts", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is "},
                                     {"type": "text", "text": "2+3?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "5"}]},
    ]}, [("", [(SYSTEM + user("What is 2+3?") + GEN, 0), (emitted("", "5"), 1)])]),
    ({"id": "sharegpt-from-value", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "Hello world"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Capital of France?"},
        {"from": "gpt", "value": "Paris."},
    ]}, [("", [(system("You are terse.") + user("Hello world") + GEN, 0),
               (emitted("", "Hello!"), 1), (user("Capital of France?") + GEN, 0),
               (emitted("", "Paris."), 1)])]),
    ({"id": "sharegpt-role-content", "tools": [TOOLS[0]["function"]], "conversations": [
        {"role": "human", "content": "Weather in Paris?"},
        {"role": "gpt", "content": "Checking.", "tool_calls": [CALL]},
    ]}, [("", [(tools_decl(TOOLS) + SYSTEM + user("Weather in Paris?") + GEN, 0),
               (emitted("", "Checking.", WEATHER_CALL), 1)])]),
    ({"id": "assistant-first", "messages": [
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Easy."},
    ]}, [("", [(SYSTEM + past("Hi, how can I help?") + user("Say hello") + GEN, 0),
               (emitted("Easy.", "Hello!"), 1)])]),
    # A thinking agent trace over two user turns: the final answer of the first turn makes the
    # template drop the earlier reasoning, so each turn is its own serving-time sample.
    ({"id": "agent-trace", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
        {"role": "assistant", "content": "It rains.", "reasoning_content": "It says rain."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be nice."},
    ]}, [
        ("", [(tools_decl(TOOLS) + SYSTEM + user("Weather in Paris?") + GEN, 0),
              (emitted("Call the tool.", "", WEATHER_CALL), 1)]),
        ("#3", [(tools_decl(TOOLS) + SYSTEM + user("Weather in Paris?")
                 + past("", WEATHER_CALL, "Call the tool.") + tool(CALL["id"], "rain") + GEN, 0),
                (emitted("It says rain.", "It rains."), 1)]),
        ("#5", [(tools_decl(TOOLS) + SYSTEM + user("Weather in Paris?") + past("", WEATHER_CALL)
                 + tool(CALL["id"], "rain") + past("It rains.") + user("Thanks!") + GEN, 0),
                (emitted("Be nice.", "You are welcome."), 1)]),
    ]),
]
