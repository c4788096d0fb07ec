"""``hsdump specforge``: hand an extract output directory to SpecForge's offline trainer.

SpecForge 0.2.0 (``specforge train``, offline mode) lists every ``.ckpt`` / ``.ckpt.gz`` under
``data.hidden_states_path`` recursively, cuts each record to ``data.max_length`` tokens without
a word (default 2048), and, with an empty ``model.vocab_mapping_path``, reads every record on
every rank before step 1 to count the trained tokens for its draft vocabulary. This command
reads the manifests and records under ``--out`` once: one ``--format specforge`` output (its
shards' manifests side by side), or a directory holding several (shards extracted to their own
``--out``, e.g. Ansible's ``shard-K-of-N`` directories), exactly the files SpecForge lists
there. It prints:

* the longest record and the ``data.max_length`` that cuts none; with ``--max-length N``, every
  record a trainer limit of N would cut (exit 1);
* the ``.ckpt`` files no manifest owns (another run, an edited dataset), which SpecForge's
  listing would train on too; ``--remove-strays`` deletes them; sample ids with a record in
  more than one output (trained twice);
* with ``--draft-vocab-size``, SpecForge's vocab mapping file (``d2t`` / ``t2d``), computed as
  SpecForge 0.2.0 computes it from the same records (``specforge/training/vocab_mapping.py``
  ``count_effective_feature_tokens`` and ``specforge/data/preprocessing.py``
  ``process_token_dict_to_mappings``), for ``model.vocab_mapping_path``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hsdump_patch import protocol
from hsdump_patch.client.output.records import META_FILE
from hsdump_patch.reader import load_record, manifest_entries

# SpecForge 0.2.0 specforge/runtime/data_plane/offline_reader.py: _FEATURE_SUFFIXES
SPECFORGE_SUFFIXES = (".ckpt", ".ckpt.gz")
SPECFORGE_DEFAULT_MAX_LENGTH = 2048  # SpecForge 0.2.0 DataConfig.max_length
DEFAULT_MAPPING_NAME = "specforge-vocab-mapping.pt"
DEFAULT_REPORT_NAME = "specforge-report.json"
EXIT_OK, EXIT_PROBLEM = 0, 1


@dataclass
class Handoff:
    """What ``hsdump specforge`` found in an output directory (the JSON report)."""

    out: str
    outputs: list[str] = field(default_factory=list)  # extract outputs under ``out``, relative
    records: int = 0
    tokens: int = 0
    trained_tokens: int | None = None  # mask-1 tokens per the manifests (None: older manifests)
    longest: dict[str, Any] | None = None
    max_length: int | None = None
    cut: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    strays_removed: bool = False
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # id -> outputs holding it
    vocab_mapping: dict[str, Any] | None = None
    overrides: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# Sidecar fields that must agree between outputs trained together: records SpecForge can batch
# together, from one model, under one loss-mask convention.
_SAME_RECORDS = ("format", "model", "layers", "has_final", "hidden_size", "dtype",
                 "loss_mask_convention")


def find_outputs(root: Path) -> dict[Path, dict[str, Any]]:
    """``output dir -> sidecar`` of every extract output SpecForge's listing of ``root`` covers:
    ``root`` itself and every directory below it holding a :data:`META_FILE`; all must hold
    ``--format specforge`` records of one model, layers and loss-mask convention."""
    outputs: dict[Path, dict[str, Any]] = {}
    for d, dirs, names in os.walk(root):
        dirs.sort()
        if META_FILE in names:
            meta = json.loads((Path(d) / META_FILE).read_text())
            meta.setdefault("loss_mask_convention", "completion")  # sidecars before --loss-mask
            outputs[Path(d)] = meta
    if not outputs:
        raise ValueError(f"{root} holds no {META_FILE}, nor does any directory below it: not an "
                         "hsdump extract output directory (nor a parent of shard outputs)")
    first, ref = next(iter(outputs.items()))
    for d, meta in outputs.items():
        if meta.get("format") != "specforge":
            raise ValueError(f"{d} holds --format {meta.get('format')} records; SpecForge reads "
                             "--format specforge output (extract again with --format specforge)")
        diff = [k for k in _SAME_RECORDS if meta.get(k) != ref.get(k)]
        if diff:
            shown = ", ".join(f"{k}: {ref.get(k)!r} vs {meta.get(k)!r}" for k in diff)
            raise ValueError(f"{first} and {d} hold records made differently ({shown}), and "
                             f"SpecForge would train on both under {root}: hand them off from "
                             "separate directories")
    return outputs


def owned_records(root: Path, outputs: list[Path]) -> tuple[dict[str, dict[str, Any]], list[str],
                                                            dict[str, list[str]]]:
    """``file -> manifest entry`` (files relative to ``root``) for every record the outputs'
    manifests own and that exists; the manifest files whose record is missing; the sample ids
    with a record in more than one output (-> those outputs)."""
    owned: dict[str, dict[str, Any]] = {}
    missing: set[str] = set()
    holders: dict[str, set[str]] = {}
    for out in outputs:
        for entry in manifest_entries(out):
            rel = os.path.relpath(out / entry["file"], root)
            if (root / rel).is_file():
                owned[rel] = entry  # a later line (a redone sample) wins
                holders.setdefault(entry["id"], set()).add(os.path.relpath(out, root))
            else:
                missing.add(rel)
    duplicates = {i: sorted(h) for i, h in sorted(holders.items()) if len(h) > 1}
    return owned, sorted(missing - set(owned)), duplicates


def listed_by_specforge(out: Path) -> list[str]:
    """Every file SpecForge 0.2.0's offline listing picks up under ``out`` (``os.walk``, by
    suffix), relative to ``out``, in its order (sorted absolute paths)."""
    found = []
    for root, _dirs, names in os.walk(out):
        found += [os.path.relpath(os.path.join(root, n), out) for n in names
                  if n.endswith(SPECFORGE_SUFFIXES)]
    return sorted(found, key=lambda rel: os.path.abspath(out / rel))


def count_trained_tokens(paths: list[Path], max_length: int | None,
                         target_vocab_size: int | None, progress: bool = False) -> Counter:
    """Frequency of each token id under ``loss_mask`` (first ``max_length`` tokens), in the
    insertion order SpecForge's own count has: files in order, ids ascending per file (ties in
    the top-N choice follow it)."""
    counts: Counter = Counter()
    for path in tqdm(paths, desc="counting trained tokens", unit="record", disable=not progress,
                     file=sys.stderr):
        rec = load_record(path)
        ids, mask = rec["input_ids"].reshape(-1), rec["loss_mask"].reshape(-1)
        if ids.numel() != mask.numel():
            raise ValueError(f"{path}: {ids.numel()} input ids but {mask.numel()} mask entries")
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        token_ids, freqs = ids[mask.to(torch.bool)].unique(return_counts=True)
        for tok, freq in zip(token_ids.tolist(), freqs.tolist(), strict=True):
            if tok < 0 or (target_vocab_size is not None and tok >= target_vocab_size):
                raise ValueError(f"{path}: token id {tok} outside the target vocabulary "
                                 f"[0, {target_vocab_size})")
            counts[tok] += freq
    return counts


def vocab_mapping(counts: Counter, draft_vocab_size: int,
                  target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge's ``d2t`` [draft] int64 (target id - draft id) and ``t2d`` [target] bool.

    The draft vocabulary is the ``draft_vocab_size`` most frequent trained ids (ties in count
    order); too few distinct ids are topped up with unseen ids below ``draft_vocab_size``, in
    the order SpecForge 0.2.0 adds them (iteration of the same set difference).
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"--draft-vocab-size {draft_vocab_size} must be in "
                         f"[1, --target-vocab-size {target_vocab_size}]")
    counts = Counter(counts)
    if len(counts) < draft_vocab_size:
        for tok in set(range(draft_vocab_size)) - set(counts.keys()):
            counts[tok] = 0
            if len(counts) >= draft_vocab_size:
                break
    used = sorted(tok for tok, _ in counts.most_common(draft_vocab_size))
    d2t = torch.tensor([tok - i for i, tok in enumerate(used)], dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.tensor(used, dtype=torch.int64)] = True
    return d2t, t2d


def save_mapping(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Write ``{"d2t", "t2d"}`` as SpecForge's ``load_vocab_mapping`` reads it (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with protocol.atomic_file(path, mode=protocol.PUBLIC_FILE_MODE) as f:
        torch.save({"d2t": d2t, "t2d": t2d}, f)


def target_vocab_from_model(meta: dict[str, Any]) -> int:
    """``vocab_size`` of the extracted model's ``config.json`` (``text_config`` for nested
    checkpoints such as Kimi-K2.5)."""
    config = Path(str(meta.get("model"))) / "config.json"
    if not config.is_file():
        raise ValueError(f"no {config} to read the target vocab size from (the model of "
                         f"{META_FILE}); pass --target-vocab-size")
    cfg = json.loads(config.read_text())
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise ValueError(f"{config} names no vocab_size; pass --target-vocab-size")
    return size


def handoff(out: Path, *, max_length: int | None = None, remove_strays: bool = False,
            draft_vocab_size: int | None = None, target_vocab_size: int | None = None,
            mapping_path: Path | None = None, progress: bool = False) -> Handoff:
    """Inspect ``out`` (an extract output, or a parent of several) for SpecForge and act on
    the flags; return what was found."""
    outputs = find_outputs(out)
    res = Handoff(out=str(out), outputs=[os.path.relpath(d, out) for d in outputs])
    owned, res.missing, res.duplicates = owned_records(out, list(outputs))
    res.records = len(owned)
    res.tokens = sum(int(e["tokens"]) for e in owned.values())
    if all("trained" in e for e in owned.values()):  # manifests before "trained" lack it
        res.trained_tokens = sum(int(e["trained"]) for e in owned.values())
    if not owned:
        res.problems.append("no finished record in the manifests")
    else:
        file, top = max(owned.items(), key=lambda fe: (int(fe[1]["tokens"]), fe[1]["id"]))
        res.longest = {"id": top["id"], "file": file, "tokens": int(top["tokens"])}
    if res.duplicates:
        res.problems.append(f"{len(res.duplicates)} sample id(s) have a record in more than one "
                            "output: SpecForge would train them more than once")
    res.max_length = max_length if max_length is not None else (
        res.longest["tokens"] if res.longest else None)
    if max_length is not None:
        res.cut = [{"id": e["id"], "file": f, "tokens": int(e["tokens"])}
                   for f, e in sorted(owned.items()) if int(e["tokens"]) > max_length]
        if res.cut:
            res.problems.append(f"{len(res.cut)} record(s) longer than --max-length "
                                f"{max_length}: SpecForge would cut them")
    res.strays = [f for f in listed_by_specforge(out) if f not in owned]
    if res.strays and remove_strays:
        for rel in res.strays:
            (out / rel).unlink(missing_ok=True)
        res.strays_removed = True
    elif res.strays:
        res.problems.append(f"{len(res.strays)} .ckpt file(s) no manifest owns would be "
                            "trained on too (--remove-strays deletes them)")
    res.overrides = {"data.hidden_states_path": str(out.resolve())}
    if res.max_length is not None:
        res.overrides["data.max_length"] = str(res.max_length)

    files = [out / f for f in sorted(owned, key=lambda f: os.path.abspath(out / f))]
    if draft_vocab_size is not None and owned:
        if res.strays and not res.strays_removed:
            raise ValueError("not writing the vocab mapping: SpecForge would count the stray "
                             "files too; remove them first (--remove-strays)")
        target = target_vocab_size or target_vocab_from_model(next(iter(outputs.values())))
        counts = count_trained_tokens(files, res.max_length, target, progress)
        d2t, t2d = vocab_mapping(counts, draft_vocab_size, target)
        path = mapping_path or out / DEFAULT_MAPPING_NAME
        save_mapping(path, d2t, t2d)
        counted = sum(counts.values())
        covered = sum(counts[int(t)] for t in t2d.nonzero().flatten().tolist())
        res.vocab_mapping = {
            "path": str(path.resolve()), "draft_vocab_size": draft_vocab_size,
            "target_vocab_size": target,
            "distinct_trained_ids": sum(c > 0 for c in counts.values()),
            "trained_tokens_counted": counted,
            "trained_tokens_covered": round(covered / max(counted, 1), 6),
            "counted_up_to": res.max_length}
        res.overrides["model.vocab_mapping_path"] = str(path.resolve())
    return res


def print_handoff(res: Handoff) -> None:
    """The human summary: longest record, cuts, strays, mapping, the overrides to pass."""
    print(f"hsdump specforge: {res.out}")
    if res.outputs != ["."]:
        print(f"  extract outputs: {len(res.outputs)} ({', '.join(res.outputs)})")
    trained = "" if res.trained_tokens is None else f", {res.trained_tokens:,} trained"
    print(f"  records: {res.records:,} ({res.tokens:,} tokens{trained})")
    if res.longest:
        print(f"  longest record: {res.longest['tokens']:,} tokens ({res.longest['id']}, "
              f"{res.longest['file']})")
        if res.longest["tokens"] > SPECFORGE_DEFAULT_MAX_LENGTH:
            print(f"  note: SpecForge's default data.max_length {SPECFORGE_DEFAULT_MAX_LENGTH} "
                  "would cut records without a word: set it as below")
    for rec in res.cut:
        print(f"  cut at --max-length {res.max_length}: {rec['id']} ({rec['tokens']:,} tokens, "
              f"{rec['file']})")
    for rel in res.missing:
        print(f"  missing record (in the manifest, not on disk): {rel}")
    verb = "removed" if res.strays_removed else "no manifest owns it"
    for rel in res.strays:
        print(f"  stray ({verb}): {rel}")
    for sample_id, holders in res.duplicates.items():
        print(f"  sample {sample_id} has a record in each of: {', '.join(holders)}")
    if res.vocab_mapping:
        vm = res.vocab_mapping
        print(f"  vocab mapping: {vm['path']} (draft {vm['draft_vocab_size']:,} of target "
              f"{vm['target_vocab_size']:,} ids; {vm['distinct_trained_ids']:,} distinct trained "
              f"ids; covers {vm['trained_tokens_covered']:.2%} of "
              f"{vm['trained_tokens_counted']:,} trained tokens)")
    print("specforge train overrides: " + " ".join(f"{k}={v}" for k, v in res.overrides.items()))
    for problem in res.problems:
        print(f"PROBLEM: {problem}")


def add_parser(subparsers: Any) -> None:
    """Register ``hsdump specforge``."""
    p = subparsers.add_parser(
        "specforge", help="check an extract output for SpecForge and write its vocab mapping",
        description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True,
                   help="the hsdump extract --format specforge output directory, or a parent of "
                        "several (one per shard), as given to SpecForge's "
                        "data.hidden_states_path (required)")
    p.add_argument("--max-length", type=int, default=None,
                   help="the trainer's data.max_length: name every record it would cut and "
                        "exit 1 (default: none; the longest record is printed as the value "
                        f"to set; SpecForge's own default is {SPECFORGE_DEFAULT_MAX_LENGTH})")
    p.add_argument("--remove-strays", action="store_true",
                   help=".ckpt/.ckpt.gz files under --out that no manifest owns: delete them "
                        "(default off: list them and exit 1)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="write SpecForge's vocab mapping (d2t/t2d) for a drafter with this "
                        "vocabulary, e.g. 32000 (default: none, no mapping written)")
    p.add_argument("--target-vocab-size", type=int, default=None,
                   help="the target model's vocabulary size (default: vocab_size in the "
                        f"config.json of the model named in {META_FILE})")
    p.add_argument("--vocab-mapping", type=Path, default=None,
                   help=f"where to write the mapping (default OUT/{DEFAULT_MAPPING_NAME})")
    p.add_argument("--report", type=Path, default=None,
                   help=f"JSON report path (default OUT/{DEFAULT_REPORT_NAME})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``hsdump specforge``: exit 0 ready to train, 1 on a problem (cut records, strays
    left, bad directory)."""
    try:
        res = handoff(args.out, max_length=args.max_length, remove_strays=args.remove_strays,
                      draft_vocab_size=args.draft_vocab_size,
                      target_vocab_size=args.target_vocab_size, mapping_path=args.vocab_mapping,
                      progress=not args.no_progress)
    except (ValueError, OSError, KeyError) as e:
        print(f"hsdump specforge: error: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    path = args.report or args.out / DEFAULT_REPORT_NAME
    protocol.write_json_atomic(path, res.__dict__)
    print_handoff(res)
    print(f"report: {path}")
    return EXIT_PROBLEM if res.problems else EXIT_OK
