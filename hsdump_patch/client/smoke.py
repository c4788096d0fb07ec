"""The ``hsdump smoke`` sub-command: a small end-to-end extraction, then its validation.

It extracts a built-in multi-turn prompt set (or ``--dataset``) through the real server and
checks every record: keys, shapes and dtype against ``server.json``, finite values, token ids
and loss mask equal to what was sent, a non-empty loss mask, chunk coverage (checked while
assembling), determinism (two rows of one prompt, ``--determinism``, give bitwise-identical
states) and a clean dump dir afterwards; then a short greedy ``hsdump regenerate`` of two
built-in rows. A requested check that cannot run fails; ``--determinism none`` skips that one.
One line per check, a verdict naming the checks that ran, a JSON report, exit code 0 only on
PASS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from hsdump_patch import protocol
from hsdump_patch.client import extract as ex
from hsdump_patch.client import regenerate as rg
from hsdump_patch.client.buffers import torch_dtype
from hsdump_patch.client.output import records
from hsdump_patch.client.output.manifest import load_done
from hsdump_patch.client.rows.conversation import prompt_ids
from hsdump_patch.client.rows.dataset import Sample, index_dataset, iter_samples
from hsdump_patch.client.rows.schema import REGENERATED, TOKEN_IDS
from hsdump_patch.client.server.api import ServerDown
from hsdump_patch.client.server.tokenizer import load_tokenizer

DEFAULT_REPORT = "hsdump-smoke-report.json"
_LONG = " ".join([
    "Hidden states from decoder layers are dumped to shared memory.",
    "EAGLE speculative decoding drafts tokens with a small model.",
    "The quick brown fox jumps over the lazy dog.",
] * 8)
# Multi-turn, both chat shapes, one prompt long enough to span several prefill chunks on a
# server with a small --chunked-prefill-size, and one conversation twice (determinism).
_REPEATED = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "Paris is the capital of France."}]
BUILTIN_ROWS: list[dict[str, Any]] = [
    {"id": "openai-multi-turn", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world, what is speculative decoding?"},
        {"role": "assistant", "content": "A small model drafts tokens and a big one checks."},
        {"role": "user", "content": "Which hidden states does EAGLE use?"},
        {"role": "assistant", "content": "Hidden states from decoder layers of the target."},
    ]},
    {"id": "sharegpt-multi-turn", "conversations": [
        {"from": "human", "value": "Tell me about the quick brown fox."},
        {"from": "gpt", "value": "It jumps over the lazy dog."},
        {"from": "human", "value": "And then?"},
        {"from": "gpt", "value": "Then it rests."},
    ]},
    {"id": "long-prompt", "messages": [
        {"role": "user", "content": _LONG},
        {"role": "assistant", "content": "That was a long prompt. " + _LONG[:200]},
    ]},
    {"id": "determinism-a", "messages": _REPEATED},
    {"id": "determinism-b", "messages": _REPEATED},
]
DETERMINISM_PAIR = ("determinism-a", "determinism-b")
REGEN_NEW_TOKENS = 8  # the short regeneration: two built-in rows, 8 tokens per turn


def check_record(rec: dict[str, Any], fmt: str, info: protocol.ServerInfo,
                 sample: Sample) -> list[str]:
    """Return the problems of one loaded record (empty when it is valid)."""
    n, h, k = len(sample.input_ids), info.hidden_size, len(info.layers)
    dtype = torch_dtype(info.dtype)
    final_key = records.NEEDS_FINAL[fmt]
    if final_key not in rec:  # what the trainer indexes: the target is lm_head of it
        return [f"no {final_key} (the post-final-norm state {fmt} training needs): restart the "
                "server with SGLANG_HS_DUMP_FINAL=1"]
    if fmt == "eagle3":
        hidden = {f"hidden_states[{i}]": (t, (n, h)) for i, t in enumerate(rec["hidden_states"])}
        hidden[final_key] = (rec[final_key], (n, h))
        if len(rec["hidden_states"]) != k:
            return [f"{len(rec['hidden_states'])} hidden_states, expected {k}"]
    else:  # SpecForge's batch dimension
        hidden = {"aux_hidden_state": (rec["aux_hidden_state"], (1, n, k * h)),
                  final_key: (rec[final_key], (1, n, h))}
    problems = []
    for name, (t, shape) in hidden.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            problems.append(f"{name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
        elif not torch.isfinite(t).all():
            problems.append(f"{name} has non-finite values")
    if rec["input_ids"].tolist() != sample.input_ids:
        problems.append("input_ids differ from the ids sent")
    if rec["loss_mask"].tolist() != sample.loss_mask:
        problems.append("loss_mask differs from the mask computed")
    if not rec["loss_mask"].any():
        problems.append("loss_mask is all zeros")
    return problems


def _hidden_tensors(rec: dict[str, Any]) -> list[torch.Tensor]:
    return [v for key, v in sorted(rec.items()) if key not in ("input_ids", "loss_mask")
            for v in (v if isinstance(v, list) else [v])]


def check_determinism(pair: tuple[str, str], samples: list[Sample],
                      loaded: dict[str, dict[str, Any]], source: str) -> tuple[str, bool, str]:
    """The records of the two samples ``pair`` names, one prompt, must be bitwise identical.

    Requested, so a pair that cannot be compared fails, saying why: a sample missing from
    ``source``, two different prompts, or a record not extracted.
    """
    by_id = {s.id: s for s in samples}
    why = [f"no sample {i!r} in {source}" for i in pair if i not in by_id]
    if not why and by_id[pair[0]].input_ids != by_id[pair[1]].input_ids:
        why.append(f"{pair[0]!r} and {pair[1]!r} are different prompts")
    if not why:
        why = [f"{i!r} was not extracted" for i in pair if i not in loaded]
    if why:
        return ("determinism", False, "requested but cannot run: " + "; ".join(why) + ". Name "
                "two rows of one prompt with --determinism ID_A,ID_B, or skip the check with "
                "--determinism none")
    a, b = (_hidden_tensors(loaded[i]) for i in pair)
    same = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return ("determinism", same, f"{pair[0]!r} and {pair[1]!r}, one prompt: bitwise "
            + ("identical" if same else "DIFFERENT"))


def validate(out: Path, fmt: str, info: protocol.ServerInfo, samples: list[Sample],
             report: Any, pair: tuple[str, str] | None, source: str = "the dataset"
             ) -> list[tuple[str, bool, str]]:
    """Run every check (determinism only with a ``pair``); return ``(name, passed, detail)``
    rows."""
    checks = [("server.json", True,
               f"layers {list(info.layers)}{' + final' if info.has_final else ''}, hidden "
               f"{info.hidden_size}, {info.dtype}, sglang {info.sglang_version}")]
    bad = [f"{i.where or i.id}: {i.reason}" for i in report.issues]
    checks.append(("extraction", not bad and not report.stopped and report.ok == len(samples),
                   f"{report.ok}/{len(samples)} samples, {report.tokens} tokens, up to "
                   f"{report.max_chunks} chunk(s) per sample" + "".join(f"; {b}" for b in bad)
                   + (f"; stopped: {report.stopped}" if report.stopped else "")))
    loaded: dict[str, dict[str, Any]] = {}
    problems = []
    done = load_done(out)
    for sample in samples:
        if sample.id not in done:
            continue
        loaded[sample.id] = rec = records.load_record(out / done[sample.id]["file"])
        problems += [f"{sample.id}: {p}" for p in check_record(rec, fmt, info, sample)]
    checks.append(("records", bool(loaded) and not problems,
                   "; ".join(problems) or f"{len(loaded)} {fmt} records: "
                   f"{records.NEEDS_FINAL[fmt]} present, shapes, dtype, finite, ids, non-empty "
                   "loss mask"))
    if pair is not None:
        checks.append(check_determinism(pair, samples, loaded, source))
    checks.append(("dump dir clean", report.leftover_dump_dirs == 0,
                   f"{report.leftover_dump_dirs} request dir(s) left"))
    return checks


def check_regeneration(args: argparse.Namespace, work: Path, tokenizer: Any
                       ) -> tuple[str, bool, str]:
    """A short greedy ``hsdump regenerate`` of two built-in rows (no dump: plain rids): every
    turn up to the row's first cut one regenerated, and the last turn's ids equal
    ``/generate``'s for the same prompt."""
    data, out = work / "regen-in.jsonl", work / "regen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in BUILTIN_ROWS[:2]))
    report = rg.regenerate(rg.parse_args([
        "--server", args.server, "--dataset", str(data), "--out", str(out), "--no-progress",
        "--max-new-tokens", str(REGEN_NEW_TOKENS), "--temperature", "0", "--concurrency", "2",
        "--on-error", "skip", *(["--model", args.model] if args.model else []),
        *(["--trust-remote-code"] if args.trust_remote_code else [])]))
    problems = [f"{i.where or i.id}: {i.reason}" for i in report.issues]
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    client = rg.RegenClient(args.server, request_timeout=args.request_timeout, retries=0,
                            retry_wait=args.retry_wait)
    for row in rows:
        msgs, turns = row["messages"], row[REGENERATED]["turns"]
        problems += [f"{row['id']}: turn {k} has no token_ids" for k in turns
                     if not msgs[k].get(TOKEN_IDS)]
        ids = prompt_ids(tokenizer, msgs[: turns[-1]], row.get("tools"))
        again = client.post("/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": REGEN_NEW_TOKENS}})["output_ids"]
        if again != msgs[turns[-1]].get(TOKEN_IDS):
            problems.append(f"{row['id']}: /generate gives other ids for the last prompt")
    if len(rows) != 2:
        problems.append(f"{len(rows)}/2 rows regenerated")
    return ("regeneration", not problems, "; ".join(problems) or
            f"{len(rows)} rows, {report.turns} turns, {report.tokens} tokens; the ids equal "
            "/generate's for the same prompt")


