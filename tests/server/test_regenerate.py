"""``hsdump regenerate`` against the session's real CPU SGLang server (tiny Llama, greedy).

Its rids lack the dump prefix, so the dump-enabled ``llama_server`` dumps nothing for them and
the same server then extracts the regenerated dataset. Prompts are short and
``--max-new-tokens`` small: the random-weight model rarely stops on its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from hsdump_patch.cli import main as cli
from hsdump_patch.client.output.rowlog import RowLog
from hsdump_patch.client.regenerate import (
    ROW_FIELD,
    RegenClient,
    Regenerator,
    RegenSettings,
    split_reasoning,
)
from hsdump_patch.client.rows.conversation import ThinkMarkers, decode, encode, prompt_ids
from hsdump_patch.client.rows.regen_plan import plan_row
from hsdump_patch.reader import iter_records
from tests.harness import server as srv
from tests.harness.dump_server import prefills, start_plain_server
from tests.harness.extraction import extract, read_report
from tests.harness.rows import CONV, openai_row, sharegpt_row, write_jsonl
from tests.harness.sglang_defaults import sglang_chat_defaults

REPO = Path(__file__).resolve().parents[2]
NEW = 6  # --max-new-tokens
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
AGENT = {"id": "agent", "tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris."},
]}


def rows_for(prefix: str = "") -> list[dict]:
    """Single- and multi-turn rows in both chat shapes, one ending in a user turn, one agent."""
    return [
        openai_row([("user", "What is the capital of France?")], id=f"{prefix}prompt-only"),
        openai_row(CONV, id=f"{prefix}multi"),
        sharegpt_row(CONV[1:3], id=f"{prefix}sharegpt"),
        openai_row(CONV[:4], id=f"{prefix}ends-with-user"),
        {**AGENT, "id": f"{prefix}agent"},
    ]


def regenerate(server, dataset: Path, out: Path, *extra: str, greedy: bool = True) -> int:
    return cli(["regenerate", "--server", server.url, "--dataset", str(dataset), "--out",
                str(out), "--max-new-tokens", str(NEW), "--no-progress",
                *(["--temperature", "0"] if greedy else []), *extra])


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def report_of(out: Path) -> dict:
    return json.loads(out.with_suffix(".report.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models / "tiny-llama")


def generate(server, ids: list[int]) -> list[int]:
    return server.server.generate(ids, max_new_tokens=NEW)["output_ids"]


@pytest.mark.server
def test_greedy_regeneration_is_deterministic_and_equals_generate(
        tmp_path, llama_server, tokenizer):
    """Twice the same bytes; every turn's token ids are what /generate gives for its prompt,
    and each later prompt holds the regenerated earlier turns."""
    rows = rows_for()
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for out in outs:
        assert regenerate(llama_server, dataset, out, "--concurrency", "4") == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    rep = report_of(outs[0])
    got = read_rows(outs[0])
    assert [r["id"] for r in got] == [r["id"] for r in rows]  # dataset order
    assert (rep["rows"], rep["failed"], rep["skipped"], rep["stopped"]) == (5, 0, 0, None)
    assert rep["turns"] == sum(len(r[ROW_FIELD]["turns"]) for r in got) and rep["tokens"] > 0
    assert rep["sampling"]["temperature"] == 0.0 and rep["sampling_source"]["temperature"] == "flag"

    for row, src in zip(got, rows, strict=True):
        meta, msgs = row[ROW_FIELD], row["messages"]
        assert "conversations" not in row
        for k, m in enumerate(msgs):
            if k in meta["turns"]:
                ids = prompt_ids(tokenizer, msgs[:k], row.get("tools"))
                assert m["token_ids"] == generate(llama_server, ids), (row["id"], k)
                assert len(m["token_ids"]) <= NEW
            else:
                assert "token_ids" not in m
        assert meta["cut"] == ("length" in meta["finish_reasons"])
        assert rep["cut_rows"].count(row["id"]) == int(meta["cut"])
        planned = plan_row(src, "t").turns
        assert meta["turns"] == planned[:len(meta["turns"])]
        if meta["cut"]:  # the row stops at its cut turn
            assert meta["finish_reasons"].index("length") == len(meta["turns"]) - 1
            assert len(msgs) == meta["turns"][-1] + 1 == meta["cut_at"] + 1
        else:
            assert meta["turns"] == planned
        if src["id"] == "multi" and len(meta["turns"]) == 2:
            assert msgs[2]["content"] != CONV[2][1]  # the prompt of turn 4 holds the new turn 2
    agent = got[-1]
    assert agent[ROW_FIELD]["policy"] == "last-turn" and agent[ROW_FIELD]["turns"] == [3]
    assert agent["messages"][:3] == AGENT["messages"][:3]  # original calls and results kept
    assert rep["agent_rows_last_turn"] == 1


@pytest.mark.server
def test_make_recipe_regenerates_then_extracts_in_both_formats(tmp_path, llama_server, tokenizer):
    """`make regenerate-extract` on one server, then the other format from the same output.
    Extraction uses the generated ids verbatim: the sample of a row's last regenerated turn is
    its prompt + the generated ids, masked exactly on those ids."""
    dataset = write_jsonl(tmp_path / "d.jsonl", rows_for("x-"))
    outs = {"eagle3": tmp_path / "eagle3", "specforge": tmp_path / "specforge"}
    r = subprocess.run(
        ["make", "-s", "regenerate-extract", f"SERVER={llama_server.url}",
         f"DUMP_DIR={llama_server.dump_dir}", f"DATASET={dataset}", f"OUT={outs['eagle3']}",
         f"REGENERATE_ARGS=--max-new-tokens {NEW} --concurrency 3"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    regen = outs["eagle3"] / "regenerated.jsonl"
    assert cli(["extract", "--server", llama_server.url, "--dump-dir", str(llama_server.dump_dir),
                "--dataset", str(regen), "--out", str(outs["specforge"]), "--format", "specforge",
                "--no-progress"]) == 0
    for fmt, out in outs.items():
        recs = dict(iter_records(out))
        for row in read_rows(regen):
            last = row[ROW_FIELD]["turns"][-1]
            msgs = row["messages"]
            want = prompt_ids(tokenizer, msgs[:last], row.get("tools"))
            gen = msgs[last]["token_ids"]
            # one sample per row, or one per turn (ids <id>, <id>#<turn>): H2's policy
            rec = recs.get(f"{row['id']}#{last}", recs[row["id"]])
            assert rec["input_ids"].reshape(-1).tolist() == want + gen, (fmt, row["id"])
            mask = rec["loss_mask"].reshape(-1).tolist()
            assert mask[len(want):] == [1] * len(gen), (fmt, row["id"])
            if sum(m["role"] == "assistant" for m in msgs) == 1:  # (kept turns train too)
                assert mask == [0] * len(want) + [1] * len(gen), (fmt, row["id"])


@pytest.mark.server
def test_kill_9_midway_then_rerun_gives_every_row_once(tmp_path, llama_server):
    rows = [openai_row([("user", f"Question {i}: what is the quick brown fox?")], id=f"k{i}")
            for i in range(16)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out.jsonl"
    flags = ["--dataset", str(dataset), "--out", str(out), "--max-new-tokens", "8",
             "--concurrency", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsdump_patch.cli", "regenerate", "--server", llama_server.url,
         "--no-progress", *flags], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    part = tmp_path / "out.jsonl.part"
    deadline = time.monotonic() + 240
    while not (part.exists() and part.read_bytes().count(b"\n") >= 2):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = part.read_bytes().count(b"\n")
    assert 2 <= first < len(rows), "the kill must land mid-run"
    with open(part, "ab") as f:  # and a line torn by a crash mid-write
        f.write(b'{"id": "k15", "messages": [{"role": "us')

    assert regenerate(llama_server, dataset, out, *flags[4:]) == 0  # the same command again
    got = read_rows(out)
    assert [row["id"] for row in got] == [row["id"] for row in rows]  # once each, in order
    assert all(row[ROW_FIELD]["turns"] == [1] for row in got)
    rep = report_of(out)
    assert rep["already_done"] >= first and rep["already_done"] + rep["rows"] == len(rows)
    assert sorted(p for p in os.listdir(tmp_path) if not p.endswith(".lock")) == [
        "d.jsonl", "out.jsonl", "out.report.json"]  # no part or temp file left


@pytest.mark.server
def test_bad_rows_are_reported_with_reasons_and_the_run_goes_on(tmp_path, llama_server, capsys):
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 500)  # > 4096 tokens
    rows = [
        openai_row([("user", "Hello world")], id="ok1"),
        openai_row([("system", "You are terse."), ("assistant", "Hi")], id="no-user"),
        openai_row([("user", "  "), ("assistant", "Hi")], id="empty"),
        {"id": "pretok", "input_ids": [1, 2], "loss_mask": [0, 1]},
        "{broken",
        openai_row([("user", long)], id="overflow"),
        openai_row([("user", "Hello again")], id="ok2"),
    ]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "skip.jsonl"
    assert regenerate(llama_server, dataset, out, "--on-error", "skip") == 3
    rep = report_of(out)
    assert (rep["rows"], rep["skipped"], rep["failed"], rep["stopped"]) == (2, 4, 1, None)
    reasons = {i["id"] or i["where"]: i["reason"] for i in rep["issues"]}
    assert "no user turn" in reasons["no-user"]
    assert "message 0 (user) has empty content" in reasons["empty"]
    assert "pre-tokenized row cannot be regenerated" in reasons["pretok"]
    assert "not valid JSON" in reasons[f"{dataset}:5"]
    assert "context overflow: the prompt has" in reasons["overflow"]
    assert [r["id"] for r in read_rows(out)] == ["ok1", "ok2"]
    assert "failed: " in capsys.readouterr().out

    out = tmp_path / "fail.jsonl"  # --on-error fail: stop at the first bad row
    assert regenerate(llama_server, dataset, out, "--on-error", "fail", "--concurrency", "1") == 1
    rep = report_of(out)  # lines that are not JSON are found first, before any request
    assert "not valid JSON" in rep["stopped"] and rep["rows"] == 0

    out = tmp_path / "timeout.jsonl"  # a server that does not answer in time
    assert regenerate(llama_server, dataset, out, "--on-error", "skip", "--request-timeout",
                      "0.05", "--max-new-tokens", "300") == 3
    rep = report_of(out)
    assert rep["rows"] == 0 and rep["failed"] == 3  # ok1, ok2 time out; overflow as before
    failed = {i["id"]: i["reason"] for i in rep["issues"] if i["id"] in ("ok1", "ok2", "overflow")}
    timed_out = {k for k, why in failed.items() if "within --request-timeout" in why}
    # the overflow row's prompt is the server's own (/v1/tokenize): on a loaded machine that
    # call may time out too, before the length is known
    assert {"ok1", "ok2"} <= timed_out and failed.keys() == {"ok1", "ok2", "overflow"}
    assert "overflow" in timed_out or "context overflow" in failed["overflow"]

    out = tmp_path / "http-error.jsonl"  # the server refuses the requests (top_p > 1)
    assert regenerate(llama_server, dataset, out, "--on-error", "skip", "--top-p", "5") == 3
    refused = {i["id"]: i["reason"] for i in report_of(out)["issues"] if "HTTP 400" in i["reason"]}
    assert refused.keys() == {"ok1", "ok2"} and "top_p" in refused["ok1"]


def test_a_server_that_is_down_stops_the_run_with_its_url(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", rows_for())
    url = f"http://127.0.0.1:{srv.free_port()}"
    assert cli(["regenerate", "--server", url, "--dataset", str(dataset), "--out",
                str(tmp_path / "o.jsonl"), "--retries", "1", "--retry-wait", "0.05"]) == 1
    assert f"the server at {url} is unreachable" in capsys.readouterr().err


@pytest.mark.server
def test_reasoning_and_tool_calls_go_through_sglangs_own_parsers(llama_server, tokenizer):
    """The server's /separate_reasoning and /parse_function_call split an answer; the token ids
    stay as generated."""
    client = RegenClient(llama_server.url, request_timeout=60, retries=0, retry_wait=0.1)
    regen = Regenerator(None, client, tokenizer, {"reasoning_parser": "deepseek-r1",
                                                  "tool_call_parser": "qwen25"}, None)
    plan = plan_row({"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}, "t")
    text = ("<think>The user wants the weather.</think>Let me check.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    msg = regen._message({"text": text, "output_ids": [5, 6, 7]}, plan, "r", 1, 0)
    assert msg["reasoning_content"] == "The user wants the weather."
    assert msg["content"].strip() == "Let me check."
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert call["id"].startswith("call_") and msg["token_ids"] == [5, 6, 7]
    r = requests.get(f"{llama_server.url}/model_info", timeout=30).json()
    assert r["reasoning_parser"] is None  # this server runs without parsers: text kept whole


def test_agent_policy_keeps_the_calls_or_regenerates_all():
    assert plan_row(AGENT, "t").turns == [3]
    assert plan_row(AGENT, "t", "all").turns == [1, 3]
    ends_with_tool = {"messages": AGENT["messages"][:3]}
    assert plan_row(ends_with_tool, "t").turns == [3]  # a new final answer appended
    plain = openai_row(CONV)
    assert plan_row(plain, "t").turns == [2, 4] and not plan_row(plain, "t").agent


def test_row_log_reads_every_row_once_after_a_crash_at_any_step(tmp_path):
    out = tmp_path / "o.jsonl"
    with RowLog(out) as log:
        for i in "abc":
            log.append({"id": i, "v": i})
        assert log.assemble(["c", "b", "a"]) == 3
    # killed after the rename, before the part file was deleted (rows in both), with a torn
    # line at the end of the part file and the temp file of a later assembly left behind
    (tmp_path / "o.jsonl.part").write_text(out.read_text() + '{"id": "d"}\n{"id": "e", "v"')
    (tmp_path / ".o.jsonl.tmp-123").write_text('{"id": "x"}')
    with RowLog(out) as log:
        assert sorted(log.done) == ["a", "b", "c", "d"]
        with pytest.raises(RuntimeError, match="another hsdump process is writing"):
            RowLog(out)
        assert log.assemble(["a", "b", "c", "d", "e"]) == 4
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b", "c", "d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o.jsonl.lock", "o.jsonl"]


@pytest.mark.server
def test_kimi_k25_regeneration_then_extraction(tmp_path, kimi_server, tiny_kimi):
    """The tiny Kimi-K2.5 (custom tokenizer code, a generation prompt that opens <think>,
    tool calls), with SGLang's kimi_k2 parsers: the agent trace keeps its call and result, the
    thinking row regenerates both turns, and extraction gives prompt + generated ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)
    kimi_agent = {"id": "kimi-agent", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"}]}
    thinking = openai_row(CONV[1:], id="kimi-think")
    dataset = write_jsonl(tmp_path / "d.jsonl", [kimi_agent, thinking])
    regen = tmp_path / "regen.jsonl"
    assert regenerate(kimi_server, dataset, regen, "--reasoning-parser", "kimi_k2",
                      "--tool-call-parser", "kimi_k2") == 0
    agent, think = read_rows(regen)
    assert agent[ROW_FIELD]["turns"] == [3] and agent[ROW_FIELD]["policy"] == "last-turn"
    assert agent["messages"][:3] == kimi_agent["messages"]
    # turn 1 is cut at NEW tokens (the random model does not stop): the row stops there
    assert think[ROW_FIELD]["turns"] == [1] and think[ROW_FIELD]["cut_at"] == 1
    assert len(think["messages"]) == 2
    out = tmp_path / "eagle3"
    assert cli(["extract", "--server", kimi_server.url, "--dump-dir", str(kimi_server.dump_dir),
                "--dataset", str(regen), "--out", str(out), "--no-progress"]) == 0
    recs = dict(iter_records(out))
    for row in (agent, think):
        for k in row[ROW_FIELD]["turns"]:
            want = prompt_ids(tok, row["messages"][:k], row.get("tools"))
            assert tok.decode(want[-1:]) == "<think>"  # the generation prompt opens thinking
            gen = row["messages"][k]["token_ids"]
            assert gen == kimi_server.server.generate(want, max_new_tokens=NEW)["output_ids"]
        rec = recs.get(f"{row['id']}#{k}", recs[row["id"]])
        assert rec["input_ids"].tolist() == want + gen


# ------------------------------------------------------------------------------ issue 16


def test_reasoning_split_on_the_think_markers_is_verbatim():
    """The split of a generated text: the think start the prompt opened is put back in front;
    unclosed reasoning (a cut turn) is all reasoning; no block is all content."""
    think = ThinkMarkers("<think>", "</think>")
    assert split_reasoning("Plan.</think>Answer.", think, True) == ("Plan.", "Answer.")
    assert split_reasoning("Still thinking", think, True) == ("Still thinking", "")
    assert split_reasoning("<think>Plan.</think>Hi", think, False) == ("Plan.", "Hi")
    assert split_reasoning("Just text", think, False) == (None, "Just text")
    assert split_reasoning("Plan.</think>Hi", None, True) == (None, "Plan.</think>Hi")


@pytest.mark.server
def test_a_row_stops_at_its_first_cut_turn(tmp_path, llama_server, capsys):
    """Turn 2 of a two-turn row is cut at the limit: it ends the row (no turn 4 generated on
    top of it), and the summary and report count the cut row and the turn not generated."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONV, id="two-turns")])
    out = tmp_path / "out.jsonl"
    assert regenerate(llama_server, dataset, out, "--max-new-tokens", "2") == 0
    [row] = read_rows(out)
    meta = row[ROW_FIELD]
    assert (meta["turns"], meta["finish_reasons"], meta["cut_at"]) == ([2], ["length"], 2)
    assert meta["turns_not_generated"] == 1 and meta["cut"]
    assert len(row["messages"]) == 3 and len(row["messages"][2]["token_ids"]) == 2
    rep = report_of(out)
    assert rep["cut_rows"] == ["two-turns"] and rep["turns_not_generated"] == 1
    assert rep["turns"] == 1 and rep["finish_reasons"] == {"length": 1}
    assert "1 rows stop at their cut turn (finish length" in capsys.readouterr().out


@pytest.mark.server
def test_train_only_regenerated_masks_the_kept_agent_turns(tmp_path, llama_server, tokenizer):
    """--train-only-regenerated: the agent trace's kept original call turn is "train": false,
    and hsdump extract trains only the regenerated last turn (prompt + its generated ids)."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{**AGENT, "id": "agent-only"}])
    regen = tmp_path / "regen.jsonl"
    assert regenerate(llama_server, dataset, regen, "--train-only-regenerated") == 0
    [row] = read_rows(regen)
    msgs = row["messages"]
    assert row[ROW_FIELD]["turns"] == [3] and row[ROW_FIELD]["train_only_regenerated"]
    assert msgs[1]["train"] is False and "train" not in msgs[3]
    out = tmp_path / "eagle3"
    assert cli(["extract", "--server", llama_server.url, "--dump-dir", str(llama_server.dump_dir),
                "--dataset", str(regen), "--out", str(out), "--no-progress"]) == 0
    recs = dict(iter_records(out))
    assert list(recs) == ["agent-only"]  # one sample: the regenerated turn only
    rec = recs["agent-only"]
    want = prompt_ids(tokenizer, msgs[:3], row["tools"])
    gen = msgs[3]["token_ids"]
    assert rec["input_ids"].reshape(-1).tolist() == want + gen
    assert rec["loss_mask"].reshape(-1).tolist() == [0] * len(want) + [1] * len(gen)


@pytest.mark.server
def test_sampling_defaults_to_the_served_chat_api_never_silently_greedy(
        tmp_path, llama_server, tiny_models, capsys):
    """No flags: the model's generation_config.json keys (as SGLang reads them under
    --sampling-defaults model), else SGLang's chat defaults (temperature 1); printed and
    recorded in the report and in every row; --seed on a server without deterministic
    inference is named as ineffective."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [openai_row([("user", "Hi")], id="s")])
    out = tmp_path / "default.jsonl"
    assert regenerate(llama_server, dataset, out, greedy=False) == 0
    rep = report_of(out)
    sglangs = sglang_chat_defaults()  # SGLang's own, not the product's copy
    assert rep["sampling"] == sglangs
    assert set(rep["sampling_source"].values()) == {"sglang default"}
    assert read_rows(out)[0][ROW_FIELD]["sampling"] == sglangs
    assert "temperature=1.0 (sglang default)" in capsys.readouterr().err

    model = tmp_path / "model"  # the tokenizer, with a generation config that samples
    shutil.copytree(tiny_models / "tiny-llama", model,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**gen, "temperature": 0.6, "top_p": 0.95}))
    out = tmp_path / "model.jsonl"
    assert regenerate(llama_server, dataset, out, "--model", str(model), "--seed", "7",
                      greedy=False) == 0
    rep = report_of(out)
    assert rep["sampling"] == {**sglangs, "temperature": 0.6, "top_p": 0.95,
                               "sampling_seed": 7}
    assert rep["sampling_source"]["top_p"] == "generation_config.json"
    err = capsys.readouterr().err
    assert "top_p=0.95 (generation_config.json)" in err
    assert "--seed has no effect on this server" in err


def _served_prompt(server, messages: list[dict], tools, kwargs) -> list[int]:
    """The prompt ids the server's own chat API serves for ``messages``."""
    body = {"model": "default", "max_tokens": 1, "return_prompt_token_ids": True,
            "messages": [{k: v for k, v in m.items() if k not in ("token_ids", "train")}
                         for m in messages]}
    if tools:
        body["tools"] = tools
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_token_ids"]


@pytest.mark.server
def test_kimi_thinking_turns_split_faithfully_and_prompts_equal_the_servers(
        tmp_path, kimi_server, tiny_kimi):
    """A two-turn thinking row on the tiny Kimi-K2.5 (no --reasoning-parser on the server):
    the generation prompt opens <think>, so turn 1's text is reasoning (its think start put
    back), not content; each turn's prompt equals the server's own chat rendering of the
    regenerated messages before it (so turn 3 sees turn 1 as the template treats past
    reasoning). Turn 1 is ended by a stop token, so that turn 3 is generated after it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)
    client = RegenClient(kimi_server.url, request_timeout=120, retries=0, retry_wait=0.1)
    row = openai_row(CONV[1:], id="kimi-think-2")
    plan = plan_row(row, "t")
    first = prompt_ids(tok, plan.messages[:1])
    greedy = kimi_server.server.generate(first, max_new_tokens=NEW)["output_ids"]
    settings = RegenSettings(server=kimi_server.url, out=tmp_path / "o.jsonl", max_new_tokens=NEW,
                        sampling={"temperature": 0.0, "stop_token_ids": [greedy[2]]})
    regen = Regenerator(settings, client, tok, {}, None)
    res = regen.process("kimi-think-2", row, plan)
    msgs = res.row["messages"]
    assert res.row[ROW_FIELD]["turns"] == [1, 3] and res.finish[0] == "stop"
    one = msgs[1]
    text = decode(tok, one["token_ids"])
    assert one["content"] == "" and text.startswith(one["reasoning_content"])
    assert one["reasoning_content"].strip()  # the reasoning is not lost into content
    for k in res.row[ROW_FIELD]["turns"]:
        ids, opened = regen.prompt(msgs[:k], None)
        assert opened and tok.decode(ids[-1:]) == "<think>"
        assert ids == _served_prompt(kimi_server, msgs[:k], None, None), k
        assert msgs[k]["token_ids"] == kimi_server.server.generate(
            ids, max_new_tokens=NEW, sampling_params={
                "max_new_tokens": NEW, "temperature": 0, "stop_token_ids": [greedy[2]]}
        )["output_ids"], k
    # turn 3's history holds turn 1 as the template renders past reasoning: <think></think>
    assert "<think></think><|im_end|>" in decode(tok, regen.prompt(msgs[:3], None)[0])


@pytest.mark.server
def test_chat_template_kwargs_thinking_off(tmp_path, kimi_server, tiny_kimi):
    """--chat-template-kwargs '{"thinking": false}': the prompt ends in <think></think> as the
    server's chat API renders it with those kwargs; the answer is all content; the kwargs are
    recorded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)
    dataset = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONV[1:2], id="instant")])
    out = tmp_path / "o.jsonl"
    kwargs = {"thinking": False}
    assert regenerate(kimi_server, dataset, out, "--chat-template-kwargs",
                      json.dumps(kwargs)) == 0
    [row] = read_rows(out)
    assert row[ROW_FIELD]["chat_template_kwargs"] == kwargs
    assert report_of(out)["chat_template_kwargs"] == kwargs
    msgs = row["messages"]
    ids = prompt_ids(tok, msgs[:1], None, kwargs)
    assert decode(tok, ids).endswith("<think></think>")
    assert ids == _served_prompt(kimi_server, msgs[:1], None, kwargs)
    assert msgs[1]["token_ids"] == kimi_server.server.generate(ids, max_new_tokens=NEW)[
        "output_ids"]
    assert "reasoning_content" not in msgs[1] and msgs[1]["content"]  # no block: all content


