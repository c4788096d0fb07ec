"""``hsdump specforge``: the hand-off of a ``--format specforge`` output to SpecForge 0.2.0,
checked with SpecForge's own released code (``$HSDUMP_SPECFORGE_PATH``, as test_specforge.py).

Records come from the session's tiny-Llama server (``llama_server``): the longest record and the
``data.max_length`` to set, the records a shorter limit would cut, stray ``.ckpt`` files, and
the vocab mapping, equal to the one SpecForge computes from the same directory and loaded by
its own draft model. The printed overrides go through SpecForge's own offline data path
(reader, feature store, loader, normaliser, collator) with no record cut. A dataset extracted
in two shards (``--loss-mask drafted``), into one ``--out`` and into one ``--out`` each below a
parent: reports count the mask written, and the hand-off covers every shard as SpecForge does.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hsdump_patch.client.rows.dataset import Shard
from hsdump_patch.reader import load_record
from tests.harness.extraction import extract, pre_tokenized, read_report
from tests.harness.make_models import VOCAB
from tests.harness.needs import specforge_on_path
from tests.harness.rows import write_jsonl
from tests.harness.server import REPO

pytestmark = pytest.mark.server
DRAFT_VOCAB = 64  # fewer than the distinct trained ids below: the top-N choice matters


@pytest.fixture(scope="module")
def sfh() -> SimpleNamespace:
    """SpecForge's vocab-mapping code, its draft model and its offline data path."""
    specforge_on_path()
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.config.schema import load_config
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.launch import _make_offline_eval_data_factory
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    return SimpleNamespace(
        registry=builtin_algorithm_registry, load_config=load_config,
        validate=validate_vocab_mapping_consistency, mappings=process_token_dict_to_mappings,
        loader_factory=_make_offline_eval_data_factory, Eagle3=LlamaForCausalLMEagle3,
        count=count_effective_feature_tokens)


@pytest.fixture(scope="module")
def handoff_out(tmp_path_factory, llama_server) -> SimpleNamespace:
    """A small --format specforge extraction of rows of different lengths."""
    tmp = tmp_path_factory.mktemp("handoff")
    rows = pre_tokenized(5, seed=21, lo=20, hi=120, prefix="ho")
    out = tmp / "out"
    # Bad rows, skipped (--on-error skip) and counted by reason in the extract report.
    bad = [{"id": f"zero{i}", "input_ids": [11, 12, 13 + i], "loss_mask": [0, 0, 0]}
           for i in range(2)]
    dataset = write_jsonl(tmp / "d.jsonl", rows + bad)
    with open(dataset, "a") as f:
        f.write('{"id": "torn", "input_ids": [1, 2\n')
    assert extract(llama_server, dataset, out, "--format", "specforge", "--on-error",
                   "skip") == 3
    assert read_report(out)["ok"] == len(rows)
    return SimpleNamespace(out=out, rows=rows, server=llama_server)


def test_extract_report_counts_trained_tokens_longest_and_skips(handoff_out):
    """Issue 16.9: the extract report counts trained vs stored tokens, names the longest
    record and groups the skipped rows by reason (numbers and names blanked out)."""
    report = read_report(handoff_out.out)
    rows = handoff_out.rows
    assert report["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert report["trained_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    top = max(rows, key=lambda r: len(r["input_ids"]))
    assert report["longest"] == {"id": top["id"], "tokens": len(top["input_ids"])}
    assert report["per_turn_fallbacks"] == 0  # pre-tokenized rows have no turns to split
    by_reason = report["skipped_by_reason"]
    assert len(by_reason) == 2 and report["skipped"] == 3
    assert [n for r, n in by_reason.items() if "all zeros" in r] == [2]
    assert [n for r, n in by_reason.items() if "not valid JSON" in r] == [1]


def run_handoff(out: Path, *flags: str) -> tuple[int, str, dict]:
    r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "specforge", "--out", str(out),
                        "--no-progress", *flags], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    report = out / "specforge-report.json"
    return r.returncode, r.stdout + r.stderr, json.loads(report.read_text()) \
        if report.exists() else {}


def overrides(printed: str) -> dict[str, str]:
    """The ``key=value`` overrides of the printed ``specforge train overrides:`` line."""
    line = re.search(r"^specforge train overrides: (.*)$", printed, re.M)
    assert line, printed
    return dict(item.split("=", 1) for item in line.group(1).split())


