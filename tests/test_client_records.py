"""Client output without a server: record formats, atomic writes, sidecar, manifest/resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.client import records
from hsdump_patch.client.dataset import Shard
from hsdump_patch.client.manifest import Manifest, load_done, manifest_path, remove_stale_temps


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
    assert path.name == "a%2Fb%20c.pt" and size == path.stat().st_size
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


def test_specforge_record_concatenates_layers_in_order(tmp_path):
    info = server_info()
    rec, full = build("specforge", info)
    records.save_atomic(rec, tmp_path / "x.pt")
    got = records.load_record(tmp_path / "x.pt")
    assert set(got) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
    assert got["aux_hidden_state"].shape == (10, 24)
    assert torch.equal(got["aux_hidden_state"], torch.cat([full[:, s] for s in range(3)], -1))
    assert torch.equal(got["hidden_state"], full[:, 3])
    assert got["loss_mask"].tolist() == [0] * 5 + [1] * 5


def test_save_atomic_leaves_nothing_when_writing_fails(tmp_path):
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        records.save_atomic({"bad": lambda: 0}, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []


def test_sidecar_is_written_once_and_guards_the_directory(tmp_path):
    info = server_info()
    meta = records.sidecar("eagle3", info, tokenizer="/m", max_len=None)
    records.ensure_sidecar(tmp_path, meta)
    saved = json.loads((tmp_path / records.META_FILE).read_text())
    assert saved["layers"] == [1, 2, 3] and saved["dtype"] == "bfloat16"
    assert "output_hidden_states[i]" in saved["layer_convention"]
    assert saved["sglang_version"] == "0.5.23" and saved["hsdump_client_version"]
    records.ensure_sidecar(tmp_path, meta)  # same configuration: fine
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
    code = ("import sys; from pathlib import Path; from hsdump_patch.client.manifest import "
            "Manifest; from hsdump_patch.client.dataset import Shard\n"
            "try:\n Manifest(Path(sys.argv[1]), Shard(0, 1))\nexcept RuntimeError as e:\n"
            " print(e); sys.exit(7)")
    with Manifest(tmp_path, Shard(0, 1)):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                           text=True)
        assert r.returncode == 7 and "already extracting shard 0/1" in r.stdout
        other = subprocess.run([sys.executable, "-c", code.replace("Shard(0, 1)", "Shard(1, 2)"),
                                str(tmp_path)])
        assert other.returncode == 0


def test_stale_temps_of_this_shard_are_removed(tmp_path):
    mine, theirs = records.record_name("mine"), records.record_name("theirs")
    for name in (mine, theirs):
        protocol.temp_path(tmp_path / name).write_bytes(b"partial")
    (tmp_path / mine).write_bytes(b"complete")
    assert remove_stale_temps(tmp_path, {mine}) == 1
    left = sorted(os.listdir(tmp_path))
    assert left[0].startswith(f".{theirs}.tmp-") and left[1:] == [mine]
