"""``--format specforge`` output loaded through SpecForge's own offline loading path.

The records of real CPU SGLang servers (tiny Llama; tiny DeepSeek-V3 with drafter-config layers,
gzipped) are listed, read, processed per sample and collated by SpecForge's own code: its PyPI
release (``specforge==0.2.0``, installed by ``make test`` without its dependencies, which pin
another SGLang and torch). The collated batch is compared with an independent HF transformers
forward of the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.client.output import records
from hsdump_patch.reader import iter_records, manifest_entries
from tests.harness.extraction import REL_TOL, extract, pre_tokenized, read_report, rel_err
from tests.harness.needs import specforge_on_path
from tests.harness.reference import hf_hidden_states
from tests.harness.rows import write_jsonl
from tests.harness.server import REPO

pytestmark = pytest.mark.server
MAX_LEN = 2048  # SpecForge's default data.max_length


@pytest.fixture(scope="module")
def sf() -> SimpleNamespace:
    """SpecForge's offline loading path: the trainer's listing, its file loader, the EAGLE-3
    per-sample processing and collator, and the older ``OfflineEagle3Dataset`` path."""
    specforge_on_path()
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    return SimpleNamespace(
        list_feature_files=list_feature_files, list_local_files=list_local_files,
        load_feature_file=load_feature_file, normalize_offline_sample=normalize_offline_sample,
        process_data=OfflineEagle3Dataset.process_data,
        DataCollatorWithPadding=DataCollatorWithPadding)


@pytest.mark.parametrize(("server_name", "compress"), [("llama_server", False),
                                                       ("deepseek_server", True)])
def test_specforge_loads_our_records_and_its_batch_equals_hf(tmp_path, request, sf, server_name,
                                                            compress):
    server = request.getfixturevalue(server_name)
    rows = pre_tokenized(4, seed=11, lo=20, hi=90, prefix="sf")  # several prefill chunks each
    rows[1]["id"] = "ü" * 40  # 363 bytes percent-encoded: a short hashed name instead
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    flags = ["--format", "specforge", *(["--compress"] if compress else [])]
    assert extract(server, dataset, out, *flags) == 0
    assert read_report(out)["ok"] == len(rows)

    # SpecForge's listing finds exactly our records (recursively, by suffix) in both its paths.
    suffix = ".ckpt.gz" if compress else ".ckpt"
    files = sf.list_feature_files(str(out))
    assert sf.list_local_files(str(out)) == sorted(str(out / e) for e in files) == files
    by_id = {e["id"]: str(out / e["file"]) for e in manifest_entries(out)}
    assert sorted(by_id.values()) == files and all(f.endswith(suffix) for f in files)
    assert all(len(p.name) < 100 for p in out.rglob("*" + suffix))

    info = protocol.read_server_info(server.dump_dir)
    h = info.hidden_size
    order = sorted(info.layers)  # SGLang serving concatenates ascending
    samples, want = [], []
    for row in rows:
        raw = sf.load_feature_file(by_id[row["id"]])  # weights_only=False, as SpecForge does
        assert raw["aux_hidden_state"].shape == (1, len(row["input_ids"]), len(order) * h)
        assert raw["hidden_state"].shape == (1, len(row["input_ids"]), h)
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.long
        samples.append(sf.normalize_offline_sample(raw, max_len=MAX_LEN))
        legacy = sf.process_data(sf.load_feature_file(by_id[row["id"]]), MAX_LEN)
        for key in ("input_ids", "loss_mask", "hidden_state", "target"):
            assert torch.equal(legacy[key], samples[-1][key])
        want.append(hf_hidden_states(server.model, row["input_ids"], torch.bfloat16))

    batch = sf.DataCollatorWithPadding()(samples)
    longest = max(len(r["input_ids"]) for r in rows)
    assert batch["hidden_state"].shape == (len(rows), longest, len(order) * h)
    assert batch["target"].shape == (len(rows), longest, h)
    worst = 0.0
    for b, (row, ref) in enumerate(zip(rows, want, strict=True)):
        n = len(row["input_ids"])
        assert batch["input_ids"][b, :n].tolist() == row["input_ids"]
        assert batch["loss_mask"][b, :n].tolist() == [*row["loss_mask"][:-1], 0]
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (longest - n)
        assert not batch["hidden_state"][b, n:].any() and not batch["target"][b, n:].any()
        layers = batch["hidden_state"][b, :n].split(h, dim=-1)
        for got, layer in zip(layers, order, strict=True):
            worst = max(worst, rel_err(got, ref[layer]))
        worst = max(worst, rel_err(batch["target"][b, :n], ref[-1]))
    print(f"worst relative error vs HF through SpecForge's loader: {worst:.2e}")
    assert worst < REL_TOL

    # Our own reader (weights_only=True) sees the same tensors.
    ours = dict(iter_records(out))
    assert set(ours) == {r["id"] for r in rows}
    for row in rows:
        raw = sf.load_feature_file(by_id[row["id"]])
        assert all(torch.equal(ours[row["id"]][k], raw[k]) for k in raw)


def test_server_info_without_the_final_state_is_refused_at_start(tmp_path, llama_server):
    """The client's reaction to a ``server.json`` saying ``has_final: false`` (what a server
    started with SGLANG_HS_DUMP_FINAL=0 writes). No such server runs here: the dump dir given to
    the client holds a copy of the live llama server's ``server.json`` (final state on) edited to
    ``has_final: false``. Both formats refuse before sending anything, naming the variable, and
    so does smoke."""
    dump = tmp_path / "dump"
    dump.mkdir()
    info = json.loads((llama_server.dump_dir / protocol.SERVER_INFO).read_text())
    (dump / protocol.SERVER_INFO).write_text(json.dumps({**info, "has_final": False}))
    dataset = write_jsonl(tmp_path / "d.jsonl", pre_tokenized(2, seed=12, prefix="nf"))
    base = [sys.executable, "-m", "hsdump_patch.cli"]
    where = ["--server", llama_server.url, "--dump-dir", str(dump), "--no-progress"]
    for fmt in records.FORMATS:
        r = subprocess.run([*base, "extract", *where, "--dataset", str(dataset), "--out",
                            str(tmp_path / fmt), "--format", fmt], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "SGLANG_HS_DUMP_FINAL=1" in r.stderr and "has_final false" in r.stderr
        assert ("--allow-no-final" in r.stderr) == (fmt == "eagle3")
        assert not (tmp_path / fmt / "manifest.shard-0-of-1.jsonl").exists()
    r = subprocess.run([*base, "smoke", *where, "--format", "specforge", "--report",
                        str(tmp_path / "smoke.json")], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "SGLANG_HS_DUMP_FINAL=1" in r.stdout, r.stdout + r.stderr


def test_smoke_checks_specforge_records(tmp_path, llama_server):
    r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "smoke", "--server",
                        llama_server.url, "--dump-dir", str(llama_server.dump_dir), "--format",
                        "specforge", "--report", str(tmp_path / "smoke.json"), "--no-progress"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "specforge records: hidden_state present" in r.stdout