def test_longest_record_cut_records_and_strays(handoff_out):
    out, rows = handoff_out.out, handoff_out.rows
    lengths = {r["id"]: len(r["input_ids"]) for r in rows}
    longest = max(lengths.values())
    rc, printed, report = run_handoff(out)
    assert rc == 0, printed
    assert report["longest"]["tokens"] == longest and report["records"] == len(rows)
    assert report["tokens"] == sum(lengths.values()) and report["strays"] == []
    assert overrides(printed)["data.max_length"] == str(longest)
    assert f"longest record: {longest:,} tokens" in printed

    limit = sorted(lengths.values())[-3]  # the two longest would be cut
    rc, printed, report = run_handoff(out, "--max-length", str(limit))
    assert rc == 1, printed
    cut = {i for i, n in lengths.items() if n > limit}
    assert len(cut) == 2 and {c["id"] for c in report["cut"]} == cut
    assert all(f"cut at --max-length {limit}: {i} " in printed for i in cut)

    # A record of another run, in a group dir and in a dir of its own: SpecForge lists both.
    some = next(out.glob("rows_*/*.ckpt"))
    strays = [some.parent / "old-run.ckpt", out / "edited" / "x.ckpt.gz"]
    strays[1].parent.mkdir()
    for s in strays:
        shutil.copy(some, s)
    rc, printed, report = run_handoff(out, "--draft-vocab-size", str(DRAFT_VOCAB))
    assert rc == 1 and "--remove-strays" in printed, printed
    assert not (out / "specforge-vocab-mapping.pt").exists()
    rc, printed, report = run_handoff(out)
    assert rc == 1 and sorted(report["strays"]) == sorted(
        str(s.relative_to(out)) for s in strays), printed
    rc, printed, report = run_handoff(out, "--remove-strays")
    assert rc == 0 and report["strays_removed"] and not any(s.exists() for s in strays), printed
    rc, printed, report = run_handoff(out)
    assert rc == 0 and report["strays"] == []


@pytest.mark.parametrize("draft", [DRAFT_VOCAB, 700])  # 700: more than the distinct ids
def test_vocab_mapping_equals_specforge_and_loads(handoff_out, sfh, tmp_path, draft):
    out = handoff_out.out
    mapping = tmp_path / "vm.pt"
    # --target-vocab-size defaults to the model's config.json (hsdump-meta.json's model).
    rc, printed, report = run_handoff(out, "--draft-vocab-size", str(draft), "--vocab-mapping",
                                      str(mapping))
    assert rc == 0, printed
    assert report["vocab_mapping"]["target_vocab_size"] == VOCAB
    assert overrides(printed)["model.vocab_mapping_path"] == str(mapping.resolve())
    max_len = int(overrides(printed)["data.max_length"])

    counts = sfh.count(str(out), max_length=max_len, target_vocab_size=VOCAB)
    assert (len(counts) > draft) == (draft == DRAFT_VOCAB)
    assert sum(counts.values()) == sum(sum(r["loss_mask"]) for r in handoff_out.rows)
    want_d2t, want_t2d = sfh.mappings(counts, draft, VOCAB)
    got = torch.load(mapping, weights_only=True)
    assert set(got) == {"d2t", "t2d"}
    assert got["d2t"].dtype == want_d2t.dtype and torch.equal(got["d2t"], want_d2t)
    assert got["t2d"].dtype == want_t2d.dtype and torch.equal(got["t2d"], want_t2d)

    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    cfg.draft_vocab_size = draft
    model = sfh.Eagle3(cfg)
    model.load_vocab_mapping(str(mapping))
    assert model.vocab_mapping_loaded and torch.equal(model.d2t, want_d2t)
    assert torch.equal(model.t2d, want_t2d)
    sfh.validate(model.t2d, model.d2t)


