"""Client output without a server: record formats, atomic writes, sidecar, manifest/resume."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.client.output import records
from hsdump_patch.client.output.manifest import (
    Manifest,
    load_done,
    manifest_path,
    remove_stale_temps,
)
from hsdump_patch.client.rows.dataset import Shard


def server_info(has_final: bool = True, layers=(1, 2, 3)) -> protocol.ServerInfo:
    return protocol.ServerInfo(
        model="/m", architecture="LlamaForCausalLM", layers=layers, layers_source="test",
        has_final=has_final, hidden_size=8, num_hidden_layers=4, dtype="bfloat16", tp_size=1,
        rid_prefix="hsdump-", sglang_version="0.5.23", hsdump_version="0.1.0", pid=1)


def build(fmt: str, info: protocol.ServerInfo, length: int = 10, split: int = 4):
    """Fill a builder from two chunks of a known [L, S, H] tensor; return (record, full)."""
    slots = len(info.layers) + int(info.has_final)
    full = torch.randn(length, slots, info.hidden_size).to(torch.bfloat16)
    b = records.RecordBuilder(fmt, length, info)
    b.put(split, full[split:])  # chunk order must not matter
    b.put(0, full[:split])
    return b.record(list(range(length)), [0] * 5 + [1] * 5), full


@pytest.mark.parametrize("has_final", [True, False])
def test_eagle3_record_layout_round_trips_through_weights_only_load(tmp_path, has_final):
    info = server_info(has_final)
    rec, full = build("eagle3", info)
    path = tmp_path / records.record_name("a/b c")
    size = records.save_atomic(rec, path)
    assert path.name == "a_b_c-" + hashlib.sha256(b"a/b c").hexdigest()[:16] + ".pt"
    assert size == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    got = records.load_record(path)
    assert set(got) == {"input_ids", "loss_mask", "hidden_states"} | (
        {"final_hidden_state"} if has_final else set())
    assert got["input_ids"].dtype == got["loss_mask"].dtype == torch.long
    assert len(got["hidden_states"]) == 3
    for s, t in enumerate(got["hidden_states"]):
        assert t.shape == (10, 8) and t.dtype == torch.bfloat16 and torch.equal(t, full[:, s])
    if has_final:
        assert torch.equal(got["final_hidden_state"], full[:, 3])


@pytest.mark.parametrize("compress", [False, True])
def test_specforge_record_has_specforges_layout_and_ascending_layer_order(tmp_path, compress):
    """SpecForge's prepare_hidden_states.py: [1, L, K*H] / [1, L, H] with a batch dimension,
    ``.ckpt`` (``.ckpt.gz`` gzipped); SGLang serving concatenates layers in ascending order."""
    info = server_info(layers=(5, 1, 3))  # slots 0, 1, 2 hold layers 5, 1, 3
    rec, full = build("specforge", info)
    name = records.record_name("s-1", "specforge", compress)
    assert name == f"rows_{hashlib.sha256(b's-1').hexdigest()[:2]}/s-1.ckpt" + (
        ".gz" if compress else "")
    records.save_atomic(rec, tmp_path / name, compress)
    raw = (tmp_path / name).read_bytes()
    assert raw[:2] == (b"\x1f\x8b" if compress else b"PK")  # gzip / torch's zip container
    got = records.load_record(tmp_path / name)
    assert set(got) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
    assert got["aux_hidden_state"].shape == (1, 10, 24)
    assert got["hidden_state"].shape == (1, 10, 8)
    assert got["input_ids"].shape == got["loss_mask"].shape == (10,)
    want = torch.cat([full[:, 1], full[:, 2], full[:, 0]], -1)  # layers 1, 3, 5
    assert torch.equal(got["aux_hidden_state"][0], want)
    assert torch.equal(got["hidden_state"][0], full[:, 3])
    assert got["loss_mask"].tolist() == [0] * 5 + [1] * 5


def test_specforge_without_final_state_is_refused_naming_the_variable():
    info = server_info(has_final=False)
    for fmt in records.FORMATS:
        with pytest.raises(ValueError, match="SGLANG_HS_DUMP_FINAL=1") as e:
            records.check_format(fmt, info)
        assert ("--allow-no-final" in str(e.value)) == (fmt == "eagle3")
    records.check_format("eagle3", info, allow_no_final=True)  # explicit opt-in
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_FINAL"):
        records.check_format("specforge", info, allow_no_final=True)
    records.check_format("specforge", server_info())


@pytest.mark.parametrize("sample_id", [
    "é" * 40,  # 40 characters, 80 bytes: 363 once percent-encoded
    "x" * 5000, "a/b", "..", ".hidden", "-", "with space", "tab\tnew\nline", "🙂" * 70,
    "p" * 80, "p" * 81, "ok-0123456789abcdef",
])
def test_any_id_gets_a_short_stable_distinct_file_and_dump_dir_name(tmp_path, sample_id):
    names = {records.record_name(sample_id, fmt, c) for fmt in records.FORMATS
             for c in (False, True)}
    for name in names:
        assert name == records.record_name(*_split(name, sample_id))  # stable
        leaf = name.rsplit("/", 1)[-1]
        assert len(leaf.encode()) <= 100 and not leaf.startswith(".")
        assert all(c.isascii() and (c.isalnum() or c in "._-") for c in leaf)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")  # the filesystem takes it
    rid_dir = protocol.rid_dir(tmp_path, "hsdump-" + sample_id)
    assert len(rid_dir.name) <= protocol.MAX_DIRNAME + 1
    rid_dir.mkdir()
    plain = records.record_stem(sample_id) == sample_id
    assert plain == (sample_id == "p" * 80)


def _split(name: str, sample_id: str) -> tuple[str, str, bool]:
    return (sample_id, "specforge" if name.startswith("rows_") else "eagle3",
            name.endswith(".gz"))


def test_record_stems_never_collide():
    ids = ["a/b", "a b", "a_b", "a\u00e9b", "x" * 81, "x" * 82, "ok-0123456789abcdef",
           "ok", "é" * 40, "é" * 41]
    stems = [records.record_stem(i) for i in ids]
    assert len(set(stems)) == len(ids)
    # A plain id that looks like a hashed stem is hashed as well.
    assert records.record_stem(stems[0]) != stems[0]


def test_save_atomic_leaves_nothing_when_writing_fails(tmp_path):
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        records.save_atomic({"bad": lambda: 0}, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []


def test_sidecar_is_written_once_and_guards_the_directory(tmp_path):
    info = server_info()
    meta = records.sidecar("eagle3", info, tokenizer="/m", max_len=None)
    run_id = records.ensure_sidecar(tmp_path, meta)
    saved = json.loads((tmp_path / records.META_FILE).read_text())
    assert saved["run_id"] == run_id and len(run_id) == 12
    assert saved["layers"] == [1, 2, 3] and saved["dtype"] == "bfloat16"
    assert "output_hidden_states[i]" in saved["layer_convention"]
    assert saved["sglang_version"] == "0.5.23" and saved["hsdump_client_version"]
    assert records.ensure_sidecar(tmp_path, meta) == run_id  # same configuration: fine
    other = records.sidecar("specforge", server_info(layers=(2, 3)), tokenizer="/m", max_len=None)
    with pytest.raises(ValueError, match=r"format: 'eagle3' -> 'specforge', layers"):
        records.ensure_sidecar(tmp_path, other)


def test_manifest_resume_ignores_cut_lines_and_missing_records(tmp_path):
    shard = Shard(0, 2)
    (tmp_path / "a.pt").write_bytes(b"x")
    with Manifest(tmp_path, shard) as m:
        m.append({"id": "a", "file": "a.pt"})
        m.append({"id": "gone", "file": "gone.pt"})  # record deleted afterwards
    with open(manifest_path(tmp_path, shard), "a") as f:
        f.write('{"id": "b", "fi')  # killed mid-line
    (tmp_path / "b.pt").write_bytes(b"x")
    assert set(load_done(tmp_path)) == {"a"}
    with Manifest(tmp_path, shard) as m:  # reopening drops the cut line before appending
        m.append({"id": "b", "file": "b.pt"})
    assert set(load_done(tmp_path)) == {"a", "b"}
    lines = manifest_path(tmp_path, shard).read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "gone", "b"]


def test_one_process_per_shard(tmp_path):
    code = ("import sys; from pathlib import Path; from hsdump_patch.client.output.manifest import "
            "Manifest; from hsdump_patch.client.rows.dataset import Shard\n"
            "try:\n Manifest(Path(sys.argv[1]), Shard(0, 1))\nexcept RuntimeError as e:\n"
            " print(e); sys.exit(7)")
    with Manifest(tmp_path, Shard(0, 1)):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                           text=True)
        assert r.returncode == 7 and "already extracting shard 0/1" in r.stdout
        other = subprocess.run([sys.executable, "-c", code.replace("Shard(0, 1)", "Shard(1, 2)"),
                                str(tmp_path)])
        assert other.returncode == 0


@pytest.mark.parametrize("fmt", records.FORMATS)
def test_stale_temps_of_this_shard_are_removed(tmp_path, fmt):
    mine, theirs = records.record_name("mine", fmt), records.record_name("theirs", fmt)
    for name in (mine, theirs):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        protocol.temp_path(tmp_path / name).write_bytes(b"partial")
    (tmp_path / mine).write_bytes(b"complete")
    assert remove_stale_temps(tmp_path, {mine, records.record_name("never", fmt)}) == 1
    temps = sorted(p.name for p in tmp_path.rglob(".*.tmp-*"))
    assert len(temps) == 1 and temps[0].startswith(".theirs.")
    assert (tmp_path / mine).read_bytes() == b"complete"


@pytest.mark.parametrize("fmt", records.FORMATS)
def test_smoke_flags_records_without_what_the_format_needs(fmt):
    from hsdump_patch.client.rows.dataset import Sample
    from hsdump_patch.client.smoke import check_record

    info = server_info()
    rec, _ = build(fmt, info)
    sample = Sample("s", "x", list(range(10)), [0] * 5 + [1] * 5)
    assert check_record(rec, fmt, info, sample) == []
    del rec[records.NEEDS_FINAL[fmt]]
    (problem,) = check_record(rec, fmt, info, sample)
    assert f"no {records.NEEDS_FINAL[fmt]}" in problem and "SGLANG_HS_DUMP_FINAL=1" in problem


def test_reader_needs_only_torch_and_lists_every_finished_record(tmp_path):
    from hsdump_patch.reader import iter_records

    info = server_info()
    with Manifest(tmp_path, Shard(0, 1)) as m:
        for sample_id, fmt, compress in (("a", "eagle3", False), ("é/b", "eagle3", True)):
            rec, _ = build(fmt, info)
            name = records.record_name(sample_id, fmt, compress)
            records.save_atomic(rec, tmp_path / name, compress)
            m.append({"id": sample_id, "file": name})
    got = dict(iter_records(tmp_path))
    assert set(got) == {"a", "é/b"} and len(got["é/b"]["hidden_states"]) == 3
    # No client extras: the reader imports with transformers, requests and safetensors absent.
    code = ("import sys\nfor m in ('transformers', 'requests', 'safetensors', 'tqdm'):\n"
            " sys.modules[m] = None\nfrom hsdump_patch.reader import iter_records\n"
            "print(sorted(i for i, _ in iter_records(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.strip() == "['a', 'é/b']", r.stderr
