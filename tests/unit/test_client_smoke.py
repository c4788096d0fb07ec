"""``hsdump smoke``'s checks without a server: which ran, and a requested one that cannot run.

Records are written by the client's own record builder and manifest, as an extraction writes
them; tests/server/test_client_extract.py runs the smoke against a real server.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.client import smoke
from hsdump_patch.client.output import records
from hsdump_patch.client.output.manifest import Manifest
from hsdump_patch.client.output.report import ExtractReport
from hsdump_patch.client.rows.dataset import Sample, Shard

INFO = protocol.ServerInfo(
    model="/m", architecture="LlamaForCausalLM", layers=(1, 2, 3), layers_source="test",
    has_final=True, hidden_size=8, num_hidden_layers=4, dtype="bfloat16", tp_size=1,
    rid_prefix="hsdump-", sglang_version="0.5.23", hsdump_version="0.1.0", pid=1)
PROMPT = [1, 5, 6, 7, 8, 9]
MASK = [0, 0, 0, 1, 1, 1]


def write_records(out: Path, samples: list[Sample], states: dict[str, torch.Tensor]) -> None:
    """One eagle3 record per sample, from its ``[L, S, H]`` states, listed in the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    with Manifest(out, Shard(0, 1)) as m:
        for s in samples:
            b = records.RecordBuilder("eagle3", len(s.input_ids), INFO)
            b.put(0, states[s.id])
            name = records.record_name(s.id, "eagle3")
            records.save_atomic(b.record(s.input_ids, s.loss_mask), out / name)
            m.append({"id": s.id, "file": name})


def run_checks(tmp_path: Path, samples: list[Sample], pair: tuple[str, str] | None,
               states: dict[str, torch.Tensor] | None = None
               ) -> dict[str, tuple[bool, str]]:
    """``validate`` over the records of ``samples`` (``states`` or random); name -> result."""
    rng = torch.Generator().manual_seed(0)
    states = states or {s.id: torch.randn(len(s.input_ids), 4, 8, generator=rng)
                        .to(torch.bfloat16) for s in samples}
    write_records(tmp_path, samples, states)
    report = ExtractReport(shard="0/1", fmt="eagle3", out=str(tmp_path), dataset="d.jsonl",
                           server="http://x", ok=len(samples), max_chunks=1)
    return {n: (ok, d) for n, ok, d in smoke.validate(
        tmp_path, "eagle3", INFO, samples, report, pair, "--dataset d.jsonl")}


def test_a_dataset_without_the_determinism_pair_fails_the_check_saying_why(tmp_path):
    samples = [Sample("x", "d.jsonl:1", PROMPT, MASK), Sample("y", "d.jsonl:2", PROMPT, MASK)]
    checks = run_checks(tmp_path, samples, smoke.DETERMINISM_PAIR)
    assert checks["records"][0] and checks["extraction"][0]
    ok, detail = checks["determinism"]
    assert not ok
    assert detail == ("requested but cannot run: no sample 'determinism-a' in --dataset d.jsonl; "
                      "no sample 'determinism-b' in --dataset d.jsonl. Name two rows of one "
                      "prompt with --determinism ID_A,ID_B, or skip the check with "
                      "--determinism none")


def test_a_pair_of_different_prompts_or_unextracted_records_cannot_be_compared(tmp_path):
    other = [*PROMPT[:-1], 42]
    samples = [Sample("x", "d.jsonl:1", PROMPT, MASK), Sample("y", "d.jsonl:2", other, MASK)]
    ok, detail = run_checks(tmp_path / "differ", samples, ("x", "y"))["determinism"]
    assert not ok and "cannot run: 'x' and 'y' are different prompts" in detail
    same = [Sample("x", "d.jsonl:1", PROMPT, MASK), Sample("y", "d.jsonl:2", PROMPT, MASK)]
    state = torch.randn(len(PROMPT), 4, 8).to(torch.bfloat16)
    write_records(tmp_path / "one", same[:1], {"x": state})  # 'y' was never written
    loaded = {"x": records.load_record(tmp_path / "one" / records.record_name("x"))}
    _, ok, detail = smoke.check_determinism(("x", "y"), same, loaded, "--dataset d.jsonl")
    assert not ok and "cannot run: 'y' was not extracted" in detail


def test_a_named_pair_is_compared_bitwise(tmp_path):
    samples = [Sample("x", "d.jsonl:1", PROMPT, MASK), Sample("y", "d.jsonl:2", PROMPT, MASK)]
    state = torch.randn(len(PROMPT), 4, 8).to(torch.bfloat16)
    checks = run_checks(tmp_path / "same", samples, ("x", "y"), {"x": state, "y": state})
    assert checks["determinism"] == (True, "'x' and 'y', one prompt: bitwise identical")
    changed = state.clone()
    changed[2, 1, 3] += 1  # one value of one layer differs
    checks = run_checks(tmp_path / "differ", samples, ("x", "y"), {"x": state, "y": changed})
    assert checks["determinism"] == (False, "'x' and 'y', one prompt: bitwise DIFFERENT")
    assert "determinism" not in run_checks(tmp_path / "none", samples, None)


def test_the_verdict_names_the_checks_run_and_skipped(tmp_path, capsys):
    checks = [("server.json", True, "s"), ("records", True, "r"), ("determinism", False, "d")]
    path = tmp_path / "r" / "report.json"
    assert smoke.finish(path, {"server": "u"}, checks, []) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (f"hsdump smoke: FAIL (determinism) (checks run: server.json, records, "
                    f"determinism; report: {path})")
    report = json.loads(path.read_text())
    assert not report["passed"] and report["ran"] == ["server.json", "records", "determinism"]
    assert report["skipped"] == []

    skipped = [("determinism", "not requested (--determinism none)")]
    assert smoke.finish(path, {"server": "u"}, checks[:2], skipped) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["  skip determinism: not requested (--determinism none)",
                          f"hsdump smoke: PASS (checks run: server.json, records; skipped: "
                          f"determinism; report: {path})"]
    report = json.loads(path.read_text())
    assert report["passed"] and report["ran"] == ["server.json", "records"]
    assert report["skipped"] == [{"check": "determinism",
                                  "why": "not requested (--determinism none)"}]


@pytest.mark.parametrize(("text", "pair"), [("none", None), ("a, b", ("a", "b")),
                                            ("NONE", None)])
def test_determinism_flag_parses_a_pair_or_none(text, pair):
    assert smoke.determinism_pair(text) == pair


@pytest.mark.parametrize("text", ["a", "a,a", "a,b,c", "a,"])
def test_determinism_flag_refuses_what_is_not_two_ids(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not two different ids"):
        smoke.determinism_pair(text)
