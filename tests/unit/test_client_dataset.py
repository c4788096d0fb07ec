"""Client input: chat shapes, loss mask from render boundaries, malformed rows, sharding."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsdump_patch.client.rows.dataset import (
    ChatRenderer,
    SampleError,
    Shard,
    index_dataset,
    iter_samples,
)
from tests.harness.rows import CONV, openai_row, reference, sharegpt_row, write_jsonl


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from tests.harness.make_models import make_tokenizer  # tokenizers: installed with SGLang

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


def fresh_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return fresh_tokenizer(tok_dir)


def load_all(path, tokenizer, max_len=None):
    refs, errors = index_dataset(path)
    items = list(iter_samples(path, refs, ChatRenderer(tokenizer), max_len))
    return items, errors


def test_both_chat_shapes_multi_turn_mask_is_exactly_the_assistant_tokens(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONV, id="a"), sharegpt_row(CONV)])
    (a, b), errors = load_all(path, tokenizer)
    assert errors == []
    want_ids, want_mask = reference(tokenizer, CONV)
    assert sum(want_mask) > 10 and 0 in want_mask
    for s in (a, b):
        assert (s.input_ids, s.loss_mask) == (want_ids, want_mask)
    assert (a.id, b.id) == ("a", "2")  # without "id", the line number
    assert b.where == f"{path}:2"


def test_max_len_truncates_and_pre_tokenized_rows_pass_through(tmp_path, tokenizer):
    pre = {"id": 7, "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0]}
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONV), pre])
    want_ids, want_mask = reference(tokenizer, CONV)
    cut = want_mask.index(1) + 2  # inside the first assistant turn
    (chat, tok), _ = load_all(path, tokenizer, max_len=cut)
    assert (chat.input_ids, chat.loss_mask) == (want_ids[:cut], want_mask[:cut])
    assert (tok.id, tok.input_ids, tok.loss_mask) == ("7", [5, 6, 7, 8][:cut], [0, 1, 1, 0][:cut])


@pytest.mark.parametrize(("row", "problem"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"id": [1], "messages": []}, '"id" must be a string or an integer'),
    ({"text": "hello"}, 'needs "messages"'),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, 'messages[0] has no "content"'),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown speaker 'alien'"),
    ({"messages": [{"role": "user", "content": 3}]}, "must be a string, null or a list"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "has 1 entries"),
    ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "only 0 and 1"),
    ({"input_ids": [1, "2"], "loss_mask": [1, 1]}, "list of integers"),
    ({"input_ids": [1, 2]}, 'needs "loss_mask"'),
    ({"messages": [{"role": "user", "content": "only a question"}]},
     "no assistant turn to train after"),
])
def test_malformed_rows_name_file_line_and_problem(tmp_path, tokenizer, row, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONV, id="good"), row])
    items, errors = load_all(path, tokenizer)
    bad = errors + [i for i in items if isinstance(i, SampleError)]
    assert len(bad) == 1, bad
    assert str(bad[0]).startswith(f"{path}:2: ")
    assert problem in str(bad[0])
    assert [i.id for i in items if not isinstance(i, SampleError)] == ["good"]


def test_duplicate_ids_and_truncation_to_an_empty_mask_are_errors(tmp_path, tokenizer):
    rows = [openai_row(CONV, id="x"), "", openai_row(CONV, id="x")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    items, errors = load_all(path, tokenizer, max_len=3)
    assert [str(e) for e in errors] == [
        f"{path}:3: duplicate id 'x' (first on line 1); ids must be unique because they name "
        "the output files"]
    assert isinstance(items[0], SampleError)
    assert "all zeros within the first 3 tokens (--max-len)" in str(items[0])


def test_a_template_that_rewrites_earlier_turns_gives_one_sample_per_turn(tmp_path, tok_dir):
    tokenizer = fresh_tokenizer(tok_dir)
    tokenizer.chat_template = (  # drops the content of earlier assistant turns, like "thinking"
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }}{% endif %}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONV, id="r")])
    (first, second), _ = load_all(path, tokenizer)
    # Each turn's prompt is its serving-time prompt: the second one has turn 1 emptied.
    ids1, mask1 = reference(tokenizer, CONV[:3])
    hollow = [("system", CONV[0][1]), ("user", CONV[1][1]), ("assistant", ""), *CONV[3:]]
    ids2, _ = reference(tokenizer, hollow)
    n = len(tokenizer.encode(CONV[4][1], add_special_tokens=False)) + 1  # + </s>
    mask2 = [0] * (len(ids2) - n) + [1] * n
    assert (first.id, first.input_ids, first.loss_mask) == ("r", ids1, mask1)
    assert (second.id, second.input_ids, second.loss_mask) == ("r#4", ids2, mask2)


def test_a_tokenizer_without_chat_template_is_refused(tok_dir):
    tokenizer = fresh_tokenizer(tok_dir)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(tokenizer)


def test_shards_are_disjoint_and_cover_every_id():
    ids = [str(i) for i in range(1000)] + [f"conv-{i}" for i in range(100)]
    shards = [Shard(i, 3) for i in range(3)]
    members = [{i for i in ids if s.contains(i)} for s in shards]
    assert sum(len(m) for m in members) == len(ids)
    assert set().union(*members) == set(ids)
    assert all(len(m) > 250 for m in members)
    assert Shard.parse("2/3") == Shard(2, 3)
    for bad in ("3/3", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="--shard"):
            Shard.parse(bad)


QWEN3_STYLE = (  # keeps reasoning only after the last user query, like Qwen3's template
    "{%- set ns = namespace(q=-1) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.q = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}<|{{ m['role'] }}|>"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.q and m.get('reasoning_content') -%}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif -%}"
    "{{ m['content'] }}</s>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")


def test_a_template_dropping_past_reasoning_gives_serving_time_samples(tok_dir):
    from hsdump_patch.client.rows.conversation import ChatRenderer as Renderer
    from hsdump_patch.client.rows.conversation import ThinkMarkers, parse_conversation

    tok = fresh_tokenizer(tok_dir)
    tok.chat_template = QWEN3_STYLE
    row = {"messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy one."},
        {"role": "user", "content": "And the quick brown fox?"},
        {"role": "assistant", "content": "It jumps.", "reasoning_content": "A pangram."}]}

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    p1 = enc("<|user|>What is the capital of France?</s><|assistant|>")
    c1 = enc("<think>\nEasy one.\n</think>\n\nParis.</s>")
    p2 = enc("<|user|>What is the capital of France?</s><|assistant|>Paris.</s>"
             "<|user|>And the quick brown fox?</s><|assistant|>")
    c2 = enc("<think>\nA pangram.\n</think>\n\nIt jumps.</s>")
    think = ThinkMarkers("<think>", "</think>")
    first, second = Renderer(tok, think).render(parse_conversation(row))  # auto
    assert (first.suffix, first.input_ids, first.loss_mask) == (
        "", p1 + c1, [0] * len(p1) + [1] * len(c1))
    assert (second.suffix, second.input_ids, second.loss_mask) == (
        "#3", p2 + c2, [0] * len(p2) + [1] * len(c2))
    (last,) = Renderer(tok, think, policy="last").render(parse_conversation(row))
    assert last.input_ids == p2 + c2


def test_think_markers_are_sglangs_for_every_reasoning_parser(sglang_available):
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    from hsdump_patch.client.rows.conversation import REASONING_MARKERS, ThinkMarkers

    sglangs = {}
    for name in ReasoningParser.DetectorMap:
        if name == "response_template":  # its markers are server arguments
            continue
        detector = ReasoningParser(name).detector
        sglangs[name] = (detector.think_start_token, detector.think_end_token)
    assert sglangs == REASONING_MARKERS
    assert ThinkMarkers.from_reasoning_parser("kimi_k2") == ThinkMarkers("<think>", "</think>")
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope': SGLang 0.5.23 has "):
        ThinkMarkers.from_reasoning_parser("nope")


def _finish(out: Path, samples, key: str) -> dict:
    """What a finished run leaves: each sample's record file and manifest line."""
    from hsdump_patch.client.output.manifest import Manifest, entry, load_done

    with Manifest(out, Shard()) as m:
        for s in samples:
            (out / f"{s.id}.pt").write_bytes(b"r")
            m.append(entry(s, key, file=f"{s.id}.pt"))
    return load_done(out)


