"""Dumps do not depend on how the prompt was split (chunked prefill) or parallelised (tensor
parallel 2), and equal HF's in float32. That the patch changes nothing the server returns (dump
on vs off, TP 1 and 2) is ``hsdump verify``'s check (c), asserted in tests/server/test_verify.py.

Servers here are started one at a time by a fixture that collects what the tests compare and
stops each server before the next starts (tp 2 on CPU takes ~8 GB).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness.dump_server import CHUNK, DumpServer, prompt, start_dump_server
from tests.harness.dumps import Dump, read_dump
from tests.harness.reference import hf_hidden_states

pytestmark = pytest.mark.server

F32 = ["--dtype", "float32"]
DUMP_PROMPTS = {f"hsdump-num-{n}": prompt(200 + n, n) for n in (20, 70, 3 * CHUNK + 1)}
GEN_PROMPTS = {f"hsdump-gen-{n}": prompt(300 + n, n) for n in (12, 45)}
# float32: SGLang's CPU kernels vs HF's eager ones, and tp2 partial sums vs tp1.
F32_ATOL, F32_RTOL = 1e-4, 1e-4


def generate_all(s: DumpServer) -> dict[str, dict]:
    """Greedy 8 tokens with logprobs for GEN_PROMPTS (prefixed rids: their prefills are dumped)."""
    out = {}
    for rid, ids in GEN_PROMPTS.items():
        r = s.server.generate(ids, rid=rid, max_new_tokens=8, return_logprob=True,
                              top_logprobs_num=5, logprob_start_len=0)
        out[rid] = {"output_ids": r["output_ids"],
                    "output_token_logprobs": r["meta_info"]["output_token_logprobs"],
                    "output_top_logprobs": r["meta_info"]["output_top_logprobs"],
                    "input_token_logprobs": r["meta_info"]["input_token_logprobs"]}
    return out


def dump_all(s: DumpServer) -> dict[str, Dump]:
    for rid, ids in DUMP_PROMPTS.items():
        s.server.generate(ids, rid=rid)
    return {rid: read_dump(s.dump_dir, rid) for rid in DUMP_PROMPTS}


def run_server(tmp: Path, model: Path, name: str, collect, **kwargs):
    s = start_dump_server(tmp, model, name, **kwargs)
    try:
        return collect(s)
    finally:
        s.server.stop()


def test_generated_requests_dump_their_prefill(llama_server):
    generate_all(llama_server)
    for rid in GEN_PROMPTS:  # the dump-on server dumped these prefills
        assert read_dump(llama_server.dump_dir, rid).input_ids == GEN_PROMPTS[rid]


@pytest.fixture(scope="module")
def float32_runs(tiny_models, tmp_path_factory):
    """float32 Llama, dump on: tp1 unchunked, tp2 chunked."""
    tmp = tmp_path_factory.mktemp("f32")
    model = tiny_models / "tiny-llama"
    chunked = ["--chunked-prefill-size", str(CHUNK), *F32]
    tp1 = run_server(tmp, model, "tp1", dump_all, args=["--chunked-prefill-size", "4096", *F32])

    def tp2_collect(s: DumpServer):
        return dump_all(s), s.server.log(), s.dump_dir

    tp2_dumps, tp2_log, tp2_dir = run_server(tmp, model, "tp2", tp2_collect, tp=2, args=chunked)
    return {"model": model, "tp1": tp1, "tp2": tp2_dumps, "tp2_log": tp2_log, "tp2_dir": tp2_dir}


def test_float32_dump_equals_hf_tightly(float32_runs):
    for rid, d in float32_runs["tp1"].items():
        ref = hf_hidden_states(float32_runs["model"], DUMP_PROMPTS[rid], torch.float32)
        assert d.hidden.dtype == torch.float32 and d.prefix_lens == [0]
        layers = json.loads(d.metas[0]["layers"])
        assert d.hidden.shape[1] == len(layers)  # these servers dump no final state
        for slot, layer in enumerate(layers):
            torch.testing.assert_close(d.hidden[:, slot], ref[layer], atol=F32_ATOL,
                                       rtol=F32_RTOL)


def test_chunks_assemble_to_the_unchunked_tp1_result(float32_runs):
    for rid, unchunked in float32_runs["tp1"].items():
        chunked = float32_runs["tp2"][rid]
        n = len(DUMP_PROMPTS[rid])
        assert chunked.prefix_lens == list(range(0, n, CHUNK))
        assert chunked.input_ids == unchunked.input_ids == DUMP_PROMPTS[rid]
        assert chunked.positions == unchunked.positions == list(range(n))
        assert chunked.hidden.shape == unchunked.hidden.shape
        torch.testing.assert_close(chunked.hidden, unchunked.hidden, atol=F32_ATOL,
                                   rtol=F32_RTOL)
        assert chunked.metas[0]["tp_size"] == "2"


def test_tp2_writes_once_from_the_writer_rank(float32_runs):
    log = float32_runs["tp2_log"]
    assert log.count("; writer rank") == 1
    assert log.count("; non-writer rank") == 1
    # Both ranks left their install marker, which each checked before its first dump.
    for rank in (0, 1):
        marker = json.loads((float32_runs["tp2_dir"] / f".hsdump-installed-dp0-tp{rank}.json")
                            .read_text())
        assert marker["writer"] == (rank == 0)
    # Exactly one file per chunk and nothing else (no temp files, no duplicates per rank).
    for rid in DUMP_PROMPTS:
        rdir = float32_runs["tp2_dir"] / rid
        n = len(DUMP_PROMPTS[rid])
        assert sorted(p.name for p in rdir.iterdir()) == sorted(
            [f"chunk-{p:010d}.safetensors" for p in range(0, n, CHUNK)] + ["done.json"])
