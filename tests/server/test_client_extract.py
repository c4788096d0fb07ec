"""``hsdump extract`` and ``hsdump smoke`` against real CPU SGLang servers with the patch.

The records are compared with an independent HF transformers forward of the same tokens; the
robustness tests kill the client, shard the dataset, feed it bad rows and point it at servers
that are down or that reuse cached tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.cli import main as cli
from hsdump_patch.client.dumps.dumpdir import wait_for_marker
from hsdump_patch.client.output import records
from tests.harness import server as srv
from tests.harness.dump_server import plugin_log_lines
from tests.harness.extraction import (
    REL_TOL,
    extract,
    make_smoke,
    pre_tokenized,
    read_report,
    rel_err,
)
from tests.harness.rows import CONV, openai_row, reference, sharegpt_row, write_jsonl

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]
LONG = " ".join(["Hidden states from decoder layers are dumped to shared memory."] * 12)


def rid_dirs(server, ids) -> list[str]:
    """The request directories of these sample ids in the dump dir, of any extraction (rids
    ``hsdump-<run id>-<len(id)>-<id>``)."""
    ends = tuple(f"-{len(i)}-{i}" for i in ids)
    return sorted(n for n in os.listdir(server.dump_dir)
                  if n.startswith("hsdump-") and urllib.parse.unquote(n).endswith(ends))


def record_files(out: Path, fmt: str = "eagle3") -> list[str]:
    pattern = "*.pt" if fmt == "eagle3" else "rows_*/*.ckpt"
    return sorted(p.relative_to(out).as_posix() for p in out.glob(pattern))


def hf_reference(model, ids: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """HF ``output_hidden_states`` (index i = input of layer i) and the post-norm final state."""
    with torch.no_grad():
        out = model.model(torch.tensor([ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states), out.last_hidden_state[0]


@pytest.fixture(params=["llama_server", "deepseek_server"])
def dump_server(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hf_models():
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(path: Path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        return cache[path]

    return get


def test_records_equal_hf_reference_in_both_formats_at_16_way_concurrency(
        tmp_path, dump_server, hf_models):
    """Both chat shapes (multi-turn), a prompt spanning many prefill chunks and pre-tokenized
    rows, 16 requests in flight; every hidden state equals HF's at the announced layers."""
    from transformers import AutoTokenizer

    rows = [openai_row(CONV, id="openai"), sharegpt_row(CONV, id="sharegpt"),
            openai_row([("user", LONG), ("assistant", LONG)], id="long"),
            *pre_tokenized(29, seed=1)]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    info = protocol.read_server_info(dump_server.dump_dir)
    tok = AutoTokenizer.from_pretrained(dump_server.model)
    model = hf_models(dump_server.model)
    refs: dict[str, tuple] = {}  # HF states per row, shared by both formats
    worst = 0.0
    for fmt in records.FORMATS:
        out = tmp_path / fmt
        assert extract(dump_server, dataset, out, "--format", fmt, "--concurrency", "16") == 0
        rep = read_report(out)
        assert (rep["ok"], rep["failed"], rep["skipped"]) == (len(rows), 0, 0)
        assert rep["max_chunks"] >= 8  # "long" went through chunked prefill
        assert record_files(out, fmt) == sorted(records.record_name(r["id"], fmt) for r in rows)
        assert rid_dirs(dump_server, [r["id"] for r in rows]) == []
        meta = json.loads((out / records.META_FILE).read_text())
        assert (meta["format"], meta["layers"], meta["has_final"]) == (fmt, list(info.layers), True)
        for row in rows:
            rec = torch.load(out / records.record_name(row["id"], fmt), weights_only=True)
            if "input_ids" in row:
                ids, mask = row["input_ids"], row["loss_mask"]
            else:
                turns = [(m["role"], m["content"]) for m in row["messages"]] if "messages" in row \
                    else [({"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                           t["value"]) for t in row["conversations"]]
                ids, mask = reference(tok, turns)
            assert rec["input_ids"].tolist() == ids
            assert rec["loss_mask"].tolist() == mask
            if row["id"] not in refs:
                refs[row["id"]] = hf_reference(model, ids)
            states, final = refs[row["id"]]
            if fmt == "eagle3":
                layers = rec["hidden_states"]
                got_final = rec["final_hidden_state"]
            else:  # SpecForge's batch dimension; layers concatenated in ascending order
                k_h = len(info.layers) * info.hidden_size
                assert rec["aux_hidden_state"].shape == (1, len(ids), k_h)
                layers = rec["aux_hidden_state"][0].split(info.hidden_size, dim=-1)
                got_final = rec["hidden_state"][0]
            assert len(layers) == len(info.layers)
            order = info.layers if fmt == "eagle3" else sorted(info.layers)
            for got, layer in zip(layers, order, strict=True):
                assert got.dtype == torch.bfloat16 and got.shape == (len(ids), info.hidden_size)
                worst = max(worst, rel_err(got, states[layer]))
            worst = max(worst, rel_err(got_final, final))
    print(f"worst relative error vs HF: {worst:.2e}")
    assert worst < REL_TOL


def test_kill_9_mid_run_then_rerun_writes_every_sample_exactly_once(tmp_path, llama_server):
    rows = pre_tokenized(40, seed=2, lo=100, hi=250, prefix="k")
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hsdump_patch.cli", "extract", "--server", llama_server.url,
           "--dump-dir", str(llama_server.dump_dir), "--dataset", str(dataset), "--out", str(out),
           "--no-progress", "--concurrency", "8"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest = out / "manifest.shard-0-of-1.jsonl"
    deadline = time.monotonic() + 240
    while not (manifest.exists() and manifest.read_text().count("\n") >= 3):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = manifest.read_text().count("\n")
    assert 3 <= first < len(rows), "the kill must land mid-run"

    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = read_report(out)
    assert rep["already_done"] + rep["ok"] == len(rows) and rep["already_done"] >= first
    ids = [r["id"] for r in rows]
    assert record_files(out) == sorted(f"{i}.pt" for i in ids)
    assert [p for p in os.listdir(out) if ".tmp-" in p] == []
    entries = [json.loads(x) for x in manifest.read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == sorted(ids)  # each exactly once
    for row in rows:
        rec = torch.load(out / f"{row['id']}.pt", weights_only=True)
        assert rec["input_ids"].tolist() == row["input_ids"]
    assert rid_dirs(llama_server, ids) == []


def test_two_shards_cover_the_dataset_exactly_once_and_resume_skips(tmp_path, llama_server):
    rows = pre_tokenized(12, seed=3, prefix="sh")
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    assert extract(llama_server, dataset, out, "--shard", "0/2") == 0
    assert extract(llama_server, dataset, out, "--shard", "1/2") == 0
    reps = [read_report(out, f"shard-{i}-of-2") for i in range(2)]
    assert reps[0]["ok"] + reps[1]["ok"] == len(rows) and min(r["ok"] for r in reps) > 0
    assert record_files(out) == sorted(f"{r['id']}.pt" for r in rows)
    manifests = [{json.loads(x)["id"] for x in (out / f"manifest.shard-{i}-of-2.jsonl")
                  .read_text().splitlines()} for i in range(2)]
    assert not manifests[0] & manifests[1]
    assert manifests[0] | manifests[1] == {r["id"] for r in rows}
    assert extract(llama_server, dataset, out) == 0  # unsharded rerun: nothing left to do
    assert (read_report(out)["ok"], read_report(out)["already_done"]) == (0, len(rows))


def test_bad_rows_are_skipped_or_stop_the_run_as_on_error_says(tmp_path, llama_server, capsys):
    rows = [*pre_tokenized(3, seed=4, prefix="ok"), "{broken",
            openai_row([("user", "no answer here")], id="nomask")]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "skip"
    assert extract(llama_server, dataset, out, "--on-error", "skip") == 3
    rep = read_report(out)
    assert (rep["ok"], rep["skipped"], rep["failed"], rep["stopped"]) == (3, 2, 0, None)
    where = {i["where"]: i["reason"] for i in rep["issues"]}
    assert "not valid JSON" in where[f"{dataset}:4"]
    assert "no assistant turn" in where[f"{dataset}:5"]
    assert f"skipped: {dataset}:4: not valid JSON" in capsys.readouterr().out

    out = tmp_path / "fail"
    assert extract(llama_server, dataset, out, "--on-error", "fail", "--concurrency", "1") == 1
    rep = read_report(out)
    assert rep["stopped"].startswith(f"{dataset}:4: not valid JSON")
    assert rep["ok"] == 0  # the bad line is found before any request is sent
    assert "STOPPED" in capsys.readouterr().out


def test_a_server_that_is_down_ends_the_run_with_a_clear_message(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", pre_tokenized(2, seed=5))
    url = f"http://127.0.0.1:{srv.free_port()}"  # nothing listens there
    t0 = time.monotonic()
    rc = cli(["extract", "--server", url, "--dump-dir", str(tmp_path), "--dataset", str(dataset),
              "--out", str(tmp_path / "out"), "--retries", "2", "--retry-wait", "0.05"])
    assert rc == 1 and time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert f"the server at {url} is unreachable: 3 attempts" in err
    assert "check that it is running" in err


def test_smoke_passes_against_a_running_server(tmp_path, llama_server):
    report = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "smoke", "--server",
                        llama_server.url, "--dump-dir", str(llama_server.dump_dir),
                        "--report", str(report), "--no-progress"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = ["server.json", "extraction", "records", "determinism", "dump dir clean",
           "regeneration"]
    assert r.stdout.strip().splitlines()[-1] == (
        f"hsdump smoke: PASS (checks run: {', '.join(ran)}; report: {report})")
    verdict = json.loads(report.read_text())
    checks = {c["check"]: c for c in verdict["checks"]}
    assert verdict["passed"] and list(checks) == verdict["ran"] == ran
    assert verdict["skipped"] == []
    assert checks["determinism"]["detail"].endswith("one prompt: bitwise identical")
    assert verdict["report"]["max_chunks"] > 1
    # The tiny random model never ends a turn: each row's first turn is cut at 8 tokens, and a
    # row stops at its first cut turn (issue 16), so one turn per row.
    assert checks["regeneration"]["detail"].startswith("2 rows, 2 turns")


def test_smoke_on_a_dataset_runs_the_determinism_check_it_names_or_fails(tmp_path, llama_server):
    """``--dataset`` without the default determinism pair: the requested check cannot run, so
    the smoke fails saying so; the pair named with ``--determinism`` is compared and passes;
    ``--determinism none`` skips it, and the verdict says so."""
    rows = pre_tokenized(2, seed=21, lo=20, hi=60, prefix="smk")
    dataset = write_jsonl(tmp_path / "d.jsonl", [*rows, {**rows[0], "id": "smk0-again"}])

    def smoke(*flags: str) -> tuple[subprocess.CompletedProcess, dict]:
        report = tmp_path / f"smoke{len(flags)}.json"
        r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "smoke", "--server",
                            llama_server.url, "--dump-dir", str(llama_server.dump_dir),
                            "--dataset", str(dataset), "--report", str(report),
                            "--no-progress", *flags],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
        return r, json.loads(report.read_text())

    r, verdict = smoke()
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("hsdump smoke: FAIL (determinism) (checks run: server.json, "
                           "extraction, records, determinism, dump dir clean, regeneration;")
    assert (f"  FAIL determinism: requested but cannot run: no sample 'determinism-a' in "
            f"--dataset {dataset}") in r.stdout
    assert "--determinism ID_A,ID_B, or skip the check with --determinism none" in r.stdout
    assert [c["check"] for c in verdict["checks"] if not c["passed"]] == ["determinism"]

    r, verdict = smoke("--determinism", "smk0,smk0-again")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "  ok   determinism: 'smk0' and 'smk0-again', one prompt: bitwise identical" in r.stdout
    assert verdict["passed"] and "determinism" in verdict["ran"] and verdict["skipped"] == []

    r, verdict = smoke("--determinism", "none")  # skipped on request: said, and not a failure
    assert r.returncode == 0, r.stdout + r.stderr
    assert "  skip determinism: not requested (--determinism none)" in r.stdout
    assert "; skipped: determinism; report: " in r.stdout.strip().splitlines()[-1]
    assert "determinism" not in verdict["ran"] and verdict["skipped"] == [
        {"check": "determinism", "why": "not requested (--determinism none)"}]


def test_smoke_fails_when_the_dump_dir_is_not_the_servers(tmp_path, llama_server):
    stale = tmp_path / "dump"
    stale.mkdir()
    (stale / protocol.SERVER_INFO).write_bytes((llama_server.dump_dir / protocol.SERVER_INFO)
                                               .read_bytes())
    before = {d.name for d in llama_server.dump_dir.iterdir()}
    r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "smoke", "--server",
                        llama_server.url, "--dump-dir", str(stale), "--dump-timeout", "3",
                        "--report", str(tmp_path / "r.json"), "--no-progress"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    # The requests were dumped into the real dump dir, where nobody consumes them.
    smoke_dirs = [d for d in llama_server.dump_dir.iterdir()
                  if d.is_dir() and d.name not in before]
    assert smoke_dirs, "the smoke's requests reached no dump dir"
    for d in smoke_dirs:
        assert wait_for_marker(llama_server.dump_dir, urllib.parse.unquote(d.name), 30)
        shutil.rmtree(d)
    assert r.returncode == 1
    assert "hsdump smoke: FAIL (extraction, records" in r.stdout
    assert "no done/error marker" in r.stdout


def test_make_smoke_against_a_running_server(tmp_path, llama_server):
    r = make_smoke(tmp_path, f"SERVER={llama_server.url}", f"DUMP_DIR={llama_server.dump_dir}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hsdump smoke: PASS" in r.stdout
    assert json.loads((tmp_path / "report.json").read_text())["passed"]


CUSTOM_TOKENIZER = '''
from transformers import PreTrainedTokenizerFast


class CustomCodeTokenizer(PreTrainedTokenizerFast):
    """Like Kimi's TikTokenTokenizer: a class shipped as code in the model dir."""

    custom_code_marker = True
'''


def custom_code_tokenizer(model: Path, dest: Path) -> Path:
    """A copy of ``model``'s tokenizer that only loads through its own code (auto_map)."""
    shutil.copytree(model, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    (dest / "tokenization_custom.py").write_text(CUSTOM_TOKENIZER)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="CustomCodeTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomCodeTokenizer"]})
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def test_custom_code_tokenizer_needs_trust_and_the_error_names_the_flag(tmp_path, llama_server):
    from hsdump_patch.client.server.api import ServerClient
    from hsdump_patch.client.server.tokenizer import load_tokenizer

    tok_dir = custom_code_tokenizer(llama_server.model, tmp_path / "tok")
    rows = pre_tokenized(2, seed=21, prefix="tr")
    rows.append(openai_row(CONV[:3], id="chat"))  # rendered with the custom-code tokenizer
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "extract", "--server",
                        llama_server.url, "--dump-dir", str(llama_server.dump_dir), "--dataset",
                        str(dataset), "--out", str(tmp_path / "off"), "--model", str(tok_dir),
                        "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "needs its own code" in r.stderr and "add --trust-remote-code" in r.stderr, r.stderr
    # The server's own setting is read from /server_info (this one does not trust custom code).
    args = ServerClient(llama_server.url, request_timeout=30, retries=0,
                        retry_wait=0).server_args()
    assert args["trust_remote_code"] is False

    out = tmp_path / "on"
    assert extract(llama_server, dataset, out, "--model", str(tok_dir),
                   "--trust-remote-code") == 0
    assert read_report(out)["ok"] == len(rows)
    assert json.loads((out / records.META_FILE).read_text())["trust_remote_code"] is True
    tok = load_tokenizer(str(tok_dir), True)
    assert type(tok).__name__ == "CustomCodeTokenizer" and tok.custom_code_marker
    plain = load_tokenizer(str(llama_server.model), False)
    rec = records.load_record(out / records.record_name("chat"))
    assert rec["input_ids"].tolist() == reference(plain, CONV[:3])[0]  # same tokens either way


def test_one_samples_local_error_never_stops_a_skip_run(tmp_path, llama_server):
    """A record that cannot be written (its name is taken by a directory), a sample the server
    rejects (longer than its context) and a bad row are listed; every other sample is written."""
    rows = pre_tokenized(6, seed=22, prefix="le")
    rows[1]["id"] = "blocked"
    rows[3] = {"id": "too-long", "input_ids": [11] * 5000, "loss_mask": [1] * 5000}
    dataset = write_jsonl(tmp_path / "d.jsonl", [*rows[:4], "{not json", *rows[4:]])
    out = tmp_path / "out"
    (out / records.record_name("blocked") / "x").mkdir(parents=True)
    assert extract(llama_server, dataset, out, "--on-error", "skip", "--concurrency", "4") == 3
    rep = read_report(out)
    assert (rep["ok"], rep["failed"], rep["skipped"], rep["stopped"]) == (4, 2, 1, None)
    reasons = {i["id"]: i["reason"] for i in rep["issues"]}
    assert "could not write its record" in reasons["blocked"]
    assert "the server answered HTTP" in reasons["too-long"]
    ok = {r["id"] for r in rows} - {"blocked", "too-long"}
    assert {e["id"] for e in map(json.loads, (out / "manifest.shard-0-of-1.jsonl")
                                  .read_text().splitlines())} == ok
    assert rid_dirs(llama_server, [r["id"] for r in rows]) == []
    assert [p for p in out.rglob("*") if ".tmp-" in p.name] == []


def test_without_a_dump_dir_the_plugin_installs_nothing(plain_server):
    """Without SGLANG_HS_DUMP_DIR the plugin registers no hook, so even a configuration the
    patch would refuse (the radix cache on) serves normally, a dump-like rid included, and
    the plugin neither logs (its own "hsdump: " messages, not the bare word a checkout's path
    holds) nor writes a dump dir (server.json, request dirs)."""
    out = plain_server.server.generate([1, 5, 6, 7], rid="hsdump-x", max_new_tokens=2)
    assert out["output_ids"]
    assert plugin_log_lines(plain_server.server.log()) == []
    assert not plain_server.dump_dir.exists()


def test_cached_tokens_fail_the_sample(tmp_path, llama_server, plain_server):
    """The real misconfiguration behind ``cached_tokens != 0``: ``--dump-dir`` holds the
    server.json of a patched server, while ``--server`` is a plain server of the same model
    with the radix cache on, whose cache other traffic (a decoding request) has filled."""
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / protocol.SERVER_INFO).write_bytes(
        (llama_server.dump_dir / protocol.SERVER_INFO).read_bytes())
    plain = SimpleNamespace(url=plain_server.url, dump_dir=dump)
    row = pre_tokenized(1, seed=6, lo=120, hi=120, prefix="c")[0]
    # Prefill-only requests are not inserted into the radix cache; a decoding one is.
    plain_server.server.generate(row["input_ids"], max_new_tokens=2)
    dataset = write_jsonl(tmp_path / "d.jsonl", [row, {**row, "id": "again"}])
    out = tmp_path / "out"
    assert extract(plain, dataset, out, "--on-error", "skip", "--concurrency", "1",
                   "--dump-timeout", "2") == 3
    reasons = {i["id"]: i["reason"] for i in read_report(out)["issues"]}
    for sample_id in ("c0", "again"):
        assert "cached_tokens=" in reasons[sample_id]
        assert "--disable-radix-cache" in reasons[sample_id]

    assert extract(plain, dataset, tmp_path / "out2", "--on-error", "fail",
                   "--dump-timeout", "2") == 1
    assert "cached_tokens=" in read_report(tmp_path / "out2")["stopped"]
