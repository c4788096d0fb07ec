"""Rows that quote the chat format's own markers still give each turn whole (issue 16).

The tiny Kimi-K2.5 tokenizer (Kimi-style custom tiktoken code, tests/harness/kimi) turns the
text ``<|im_assistant|>assistant<|im_middle|>`` into the assistant header tokens themselves, so
a renderer that looks for the header in rendered text finds it inside a message. Expectations are
spelled out as Kimi-K2.5's wire format (tests/test_kimi.py), token by token.
"""

from __future__ import annotations

import json

import pytest

from hsdump_patch.client.conversation import (
    ChatRenderer,
    ConversationError,
    parse_conversation,
)
from tests.test_kimi import GEN, SYSTEM, emitted, expected, past, user

HEADER = "<|im_assistant|>assistant<|im_middle|>"


@pytest.fixture(scope="module")
def kimi_tokenizer(tiny_kimi):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)


QUOTED = [
    ({"id": "quoted-once", "messages": [
        {"role": "user", "content": f"Print {HEADER} verbatim."},
        {"role": "assistant", "content": f"Here: {HEADER} and more.",
         "reasoning_content": f"They want {HEADER} shown."},
    ]}, [("", [(SYSTEM + user(f"Print {HEADER} verbatim.") + GEN, 0),
               (emitted(f"They want {HEADER} shown.", f"Here: {HEADER} and more."), 1)])]),
    ({"id": "quoted-multi-turn", "messages": [
        {"role": "user", "content": f"{HEADER}?"},
        {"role": "assistant", "content": f"It is {HEADER}, the header."},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": f"{HEADER}"},
    ]}, [("", [(SYSTEM + user(f"{HEADER}?") + GEN, 0),
               (emitted("", f"It is {HEADER}, the header."), 1)]),
         ("#3", [(SYSTEM + user(f"{HEADER}?") + past(f"It is {HEADER}, the header.")
                  + user("Again") + GEN, 0), (emitted("", HEADER), 1)])]),
]


@pytest.mark.parametrize(("row", "want"), QUOTED, ids=[r["id"] for r, _ in QUOTED])
@pytest.mark.parametrize("policy", ["auto", "per-turn"])
def test_quoted_header_keeps_every_turn_whole(kimi_tokenizer, row, want, policy):
    samples = ChatRenderer(kimi_tokenizer, policy=policy).render(parse_conversation(row))
    assert [s.suffix for s in samples] == [suffix for suffix, _ in want]
    for sample, (_, segments) in zip(samples, want, strict=True):
        ids, mask = expected(kimi_tokenizer, segments)
        assert sample.input_ids == ids
        assert sample.loss_mask == mask


THINK = "<think>"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city (天气)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _call(n: int, city: str) -> dict:
    return {"id": f"functions.get_weather:{n}", "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


# (row, chat_template_kwargs): short rows, each with a shape the renderer must keep faithful.
ADVERSARIAL = [
    ({"id": "quotes-no-system", "messages": [
        {"role": "user", "content": f"Say {HEADER} and {THINK} and </think> and <|im_end|>."},
        {"role": "assistant", "content": f"{HEADER} then </think> 好 🙂",
         "reasoning_content": f"Quote {HEADER} 想"},
        {"role": "user", "content": "再来 🎉"},
        {"role": "assistant", "content": "Done."},
    ]}, None),
    ({"id": "parallel-calls-null-content", "tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Paris and "},
                                     {"type": "text", "text": "东京?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Two calls.",
         "tool_calls": [_call(0, "Paris"), _call(1, "东京")]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0",
         "content": f"rain {THINK} {HEADER} <|im_end|>"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "sun ☀️"},
        {"role": "assistant", "content": "Checking once more.", "reasoning_content": "Again.",
         "tool_calls": [_call(2, "Paris")]},
        {"role": "tool", "tool_call_id": "functions.get_weather:2", "content": "still rain"},
    ]}, None),
    ({"id": "named-assistant", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "name": "kimi", "content": "Hello!", "reasoning_content": "Greet."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "name": "kimi", "content": "Bye!"},
    ]}, None),
    ({"id": "thinking-off", "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": f"And {HEADER}?"},
        {"role": "assistant", "content": "5"},
    ]}, {"thinking": False}),
]