@pytest.mark.server
def test_sampled_thinking_turns_follow_the_servers_prompts_then_extract(
        tmp_path, kimi_server, tiny_kimi):
    """Sampled (temperature 1.0, top_p 0.95, as Kimi-K2.5 is served) regeneration of a
    two-turn thinking row: turns end at a random stop token; each turn's prompt is the
    server's own chat rendering of the regenerated messages before it (checked on its
    /v1/chat/completions), and extracting the output (the prompt check on) gives each turn's
    prompt + its sampled ids verbatim. Seeded sampling (``--seed``) needs SGLang's
    --enable-deterministic-inference, which 0.5.23 refuses for CPU attention backends: not
    tested here."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)
    client = RegenClient(kimi_server.url, request_timeout=120, retries=0, retry_wait=0.1)
    row = openai_row(CONV[1:], id="kimi-sampled")
    plan = plan_row(row, "t")
    stops = list(range(0, len(tok), 5))  # about one token in five ends a turn
    settings = RegenSettings(server=kimi_server.url, out=tmp_path / "o.jsonl", max_new_tokens=64,
                        sampling={"temperature": 1.0, "top_p": 0.95, "min_new_tokens": 3,
                                  "stop_token_ids": stops})
    regen = Regenerator(settings, client, tok, {}, None)
    res = regen.process("kimi-sampled", row, plan)
    msgs = res.row["messages"]
    assert res.row[ROW_FIELD]["turns"] == [1, 3], res.finish
    dataset = write_jsonl(tmp_path / "regen.jsonl", [res.row])
    out = tmp_path / "eagle3"
    assert cli(["extract", "--server", kimi_server.url, "--dump-dir", str(kimi_server.dump_dir),
                "--dataset", str(dataset), "--out", str(out), "--no-progress",
                "--multi-turn", "per-turn"]) == 0
    recs = dict(iter_records(out))
    report = json.loads((out / "report.shard-0-of-1.json").read_text())
    assert report["prompts_checked_by_server"] == 2
    for k, sid in ((1, "kimi-sampled"), (3, "kimi-sampled#3")):
        served = _served_prompt(kimi_server, msgs[:k], None, None)
        assert regen.prompt(msgs[:k], None)[0] == served, k
        assert recs[sid]["input_ids"].tolist() == served + msgs[k]["token_ids"], k


def _non_canonical(tok: Any, text: str) -> list[int]:
    """Ids that decode to ``text`` but are not its encoding: its first token of several
    characters split in two tokens of the vocabulary."""
    ids = encode(tok, text)
    vocab = tok.get_vocab()
    for n, piece in enumerate(tok.convert_ids_to_tokens(ids)):
        for cut in range(1, len(piece)):
            if piece[:cut] in vocab and piece[cut:] in vocab:
                return [*ids[:n], vocab[piece[:cut]], vocab[piece[cut:]], *ids[n + 1:]]
    raise AssertionError(f"no token of {text!r} splits in two")


@pytest.mark.server
def test_auto_gives_per_turn_samples_when_regenerated_ids_are_not_the_texts_encoding(
        tmp_path, llama_server, tokenizer):
    """A regenerated turn whose ``token_ids`` decode to its text but are not the encoding of it
    (sampling can emit such a split): the later turn's served prompt re-encodes that text, so
    no one-stream sample follows the server's prompts. ``--multi-turn auto`` with the server
    prompt check gives per-turn samples instead of skipping the row: each after exactly the
    prompt the server serves for its turn, the regenerated ids verbatim."""
    text = "Paris is the capital of France."
    gen = [*_non_canonical(tokenizer, text), tokenizer.eos_token_id]
    assert decode(tokenizer, gen) == text + tokenizer.eos_token
    assert encode(tokenizer, text + tokenizer.eos_token) != gen
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": text, "token_ids": gen},
            {"role": "user", "content": "And of Spain?"},
            {"role": "assistant", "content": "Madrid is the capital of Spain."}]
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"id": "split", "messages": msgs}])
    out = tmp_path / "out"
    rc = extract(llama_server, dataset, out, "--multi-turn", "auto", "--prompt-check", "server")
    report = read_report(out)
    assert rc == 0, report["issues"]
    assert (report["ok"], report["skipped"], report["failed"]) == (2, 0, 0)
    assert report["per_turn_fallbacks"] == 1 and report["fallback_rows"] == ["split"]
    assert report["prompts_checked_by_server"] == 2  # turn 1 asked once, not once per sample
    recs = dict(iter_records(out))
    assert sorted(recs) == ["split", "split#3"]
    served = {k: _served_prompt(llama_server, msgs[:k], None, None) for k in (1, 3)}
    # Turn 3's served prompt holds turn 1 re-encoded, not as generated: no one stream.
    assert served[3][:len(served[1]) + len(gen)] != served[1] + gen
    answer = encode(tokenizer, msgs[3]["content"] + tokenizer.eos_token)
    for k, sid, completion in ((1, "split", gen), (3, "split#3", answer)):
        ids, mask = recs[sid]["input_ids"].tolist(), recs[sid]["loss_mask"].tolist()
        assert ids == served[k] + completion, k
        assert mask == [0] * len(served[k]) + [1] * len(completion), k


@pytest.mark.server
@pytest.mark.first_on("plain_server")
def test_sampled_regeneration_is_reproducible_on_a_seeded_server(tmp_path, tiny_models,
                                                                  plain_server):
    """Seeded sampling. SGLang 0.5.23 honours a request's ``sampling_seed`` (``--seed``) only
    under --enable-deterministic-inference, which it refuses for CPU attention backends
    ("only ascend, fa3, fa4, flashinfer, intel_xpu, triton"); a server started with
    --random-seed samples from its seeded generator instead. Two fresh servers of one seed (a
    new one, then the session's plain server, whose first requests these are: ``first_on``)
    regenerate the same sampled tokens (temperature 1.0, one request at a time), and those are
    not the greedy ones."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [
        openai_row([("user", "What is the capital of France?")], id="a"),
        openai_row(CONV[1:2], id="b")])
    outs = []
    fresh = start_plain_server(tmp_path, tiny_models / "tiny-llama", "seeded")
    try:
        warmed = prefills(fresh)
        for n, s in enumerate((fresh, plain_server)):
            assert prefills(s) == warmed, "the plain server served requests before this test"
            for name, temperature in (("sampled", "1.0"), ("greedy", "0"))[: n + 1]:
                assert regenerate(s, dataset, tmp_path / f"{name}{n}.jsonl", "--concurrency",
                                  "1", "--temperature", temperature, greedy=False) == 0
            if s is fresh:
                s.server.stop()
            rows = read_rows(tmp_path / f"sampled{n}.jsonl")
            assert all(r[ROW_FIELD]["sampling"]["temperature"] == 1.0 for r in rows)
            outs.append({r["id"]: r["messages"][-1]["token_ids"] for r in rows})
    finally:
        fresh.server.stop()
    assert outs[0] == outs[1]
    greedy = read_rows(tmp_path / "greedy1.jsonl")
    assert outs[0] != {r["id"]: r["messages"][-1]["token_ids"] for r in greedy}
