"""Rows that quote the chat format's own markers still give each turn whole (issue 16).

The tiny Kimi-K2.5 tokenizer (Kimi-style custom tiktoken code, tests/harness/kimi) turns the
text ``<|im_assistant|>assistant<|im_middle|>`` into the assistant header tokens themselves, so
a renderer that looks for the header in rendered text finds it inside a message. Expectations are
spelled out as Kimi-K2.5's wire format (tests/harness/kimi_wire.py), token by token.
"""

from __future__ import annotations

import json

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.client.rows.conversation import (
    ChatRenderer,
    ConversationError,
    parse_conversation,
)
from tests.harness.kimi_wire import GEN, SYSTEM, emitted, expected, past, user

HEADER = "<|im_assistant|>assistant<|im_middle|>"


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


def _agent_trace(call, tool_result) -> dict:
    """A 30-message agent trace: a query, 14 thinking tool-call turns each answered by a tool
    result (quoting markers now and then), and a final answer."""
    msgs = [{"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "Plan a trip: check the weather in 14 cities."}]
    for n in range(14):
        msgs += [{"role": "assistant", "content": "" if n % 3 else f"City {n}.",
                  "reasoning_content": f"Step {n}: next city." + (" 想" if n % 4 == 0 else ""),
                  "tool_calls": [call(n, f"C{n}")]},
                 tool_result(n, f"{n} degrees" + (f" {THINK}" if n == 5 else ""))]
    msgs.append({"role": "assistant", "content": "All checked 🙂", "reasoning_content": "Done."})
    return {"id": "agent-30", "tools": TOOLS, "messages": msgs}


def _kimi_tool(n: int, text: str) -> dict:
    return {"role": "tool", "tool_call_id": f"functions.get_weather:{n}", "content": text}


ADVERSARIAL.append((_agent_trace(_call, _kimi_tool), None))

Q_HEADER = "<|im_start|>assistant\n"


def _q_call(n: int, city: str) -> dict:
    return {"id": f"call_{n}", "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


def _q_tool(n: int, text: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{n}", "content": text}


# The same shapes for the Qwen3-style template (ChatML markers quoted, enable_thinking).
QWEN3_STYLE = [
    ({"id": "quotes-no-system", "messages": [
        {"role": "user", "content": f"Say {Q_HEADER} and {THINK} and </think> and <|im_end|>."},
        {"role": "assistant", "content": f"{Q_HEADER} then </think> 好 🙂",
         "reasoning_content": f"Quote {Q_HEADER} 想"},
        {"role": "user", "content": "再来 🎉"},
        {"role": "assistant", "content": "Done."},
    ]}, None),
    ({"id": "parallel-calls-null-content", "tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Paris and"},
                                     {"type": "text", "text": "东京?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Two calls.",
         "tool_calls": [_q_call(0, "Paris"), _q_call(1, "东京")]},
        _q_tool(0, f"rain {THINK} {Q_HEADER} <|im_end|>"),
        _q_tool(1, "sun ☀️"),
        {"role": "assistant", "content": "Checking once more.", "reasoning_content": "Again.",
         "tool_calls": [_q_call(2, "Paris")]},
        _q_tool(2, "still rain"),
    ]}, None),
    ({"id": "named-assistant", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "name": "qwen", "content": "Hello!", "reasoning_content": "Greet."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "name": "qwen", "content": "Bye!"},
    ]}, None),
    ({"id": "thinking-off", "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": f"And {Q_HEADER}?"},
        {"role": "assistant", "content": "5"},
    ]}, {"enable_thinking": False}),
    (_agent_trace(_q_call, _q_tool), None),
]

# server fixture: corpus, SGLang reasoning parser, SGLang tool-call detector, HF reference
SERVED = {
    "kimi_server": (ADVERSARIAL, "kimi_k2", "KimiK2Detector",
                    lambda request: request.getfixturevalue("tiny_kimi")[1]),
    "qwen3_style_server": (QWEN3_STYLE, "qwen3", "Qwen25Detector",
                           lambda request: request.getfixturevalue("qwen3_style_server").model),
}


