"""A tiny Kimi-K2.5 end to end: real-shaped agent / thinking rows -> serving-faithful samples.

The expectations are written independently of the chat template and of the renderer: each
sample is spelled out as Kimi-K2.5's wire format (tests/harness/kimi_wire.py); the same battery
is rendered without a server in tests/unit/test_kimi_render.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.cli import main as cli
from hsdump_patch.client.output import records
from hsdump_patch.reader import iter_records
from tests.harness.kimi_wire import BATTERY, expected


@pytest.mark.server
def test_tiny_kimi_k25_end_to_end_in_both_formats(tmp_path, kimi_server, tiny_kimi,
                                                  kimi_tokenizer):
    """The battery through ``hsdump extract`` against the served Kimi-K2.5 (float32): every
    record's tokens and mask equal the expectation, every layer and the final state equal
    HF transformers' float32 DeepSeek-V3 forward of the same language-model weights, rounded
    to the records' bfloat16."""
    from transformers import AutoModelForCausalLM

    dataset = tmp_path / "battery.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row, _ in BATTERY))
    want = {row["id"] + suffix: expected(kimi_tokenizer, segments)
            for row, samples in BATTERY for suffix, segments in samples}
    info = protocol.read_server_info(kimi_server.dump_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_kimi[1], dtype=torch.float32).eval()
    refs = {}
    worst = 0.0
    for fmt in records.FORMATS:
        out = tmp_path / fmt
        assert cli(["extract", "--server", kimi_server.url, "--dump-dir",
                    str(kimi_server.dump_dir), "--dataset", str(dataset), "--out", str(out),
                    "--format", fmt, "--no-progress"]) == 0
        got = dict(iter_records(out))
        assert sorted(got) == sorted(want)
        # Issue 16.9: the report says which rows auto split into per-turn samples, and why.
        report = json.loads((out / "report.shard-0-of-1.json").read_text())
        assert report["per_turn_fallbacks"] == 1 and report["fallback_rows"] == ["agent-trace"]
        assert report["trained_tokens"] == sum(sum(m) for _, m in want.values())
        assert report["longest"]["tokens"] == max(len(i) for i, _ in want.values())
        for sid, rec in got.items():
            ids, mask = want[sid]
            if fmt == "eagle3":
                layers, final = rec["hidden_states"], rec["final_hidden_state"]
                assert rec["input_ids"].tolist() == ids and rec["loss_mask"].tolist() == mask
            else:  # SpecForge: batch dimension, layers concatenated in ascending order
                layers = rec["aux_hidden_state"][0].split(info.hidden_size, dim=-1)
                final = rec["hidden_state"][0]
                assert rec["input_ids"].flatten().tolist() == ids
                assert rec["loss_mask"].flatten().tolist() == mask
            if sid not in refs:
                with torch.no_grad():
                    o = hf.model(torch.tensor([ids]), output_hidden_states=True)
                refs[sid] = ([h[0] for h in o.hidden_states], o.last_hidden_state[0])
            states, hf_final = refs[sid]
            order = info.layers if fmt == "eagle3" else sorted(info.layers)
            pairs = [*zip(layers, (states[x] for x in order), strict=True), (final, hf_final)]
            for got_state, ref in pairs:
                # Records hold bfloat16: each value must be the fp32 reference rounded to it.
                err = (got_state.float() - ref).abs() / (ref.abs() * 2 ** -8 + 1e-6)
                worst = max(worst, err.max().item())
    print(f"worst |record - HF fp32| in bf16 half-ulps = {worst:.3f}")
    assert worst <= 1.0

    # Resume after a crash between the samples of one row: the missing one is extracted.
    out = tmp_path / "eagle3"
    manifest = out / "manifest.shard-0-of-1.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    (lost,) = [json.loads(x) for x in lines if json.loads(x)["id"] == "agent-trace#5"]
    manifest.write_text("".join(x for x in lines if json.loads(x)["id"] != "agent-trace#5"))
    (out / lost["file"]).unlink()
    assert cli(["extract", "--server", kimi_server.url, "--dump-dir", str(kimi_server.dump_dir),
                "--dataset", str(dataset), "--out", str(out), "--no-progress"]) == 0
    again = dict(iter_records(out))
    assert sorted(again) == sorted(want)
    assert again["agent-trace#5"]["input_ids"].tolist() == want["agent-trace#5"][0]
