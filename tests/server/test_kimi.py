"""A tiny Kimi-K2.5 end to end: real-shaped agent / thinking rows -> serving-faithful samples.

The expectations are written independently of the chat template and of the renderer: each
sample is spelled out as Kimi-K2.5's wire format (the segments below), the prompt part as the
template renders the conversation before a turn with the generation prompt (which opens
``<think>``), the trained part as the model emits the turn after it: reasoning, ``</think>``,
content, tool-call section, ``<|im_end|>``.
"""

from __future__ import annotations

import json

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.cli import main as cli
from hsdump_patch.client import records
from hsdump_patch.client.conversation import ChatRenderer, parse_conversation
from hsdump_patch.reader import iter_records
from tests.harness.kimi_wire import GEN, SYSTEM, emitted, expected, past, user

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


@pytest.fixture(scope="module")
def kimi_tokenizer(tiny_kimi):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)


def test_kimi_tokenizer_is_kimis_custom_code_with_its_special_layout(kimi_tokenizer):
    tok = kimi_tokenizer
    assert type(tok).__name__ == "TikTokenTokenizer"
    base = len(tok.model._mergeable_ranks)
    for text, off in (("<|im_end|>", 2), ("<|im_assistant|>", 4), ("<|im_middle|>", 17),
                      ("<think>", 22), ("</think>", 23), ("<|tool_calls_section_begin|>", 11)):
        assert tok.encode(text, add_special_tokens=False) == [base + off]


@pytest.mark.parametrize(("row", "want"), BATTERY, ids=[r["id"] for r, _ in BATTERY])
def test_battery_of_real_shaped_rows_masks_token_by_token(kimi_tokenizer, row, want):
    samples = ChatRenderer(kimi_tokenizer).render(parse_conversation(row))
    assert [s.suffix for s in samples] == [suffix for suffix, _ in want]
    for sample, (_, segments) in zip(samples, want, strict=True):
        ids, mask = expected(kimi_tokenizer, segments)
        assert sample.input_ids == ids
        assert sample.loss_mask == mask


def test_multi_turn_policies(kimi_tokenizer):
    row = BATTERY[2][0]  # prefix-stable: auto gives one sample
    conv = parse_conversation(row)
    (auto,) = ChatRenderer(kimi_tokenizer, policy="auto").render(conv)
    first, second = ChatRenderer(kimi_tokenizer, policy="per-turn").render(conv)
    (last,) = ChatRenderer(kimi_tokenizer, policy="last").render(conv)
    assert (first.suffix, second.suffix) == ("", "#4")
    assert last.input_ids == second.input_ids == auto.input_ids
    assert last.loss_mask == second.loss_mask
    assert sum(auto.loss_mask) == sum(first.loss_mask) + sum(second.loss_mask)


def test_regenerated_token_ids_are_the_completion_verbatim(kimi_tokenizer):
    tok = kimi_tokenizer
    generated = tok.encode(emitted("Hm.", "Yes"), add_special_tokens=False)
    row = {"messages": [{"role": "user", "content": "Hello world"},
                        {"role": "assistant", "content": "ignored", "token_ids": generated}]}
    (sample,) = ChatRenderer(tok).render(parse_conversation(row))
    prompt = tok.encode(SYSTEM + user("Hello world") + GEN, add_special_tokens=False)
    assert sample.input_ids == prompt + generated
    assert sample.loss_mask == [0] * len(prompt) + [1] * len(generated)


@pytest.mark.server
def test_tiny_kimi_k25_end_to_end_in_both_formats(tmp_path, kimi_server, tiny_kimi,
                                                  kimi_tokenizer):
    """The battery through ``hsdump extract`` against the served Kimi-K2.5 (float32): every
    record's tokens and mask equal the expectation, every layer and the final state equal
    HF transformers' float32 DeepSeek-V3 forward of the same language-model weights, rounded
    to the records' bfloat16."""
    from transformers import AutoModelForCausalLM

    dataset = tmp_path / "battery.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row, _ in BATTERY))
    want = {row["id"] + suffix: expected(kimi_tokenizer, segments)
            for row, samples in BATTERY for suffix, segments in samples}
    info = protocol.read_server_info(kimi_server.dump_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_kimi[1], dtype=torch.float32).eval()
    refs = {}
    worst = 0.0
    for fmt in records.FORMATS:
        out = tmp_path / fmt
        assert cli(["extract", "--server", kimi_server.url, "--dump-dir",
                    str(kimi_server.dump_dir), "--dataset", str(dataset), "--out", str(out),
                    "--format", fmt, "--no-progress"]) == 0
        got = dict(iter_records(out))
        assert sorted(got) == sorted(want)
        # Issue 16.9: the report says which rows auto split into per-turn samples, and why.
        report = json.loads((out / "report.shard-0-of-1.json").read_text())
        assert report["per_turn_fallbacks"] == 1 and report["fallback_rows"] == ["agent-trace"]
        assert report["trained_tokens"] == sum(sum(m) for _, m in want.values())
        assert report["longest"]["tokens"] == max(len(i) for i, _ in want.values())
        for sid, rec in got.items():
            ids, mask = want[sid]
            if fmt == "eagle3":
                layers, final = rec["hidden_states"], rec["final_hidden_state"]
                assert rec["input_ids"].tolist() == ids and rec["loss_mask"].tolist() == mask
            else:  # SpecForge: batch dimension, layers concatenated in ascending order
                layers = rec["aux_hidden_state"][0].split(info.hidden_size, dim=-1)
                final = rec["hidden_state"][0]
                assert rec["input_ids"].flatten().tolist() == ids
                assert rec["loss_mask"].flatten().tolist() == mask
            if sid not in refs:
                with torch.no_grad():
                    o = hf.model(torch.tensor([ids]), output_hidden_states=True)
                refs[sid] = ([h[0] for h in o.hidden_states], o.last_hidden_state[0])
            states, hf_final = refs[sid]
            order = info.layers if fmt == "eagle3" else sorted(info.layers)
            pairs = [*zip(layers, (states[x] for x in order), strict=True), (final, hf_final)]
            for got_state, ref in pairs:
                # Records hold bfloat16: each value must be the fp32 reference rounded to it.
                err = (got_state.float() - ref).abs() / (ref.abs() * 2 ** -8 + 1e-6)
                worst = max(worst, err.max().item())
    print(f"worst |record - HF fp32| in bf16 half-ulps = {worst:.3f}")
    assert worst <= 1.0

    # Resume after a crash between the samples of one row: the missing one is extracted.
    out = tmp_path / "eagle3"
    manifest = out / "manifest.shard-0-of-1.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    (lost,) = [json.loads(x) for x in lines if json.loads(x)["id"] == "agent-trace#5"]
    manifest.write_text("".join(x for x in lines if json.loads(x)["id"] != "agent-trace#5"))
    (out / lost["file"]).unlink()
    assert cli(["extract", "--server", kimi_server.url, "--dump-dir", str(kimi_server.dump_dir),
                "--dataset", str(dataset), "--out", str(out), "--no-progress"]) == 0
    again = dict(iter_records(out))
    assert sorted(again) == sorted(want)
    assert again["agent-trace#5"]["input_ids"].tolist() == want["agent-trace#5"][0]