def test_resume_is_keyed_by_row_bytes_and_render_settings(tmp_path, tokenizer):
    from hsdump_patch.client.output.manifest import plan_resume, skip_done
    from hsdump_patch.client.rows.conversation import chat_renderer
    from hsdump_patch.client.rows.dataset import render_key

    pre = {"id": "p", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    rows = [openai_row(CONV, id="a"), pre, openai_row(CONV, id="b")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    per_turn = chat_renderer(tokenizer, "per-turn")
    key = render_key(per_turn, None)
    refs, _ = index_dataset(path)
    samples = list(iter_samples(path, refs, per_turn, None))
    assert [s.id for s in samples] == ["a", "a#4", "p", "b", "b#4"]
    assert [s.row_samples for s in samples] == [2, 2, 1, 2, 2]
    out = tmp_path / "out"
    out.mkdir()
    done = _finish(out, samples, key)

    # Every row finished: nothing to read or render, every sample counted as done.
    assert plan_resume(path, refs, done, key) == ([], 5)
    # Rows moved and a new one inserted: keys are bytes, not positions.
    moved = write_jsonl(tmp_path / "m.jsonl", [pre, {**pre, "id": "n"}, *rows[::2]])
    mrefs, _ = index_dataset(moved)
    assert plan_resume(moved, mrefs, done, key) == ([mrefs[1]], 5)

    # One record gone: only its row comes back, and only the missing sample is sent again.
    (out / "a#4.pt").unlink()
    from hsdump_patch.client.output.manifest import load_done

    done_a = load_done(out)
    todo, finished = plan_resume(path, refs, done_a, key)
    assert (todo, finished) == ([refs[0]], 3)
    skipped = []
    again = list(skip_done(iter_samples(path, todo, per_turn, None), done_a,
                           lambda: skipped.append(1)))
    assert [s.id for s in again] == ["a#4"] and len(skipped) == 1

    # A changed row, or changed render settings, is refused with the row named.
    changed = write_jsonl(tmp_path / "c.jsonl", [rows[0], {**pre, "loss_mask": [0, 0, 1]}, rows[2]])
    crefs, _ = index_dataset(changed)
    with pytest.raises(ValueError, match=rf"{changed}:2: row 'p' changed since its record"):
        plan_resume(changed, crefs, done, key)
    for other in (render_key(chat_renderer(tokenizer, "last"), None), render_key(per_turn, 64),
                  render_key(chat_renderer(tokenizer, "per-turn",
                                           template_kwargs={"thinking": False}), None)):
        with pytest.raises(ValueError, match=rf"{path}:1: row 'a' changed since"):
            plan_resume(path, refs, done, other)


def test_resume_of_a_manifest_without_row_keys_checks_each_sample_as_rendered(tmp_path, tokenizer):
    from hsdump_patch.client.output.manifest import plan_resume, skip_done
    from hsdump_patch.client.rows.dataset import render_key

    renderer = ChatRenderer(tokenizer)
    path = write_jsonl(tmp_path / "d.jsonl", [openai_row(CONV, id="a"), openai_row(CONV[:3])])
    refs, _ = index_dataset(path)
    a, second = iter_samples(path, refs, renderer, None)
    key = render_key(renderer, None)
    legacy = {"a": {"id": "a", "file": "a.pt", "digest": a.digest}}  # an older hsdump's line
    assert plan_resume(path, refs, legacy, key) == (refs, 0)
    skipped = []
    left = list(skip_done(iter_samples(path, refs, renderer, None), legacy,
                          lambda: skipped.append(1)))
    assert [s.id for s in left] == [second.id] and skipped == [1]
    legacy["a"]["digest"] = "0" * 32
    with pytest.raises(ValueError, match=rf"{path}:1: sample 'a' changed since"):
        list(skip_done(iter_samples(path, refs, renderer, None), legacy, lambda: None))