def test_printed_recipe_runs_through_specforge_data_path(handoff_out, sfh, tmp_path):
    """The README recipe: the shipped run config plus the printed overrides, loaded by
    SpecForge's own config loader, load every record whole through SpecForge's own offline
    data path (reader, feature store, loader, normaliser, collator)."""
    out, rows = handoff_out.out, handoff_out.rows
    rc, printed, _ = run_handoff(out, "--draft-vocab-size", str(DRAFT_VOCAB), "--vocab-mapping",
                                 str(tmp_path / "vm.pt"))
    assert rc == 0, printed
    readme = (REPO / "README.md").read_text()
    recipe = readme[readme.index("## Kimi-K2.5 to a SpecForge drafter"):]
    config = re.search(r"specforge train --config (\S+)", recipe).group(1)
    assert (REPO / config).is_file()
    assert all(f"{key}=" in recipe for key in overrides(printed))
    cfg = sfh.load_config(str(REPO / config), [f"{k}={v}" for k, v in overrides(printed).items()])
    assert cfg.mode == "offline" and cfg.model.trust_remote_code
    assert cfg.model.lm_head_key == "language_model.lm_head.weight"
    assert cfg.model.embedding_key == "language_model.model.embed_tokens.weight"
    assert cfg.model.vocab_mapping_path == str((tmp_path / "vm.pt").resolve())
    data = cfg.data
    assert data.max_length < 2048  # the check below would pass with SpecForge's default too
    by_ids = {tuple(r["input_ids"]): r for r in rows}

    def batches(max_len: int) -> list[dict]:
        build = sfh.loader_factory(
            algorithm=sfh.registry().resolve("eagle3"), modality="text",
            hidden_states_path=data.hidden_states_path, run_id="hsdump-test", batch_size=1,
            max_len=max_len, ttt_length=7, use_usp_preprocess=False, dataloader_num_workers=0)
        return [b.tensors for b in build()]

    seen = set()
    for batch in batches(data.max_length):
        ids = tuple(batch["input_ids"][0].tolist())
        assert ids in by_ids, "a record was cut (or is not ours)"
        seen.add(ids)
        assert batch["loss_mask"][0].tolist() == [*by_ids[ids]["loss_mask"][:-1], 0]
        assert batch["hidden_state"].shape[1] == batch["target"].shape[1] == len(ids)
    assert seen == set(by_ids)
    # One token less than printed cuts the longest record: the check above has teeth.
    cut = [b for b in batches(data.max_length - 1)
           if tuple(b["input_ids"][0].tolist()) not in by_ids]
    assert len(cut) == sum(len(r["input_ids"]) == data.max_length for r in rows) >= 1