def add_parser(subparsers: Any) -> None:
    """Register ``hsdump smoke``."""
    p = subparsers.add_parser("smoke", help="extract a few prompts end to end and validate them",
                              description=__doc__.splitlines()[0])
    ex.add_common_args(p)
    p.add_argument("--dataset", type=Path, default=None,
                   help="JSONL to use instead of the built-in prompts (default: the built-in "
                        "prompts)")
    p.add_argument("--determinism", type=determinism_pair, default=DETERMINISM_PAIR,
                   metavar="ID_A,ID_B|none",
                   help="two rows holding one prompt, whose states must be bitwise identical; "
                        "a pair the dataset lacks fails the check, 'none' skips it (default: "
                        f"{','.join(DETERMINISM_PAIR)}, rows of the built-in prompts)")
    p.add_argument("--out", type=Path, default=None,
                   help="keep the records here (default: a temp dir, deleted afterwards)")
    p.add_argument("--report", type=Path, default=Path(DEFAULT_REPORT),
                   help=f"JSON report path (default ./{DEFAULT_REPORT})")
    p.set_defaults(func=main)


def determinism_pair(text: str) -> tuple[str, str] | None:
    """``--determinism``: two different row ids, comma separated, or ``none``."""
    if text.strip().lower() == "none":
        return None
    ids = tuple(i.strip() for i in text.split(","))
    if len(ids) != 2 or not all(ids) or ids[0] == ids[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not two different ids ID_A,ID_B or none")
    return ids[0], ids[1]


def finish(path: Path, verdict: dict[str, Any], checks: list[tuple[str, bool, str]],
           skipped: list[tuple[str, str]]) -> int:
    """Print one line per check and the verdict, naming the checks that ran and those skipped;
    write the JSON report to ``path``. Return the exit code: 0 on PASS, 1 on FAIL."""
    passed = all(ok for _, ok, _ in checks)
    verdict.update(passed=passed, checks=[{"check": n, "passed": ok, "detail": d}
                                          for n, ok, d in checks],
                   ran=[n for n, _, _ in checks],
                   skipped=[{"check": n, "why": why} for n, why in skipped])
    path.parent.mkdir(parents=True, exist_ok=True)
    protocol.write_json_atomic(path, verdict)
    for name, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    for name, why in skipped:
        print(f"  skip {name}: {why}")
    failed = [n for n, ok, _ in checks if not ok]
    ran = f"checks run: {', '.join(n for n, _, _ in checks)}" + "".join(
        f"; skipped: {n}" for n, _ in skipped)
    print(f"hsdump smoke: {'PASS' if passed else 'FAIL (' + ', '.join(failed) + ')'} "
          f"({ran}; report: {path})", file=sys.stdout)
    return 0 if passed else 1


def main(args: argparse.Namespace) -> int:
    """Run ``hsdump smoke``; 0 on PASS, 1 on FAIL."""
    work = Path(tempfile.mkdtemp(prefix="hsdump-smoke-"))
    try:
        return _run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    dataset, pair = args.dataset, args.determinism
    source = f"--dataset {dataset}"
    skipped: list[tuple[str, str]] = (
        [] if pair else [("determinism", "not requested (--determinism none)")])
    if dataset is None:
        # A fresh id prefix per run, so concurrent smokes never share a rid.
        tag = os.urandom(4).hex()
        dataset, source = work / "smoke.jsonl", "the built-in prompts"
        dataset.write_text("".join(json.dumps({**r, "id": f"smoke-{tag}-{r['id']}"}) + "\n"
                                   for r in BUILTIN_ROWS))
        builtin = {r["id"] for r in BUILTIN_ROWS}
        if pair:
            a, b = (f"smoke-{tag}-{i}" if i in builtin else i for i in pair)
            pair = (a, b)
    out = args.out or work / "records"
    settings = ex.settings_from_args(args, out, concurrency=1, on_error="skip")
    verdict: dict[str, Any] = {"server": args.server, "dump_dir": str(args.dump_dir)}
    try:
        prepared = ex.prepare(settings, model=args.model, rid_prefix=args.rid_prefix,
                              trust_remote_code=args.trust_remote_code,
                              multi_turn=args.multi_turn, reasoning_parser=args.reasoning_parser)
        report = ex.extract(settings, dataset, max_len=args.max_len, prepared=prepared)
        info = prepared.info
        refs, _ = index_dataset(dataset)
        # The renderer extract used: the samples the records must hold.
        samples = [s for s in iter_samples(dataset, refs, prepared.renderer, args.max_len)
                   if isinstance(s, Sample)]
        tokenizer = prepared.renderer.tokenizer if prepared.renderer else load_tokenizer(
            prepared.tokenizer_path, prepared.trust_remote_code)
        checks = validate(out, args.fmt, info, samples, report, pair, source)
        checks.append(check_regeneration(args, work, tokenizer))
        verdict["report"] = report.to_json()
    except (ServerDown, protocol.ProtocolError, ValueError, RuntimeError, OSError) as e:
        checks = [("setup", False, str(e))]
    return finish(args.report, verdict, checks, skipped)