def _served_prompt(url: str, row: dict, k: int, kwargs: dict | None) -> list[int]:
    """The prompt ids SGLang serves for the row's messages before ``k`` (its own rendering)."""
    import requests

    body = {"model": "default", "messages": row["messages"][:k], "max_tokens": 1,
            "return_prompt_token_ids": True}
    if row.get("tools"):
        body["tools"] = row["tools"]
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_token_ids"]


def _parsed(tok, ids: list[int], opened: bool, tools: list[dict] | None) -> dict:
    """The assistant message SGLang's own Kimi-K2 parsers read from the emitted ``ids``."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.kimik2_detector import KimiK2Detector
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    text = tok.decode(ids)
    assert text.endswith("<|im_end|>")
    text = (THINK if opened else "") + text[: -len("<|im_end|>")]
    reasoning, rest = ReasoningParser("kimi_k2").parse_non_stream(text)
    calls = KimiK2Detector().detect_and_parse(
        rest or "", [Tool.model_validate(t) for t in tools or []])
    return {"reasoning": (reasoning or "").strip(), "content": calls.normal_text.strip(),
            "calls": [(c.name, json.loads(c.parameters)) for c in calls.calls]}


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.server
def test_every_trained_turn_follows_the_servers_own_prompt(kimi_server, kimi_tokenizer):
    """For each record of an adversarial corpus: the ids before every trained run are exactly
    what SGLang 0.5.23 serves for that turn's request (its /v1/chat/completions rendering,
    ``return_prompt_token_ids``), and the run is exactly the turn as the model emits it (SGLang's
    own Kimi-K2 reasoning and tool-call parsers give the message back)."""
    tok = kimi_tokenizer
    for row, kwargs in ADVERSARIAL:
        conv = parse_conversation(row)
        renderer = ChatRenderer(tok, template_kwargs=kwargs)
        samples = renderer.render(conv)
        turns = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"]
        trained = []  # (turn index, ids before the run, the run's ids)
        for s in samples:
            runs = _runs(s.loss_mask)
            ks = turns if len(samples) == 1 else [int(s.suffix[1:]) if s.suffix else turns[0]]
            assert len(runs) == len(ks), (row["id"], s.suffix)
            trained += [(k, s.input_ids[:a], s.input_ids[a:b])
                        for k, (a, b) in zip(ks, runs, strict=True)]
        assert sorted({k for k, _, _ in trained}) == turns, row["id"]
        for k, before, run in trained:
            assert before == _served_prompt(kimi_server.url, row, k, kwargs), (row["id"], k)
            msg = conv.messages[k]
            want = {"reasoning": "" if kwargs else (msg.get("reasoning_content") or "").strip(),
                    "content": (msg["content"] or "").strip(),
                    "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                              for c in msg.get("tool_calls") or []]}
            assert _parsed(tok, run, not kwargs, row.get("tools")) == want, (row["id"], k)


def test_named_assistant_turns_are_rendered_not_rejected(kimi_tokenizer):
    """A ``name`` on an assistant message: later prompts show it (Kimi-K2.5 prints it in the
    header), the turn itself is what the model writes after the generation prompt."""
    row = {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "name": "kimi", "content": "Hello!", "reasoning_content": "Greet."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "name": "kimi", "content": "Bye!"},
    ]}
    named_past = "<|im_assistant|>kimi<|im_middle|><think></think>Hello!<|im_end|>"
    want = [("", [(SYSTEM + user("Hi") + GEN, 0), (emitted("Greet.", "Hello!"), 1)]),
            ("#3", [(SYSTEM + user("Hi") + named_past + user("Bye") + GEN, 0),
                    (emitted("", "Bye!"), 1)])]
    samples = ChatRenderer(kimi_tokenizer).render(parse_conversation(row))
    assert [s.suffix for s in samples] == [suffix for suffix, _ in want]
    for sample, (_, segments) in zip(samples, want, strict=True):
        assert (sample.input_ids, sample.loss_mask) == expected(kimi_tokenizer, segments)


def test_kimi_tokenizer_is_called_as_sglang_calls_it(kimi_tokenizer, monkeypatch):
    """SGLang 0.5.23 encodes a rendered chat prompt with no keyword for a tokenizer that adds
    no specials by itself; Kimi's ``TikTokenTokenizer`` with ``add_special_tokens=False`` takes
    the slow generic path instead (and warns on every call)."""
    tok = kimi_tokenizer
    calls: list[dict] = []
    plain = tok.encode

    def spy(text, *args, **kwargs):
        calls.append(kwargs)
        return plain(text, *args, **kwargs)

    def decode_spy(ids, *args, **kwargs):
        calls.append(kwargs)
        return plain_decode(ids, *args, **kwargs)

    generated = tok.encode(emitted("Hm.", "Yes"))
    plain_decode = tok.decode
    monkeypatch.setattr(tok, "encode", spy)
    monkeypatch.setattr(tok, "decode", decode_spy)
    regenerated = {"messages": [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Yes", "token_ids": generated}]}
    for row in (QUOTED[1][0], regenerated):
        ChatRenderer(tok).render(parse_conversation(row))
    assert calls and all(not kw for kw in calls)


GEN_OFF = "<|im_assistant|>assistant<|im_middle|><think></think>"  # thinking=false
THINKING_OFF = {"id": "thinking-off", "messages": [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]}
THINKING_OFF_WANT = [
    (SYSTEM + user("2+2?") + GEN_OFF, 0), ("4<|im_end|>", 1),
    (user("And 3+3?") + GEN_OFF, 0), ("6<|im_end|>", 1)]


def test_template_kwargs_reach_every_rendering(kimi_tokenizer):
    """``{"thinking": false}`` (Kimi-K2.5 instant mode): every prompt ends with the closed
    empty think block and each turn is the answer alone."""
    (sample,) = ChatRenderer(kimi_tokenizer, template_kwargs={"thinking": False}).render(
        parse_conversation(THINKING_OFF))
    assert (sample.input_ids, sample.loss_mask) == expected(kimi_tokenizer, THINKING_OFF_WANT)
    # Reasoning in a thinking-off turn is not what the model emits there: the row is refused.
    thought = {"messages": [*THINKING_OFF["messages"][:3],
                            {"role": "assistant", "content": "6", "reasoning_content": "Hm."}]}
    with pytest.raises(ConversationError, match="turns thinking off"):
        ChatRenderer(kimi_tokenizer, template_kwargs={"thinking": False}).render(
            parse_conversation(thought))


def test_extract_help_states_the_template_kwargs_default(capsys):
    from hsdump_patch.cli import main as cli

    with pytest.raises(SystemExit):
        cli(["extract", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--chat-template-kwargs" in text and "(default: none)" in text


@pytest.mark.server
def test_extract_with_chat_template_kwargs(tmp_path, kimi_server, kimi_tokenizer):
    """``hsdump extract --chat-template-kwargs`` renders with them and records them."""
    from hsdump_patch.cli import main as cli
    from hsdump_patch.reader import iter_records

    dataset = tmp_path / "off.jsonl"
    dataset.write_text(json.dumps(THINKING_OFF) + "\n")
    out = tmp_path / "out"
    assert cli(["extract", "--server", kimi_server.url, "--dump-dir", str(kimi_server.dump_dir),
                "--dataset", str(dataset), "--out", str(out), "--no-progress",
                "--chat-template-kwargs", '{"thinking": false}']) == 0
    (rec,) = dict(iter_records(out)).values()
    ids, mask = expected(kimi_tokenizer, THINKING_OFF_WANT)
    assert rec["input_ids"].tolist() == ids and rec["loss_mask"].tolist() == mask
    meta = json.loads((out / "hsdump-meta.json").read_text())
    assert meta["chat_template_kwargs"] == {"thinking": False}


def test_tools_are_declared_as_sglangs_request_model_dumps_them():
    """Key for key and in order, what SGLang's own ``Tool.model_dump()`` hands the template."""
    from sglang.srt.entrypoints.openai.protocol import Tool

    from hsdump_patch.client.conversation import served_tools

    tools = [
        TOOLS[0],
        {"type": "function", "function": {"parameters": {"type": "object"}, "name": "a",
                                          "extra": 1}},
        {"function": {"name": "b", "strict": True, "description": "d"}, "defer_loading": True},
        {"type": "function", "function": {"name": "c", "defer_loading": False, "strict": None}},
    ]
    want = [Tool.model_validate(t).model_dump() for t in tools]
    assert json.dumps(served_tools(tools)) == json.dumps(want)
    assert json.dumps(served_tools(served_tools(tools))) == json.dumps(want)