def test_loss_mask_conventions_token_by_token_under_specforge_shift(tmp_path, llama_server,
                                                                     sfh):
    """Issue 16.10: under SpecForge's own shift (its offline normaliser, then
    ``TargetHead.preprocess``), position t trains input token t+1 towards the target's
    distribution of token t+2. With ``--loss-mask drafted`` exactly the positions whose input
    and target tokens are both emitted in one turn are trained: the first drafted position of
    each turn (the last prompt token) included, nothing at or after the end of turn; the
    default ``completion`` mask is stored as given."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.modeling.target.target_head import TargetHead

    # Two turns: prompt 0..4, turn 5..10, prompt 11..14, turn 15..19.
    c = [0] * 5 + [1] * 6 + [0] * 4 + [1] * 5
    row = {"id": "two-turns", "input_ids": list(range(100, 100 + len(c))), "loss_mask": c}
    dataset = write_jsonl(tmp_path / "d.jsonl", [row])
    runs = [(5, 10), (15, 19)]  # (first emitted, end of turn) of each turn
    for convention in ("completion", "drafted"):
        out = tmp_path / convention
        flags = ["--format", "specforge"] + (["--loss-mask", convention]
                                             if convention == "drafted" else [])
        assert extract(llama_server, dataset, out, *flags) == 0
        meta = json.loads((out / "hsdump-meta.json").read_text())
        assert meta["loss_mask_convention"] == convention
        (path,) = out.glob("rows_*/*.ckpt")
        raw = torch.load(path, weights_only=True)
        sample = normalize_offline_sample(raw, max_len=len(c))
        ids, target, mask = TargetHead.preprocess(None, sample["input_ids"], sample["target"],
                                                  sample["loss_mask"])
        mask = mask[0, :, 0].tolist()
        # SpecForge's shift: input token t+1, target = final state of t+1 (predicts t+2).
        assert ids[0, :-1].tolist() == row["input_ids"][1:]
        assert torch.equal(target[0, :-1], raw["hidden_state"][0, 1:])
        if convention == "completion":
            assert mask == [*c[:-1], 0]
            for p, e in runs:  # the mismatch the drafted convention fixes
                assert mask[p - 1] == 0 and mask[e - 1] == 1
            assert mask[10] == 1  # input: the token after the first turn's end
            continue
        for t, trained in enumerate(mask):
            drafted = any(p - 1 <= t <= e - 2 for p, e in runs)
            # input token t+1 and target token t+2 both emitted in one turn
            same_turn = any(p <= t + 1 and t + 2 <= e for p, e in runs)
            assert trained == int(drafted) == int(same_turn), t
    # A directory keeps one convention: a rerun with the other is refused.
    assert extract(llama_server, dataset, tmp_path / "drafted", "--format", "specforge") == 1


SHARDS = 2


def two_turn_rows(n: int, seed: int) -> list[dict]:
    """Pre-tokenized rows with two trained turns each (prompt, turn, prompt, turn)."""
    rows = pre_tokenized(n, seed=seed, lo=30, hi=140, prefix="sh")
    for r in rows:
        q = len(r["input_ids"]) // 4
        r["loss_mask"] = [0] * q + [1] * q + [0] * q + [1] * (len(r["input_ids"]) - 3 * q)
    return rows


def shard_records(out: Path, shard: str) -> list[tuple[dict, dict]]:
    """``(manifest entry, record read back with hsdump's reader)`` of one shard's manifest."""
    lines = (out / f"manifest.{shard}.jsonl").read_text().splitlines()
    return [(e, load_record(out / e["file"])) for e in map(json.loads, lines)]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, llama_server) -> SimpleNamespace:
    """One dataset extracted with ``--loss-mask drafted`` in two shards, laid out both ways:
    both shards into one ``--out`` (``same``), and each into its own ``--out`` below one parent
    (``split``, as Ansible's extract.yml lays out ``shard-K-of-N`` directories)."""
    tmp = tmp_path_factory.mktemp("sharded")
    rows = two_turn_rows(8, seed=33)
    tags = [f"shard-{i}-of-{SHARDS}" for i in range(SHARDS)]
    assert all(any(Shard.parse(f"{i}/{SHARDS}").contains(r["id"]) for r in rows)
               for i in range(SHARDS)), "every shard must get rows"
    dataset = write_jsonl(tmp / "d.jsonl", rows)
    same, split = tmp / "same", tmp / "split"
    for i, tag in enumerate(tags):
        for out in (same, split / tag):
            assert extract(llama_server, dataset, out, "--format", "specforge", "--loss-mask",
                           "drafted", "--shard", f"{i}/{SHARDS}") == 0
    return SimpleNamespace(rows=rows, tags=tags, same=same, split=split,
                           shard_dirs={tag: split / tag for tag in tags})


def test_reports_count_the_drafted_mask_written(sharded):
    """Gap: the extract report (and the manifest) counted the completion mask while
    ``--loss-mask drafted`` wrote another. Every shard's trained count is the sum of
    ``loss_mask`` over the records it wrote, read back with hsdump's reader."""
    rows = {r["id"]: r for r in sharded.rows}
    for tag in sharded.tags:
        for out in (sharded.same, sharded.shard_dirs[tag]):
            report, written = read_report(out, tag), shard_records(out, tag)
            assert report["ok"] == len(written) >= 1
            stored = [int(rec["loss_mask"].sum()) for _, rec in written]
            completion = [sum(rows[e["id"]]["loss_mask"]) for e, _ in written]
            # Two turns per row: drafted trains one position less per turn.
            assert stored == [c - 2 for c in completion]
            assert report["trained_tokens"] == sum(stored)
            assert [e["trained"] for e, _ in written] == stored
            assert report["tokens"] == sum(rec["input_ids"].numel() for _, rec in written)
            top = max(written, key=lambda er: er[1]["input_ids"].numel())
            assert report["longest"] == {"id": top[0]["id"],
                                         "tokens": top[1]["input_ids"].numel()}


@pytest.mark.parametrize("layout", ["same", "split"])
def test_sharded_output_hands_off_all_shards_as_specforge_counts(sharded, sfh, tmp_path,
                                                                 layout):
    """Shards in one ``--out`` or in one ``--out`` each below a parent: ``hsdump specforge``
    on what SpecForge is given (``data.hidden_states_path``) covers every shard's records: the
    longest record, the trained tokens and the vocab mapping equal SpecForge's own count over
    the same directory, which no single shard gives."""
    root = getattr(sharded, layout)
    mapping = tmp_path / "vm.pt"
    rc, printed, report = run_handoff(root, "--draft-vocab-size", str(DRAFT_VOCAB),
                                      "--vocab-mapping", str(mapping))
    assert rc == 0, printed
    assert report["outputs"] == (["."] if layout == "same" else sharded.tags)
    rows = sharded.rows
    assert report["records"] == len(rows) and report["strays"] == []
    longest = max(len(r["input_ids"]) for r in rows)
    assert report["longest"]["tokens"] == longest
    assert overrides(printed)["data.max_length"] == str(longest)
    assert overrides(printed)["data.hidden_states_path"] == str(root.resolve())
    written = [rec for tag in sharded.tags
               for _, rec in shard_records(sharded.shard_dirs[tag] if layout == "split"
                                           else root, tag)]
    assert report["trained_tokens"] == sum(int(rec["loss_mask"].sum()) for rec in written)

    counts = sfh.count(str(root), max_length=longest, target_vocab_size=VOCAB)
    assert sum(counts.values()) == report["trained_tokens"]
    assert report["vocab_mapping"]["trained_tokens_counted"] == report["trained_tokens"]
    want_d2t, want_t2d = sfh.mappings(counts, DRAFT_VOCAB, VOCAB)
    got = torch.load(mapping, weights_only=True)
    assert torch.equal(got["d2t"], want_d2t) and torch.equal(got["t2d"], want_t2d)
    for tag in sharded.tags:  # no shard alone gives this mapping, nor the longest record
        alone = sfh.count(str(sharded.shard_dirs[tag]), max_length=longest,
                          target_vocab_size=VOCAB)
        assert not torch.equal(sfh.mappings(alone, DRAFT_VOCAB, VOCAB)[1], want_t2d)
    per_shard = [max(len(r["input_ids"]) for r in rows if Shard.parse(f"{i}/{SHARDS}")
                     .contains(r["id"])) for i in range(SHARDS)]
    assert min(per_shard) < longest  # a shard's own longest would cut another's records


def test_split_shards_strays_duplicates_and_mixed_outputs(sharded, tmp_path):
    """Below a parent of shard outputs, a record any shard's manifest owns is no stray; files
    no manifest owns (in a shard dir or beside them) are, and only they are removed; a sample
    with a record in two outputs is named (SpecForge would train it twice); outputs made
    differently are refused."""
    root = tmp_path / "split"
    shutil.copytree(sharded.split, root)
    owned = sorted(str(p.relative_to(root)) for p in root.rglob("*.ckpt"))
    assert {Path(p).parts[0] for p in owned} == set(sharded.tags)
    some = root / owned[-1]
    strays = [some.parent / "old-run.ckpt", root / "edited" / "x.ckpt"]
    strays[1].parent.mkdir()
    for s in strays:
        shutil.copy(some, s)
    rc, printed, report = run_handoff(root)
    assert rc == 1 and sorted(report["strays"]) == sorted(
        str(s.relative_to(root)) for s in strays), printed
    rc, printed, report = run_handoff(root, "--remove-strays")
    assert rc == 0 and report["strays_removed"], printed
    assert not any(s.exists() for s in strays)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.ckpt")) == owned

    # Shard 0 extracted again into another directory below the same parent.
    first = sharded.tags[0]
    shutil.copytree(root / first, root / "again")
    rc, printed, report = run_handoff(root)
    ids = {e["id"] for e, _ in shard_records(root / first, first)}
    assert rc == 1 and report["duplicates"] == {i: ["again", first] for i in sorted(ids)}
    assert "more than one output" in printed

    meta = json.loads((root / "again" / "hsdump-meta.json").read_text())
    meta["loss_mask_convention"] = "completion"
    (root / "again" / "hsdump-meta.json").write_text(json.dumps(meta))
    rc, printed, _ = run_handoff(root)
    assert rc == 1 and "made differently (loss_mask_convention:" in printed, printed