def _served_prompt(url: str, row: dict, k: int, kwargs: dict | None) -> list[int]:
    """The prompt ids SGLang serves for the row's messages before ``k``, from its chat
    completions endpoint (``return_prompt_token_ids``), not the /v1/tokenize the client uses."""
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


def _parsed(tok, ids: list[int], opened: bool, tools: list[dict] | None, parser: str,
            detector: str) -> dict:
    """The assistant message SGLang's own reasoning and tool-call parsers read from the
    emitted ``ids`` (which end with the stop token, as generation does)."""
    import importlib

    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    module = {"KimiK2Detector": "kimik2_detector", "Qwen25Detector": "qwen25_detector"}[detector]
    detect = getattr(importlib.import_module(f"sglang.srt.function_call.{module}"), detector)()
    text = tok.decode(ids)
    assert text.endswith("<|im_end|>"), text
    text = (THINK if opened else "") + text[: -len("<|im_end|>")]
    reasoning, rest = ReasoningParser(parser).parse_non_stream(text)
    calls = detect.detect_and_parse(rest or "", [Tool.model_validate(t) for t in tools or []])
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
@pytest.mark.parametrize("served", sorted(SERVED))
def test_every_trained_turn_follows_the_servers_own_prompt(served, request, tmp_path):
    """``hsdump extract`` of an adversarial corpus (quoted markers, Chinese and emoji, parallel
    tool calls with null content, rows ending on a tool result, no system prompt, list-of-parts
    content, assistant names, thinking off, a 30-message agent trace) through a Kimi-K2.5 and a
    Qwen3-style server (the latter's template given by --chat-template). For every record:
    each trained run starts right after exactly the prompt ids SGLang serves for that turn (its
    /v1/chat/completions ``return_prompt_token_ids``), is exactly the turn as the model emits it
    (SGLang's own reasoning and tool-call parsers give the message back), and every value is the
    HF fp32 reference rounded to the records' bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hsdump_patch.cli import main as cli
    from hsdump_patch.reader import iter_records

    corpus, parser, detector, hf_path = SERVED[served]
    server = request.getfixturevalue(served)
    tok = AutoTokenizer.from_pretrained(server.model, trust_remote_code=True)
    info = protocol.read_server_info(server.dump_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_path(request), dtype=torch.float32).eval()
    trained_turns, worst = 0, 0.0
    for row, kwargs in corpus:  # one extraction per template-options setting
        dataset = tmp_path / f"{row['id']}.jsonl"
        dataset.write_text(json.dumps(row) + "\n")
        out = tmp_path / row["id"]
        args = ["extract", "--server", server.url, "--dump-dir", str(server.dump_dir),
                "--dataset", str(dataset), "--out", str(out), "--no-progress"]
        assert cli(args + (["--chat-template-kwargs", json.dumps(kwargs)] if kwargs else [])
                   ) == 0, row["id"]
        report = json.loads((out / "report.shard-0-of-1.json").read_text())
        got = dict(iter_records(out))
        conv_turns = [k for k, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        found = []
        for sid, rec in sorted(got.items()):
            ids, mask = rec["input_ids"].tolist(), rec["loss_mask"].tolist()
            runs = _runs(mask)
            ks = conv_turns if len(got) == 1 else [
                int(sid.split("#")[1]) if "#" in sid else conv_turns[0]]
            assert len(runs) == len(ks), (served, sid)
            for k, (a, b) in zip(ks, runs, strict=True):
                assert ids[:a] == _served_prompt(server.url, row, k, kwargs), (served, sid, k)
                msg = row["messages"][k]
                want = {"reasoning": "" if kwargs else (msg.get("reasoning_content") or ""
                                                        ).strip(),
                        "content": (msg["content"] or "").strip(),
                        "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                  for c in msg.get("tool_calls") or []]}
                opened = tok.decode(ids[:a]).endswith(THINK)
                assert _parsed(tok, ids[a:b], opened, row.get("tools"), parser, detector
                               ) == want, (served, sid, k)
                found.append(k)
            with torch.no_grad():
                o = hf.model(torch.tensor([ids]), output_hidden_states=True)
            refs = [o.hidden_states[x][0] for x in info.layers] + [o.last_hidden_state[0]]
            states = [*rec["hidden_states"], rec["final_hidden_state"]]
            for state, ref in zip(states, refs, strict=True):
                err = (state.float() - ref).abs() / (ref.abs() * 2 ** -8 + 1e-6)
                worst = max(worst, err.max().item())
        assert sorted(found) == conv_turns, (served, row["id"])
        assert report["prompts_checked_by_server"] == len(found), (served, row["id"])
        trained_turns += len(found)
    print(f"{served}: {trained_turns} turns, worst |record - HF fp32| = {worst:.3f} half-ulps")
    assert worst <= 1.0


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

    from hsdump_patch.client.rows.conversation import served_tools

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


LOOPS = [
    "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for message in messages %}{% for p in message.content | list %}{{ p }}{% endfor %}"
    "{% endfor %}",
    "{% for msg in messages %}{% for p in msg.content[1:] %}{{ p }}{% endfor %}{% endfor %}",
    "{% for x in messages %}{% for p in x.content %}{{ p }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{# vision #}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if %}",
]


def test_content_format_is_sglangs():
    """Which templates get a list of text parts joined with " " (string) or passed as a list
    (openai) is decided as SGLang 0.5.23 decides it, on real and edge-case templates."""
    from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format

    from hsdump_patch.client.rows.conversation import content_format
    from hsdump_patch.ops.verify_model import CHAT_TEMPLATE
    from tests.harness.make_models import KIMI_DIR, QWEN3_STYLE_TEMPLATE

    templates = [CHAT_TEMPLATE, (KIMI_DIR / "chat_template.jinja").read_text(),
                 QWEN3_STYLE_TEMPLATE.read_text(), *LOOPS]
    got = [content_format(t) for t in templates]
    assert got == [detect_jinja_template_content_format(t) for t in templates]
    assert set(got) == {"string", "openai"}


def test_follow_chat_template(tmp_path):
    """The server's --chat-template file is what local rendering uses (read as SGLang reads
    it); a built-in name or an unreadable file is refused with what to do."""
    from types import SimpleNamespace

    from hsdump_patch.client.server.tokenizer import follow_chat_template

    tok = SimpleNamespace(chat_template="own")
    assert follow_chat_template(tok, {"chat_template": None}) is None and tok.chat_template == "own"
    path = tmp_path / "t.jinja"
    path.write_text("\n{{ messages[0].content }}\\n<end>\n\n")
    assert follow_chat_template(tok, {"chat_template": str(path)}) == str(path)
    assert tok.chat_template == "{{ messages[0].content }}\n<end>"
    with pytest.raises(ValueError, match="built-in SGLang template"):
        follow_chat_template(tok, {"chat_template": "chatml"})
    with pytest.raises(ValueError, match="cannot read: run hsdump where that file is"):
        follow_chat_template(tok, {"chat_template": str(tmp_path / "gone.jinja")})


@pytest.mark.server
def test_a_prompt_the_server_would_not_serve_is_refused(qwen3_style_server):
    """Rendered with the tokenizer's own template while the server was given another one, the
    prompt differs from the server's: the turn is refused, naming where, never written."""
    from transformers import AutoTokenizer

    from hsdump_patch.client.server.api import ServerClient
    from hsdump_patch.client.server.served import ServedPrompts
    from hsdump_patch.client.server.tokenizer import follow_chat_template

    tok = AutoTokenizer.from_pretrained(qwen3_style_server.model)
    client = ServerClient(qwen3_style_server.url, request_timeout=60, retries=0, retry_wait=1)
    check = ServedPrompts(client.tokenize_chat, None)
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    with pytest.raises(ConversationError, match=r"messages\[1\]: the prompt rendered here "
                       "differs from the one the server serves for this turn"):
        ChatRenderer(tok, check=check).render(parse_conversation(row))
    assert check.checked == 1
    # Following the server's template, the same row passes the same check.
    follow = ServedPrompts(client.tokenize_chat, None)
    follow_chat_template(tok, client.server_args())
    (sample,) = ChatRenderer(tok, check=follow).render(parse_conversation(row))
    assert follow.checked == 1 and sum(sample.loss_mask) > 0
