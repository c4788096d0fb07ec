"""The capture patch on real CPU SGLang 0.5.23 servers (tiny Llama and DeepSeek-V3, bf16).

Dumps are checked against two independent references: HF transformers
``output_hidden_states`` and SGLang's own EAGLE-3 aux capture (``return_hidden_states`` with
``--enable-return-aux-hidden-states``), on the same server.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from hsdump_patch import protocol
from hsdump_patch.capture.session import STATUS_INTERVAL_S
from hsdump_patch.ops import verify_checks
from tests.harness.dump_server import CHUNK, DumpServer, prompt
from tests.harness.dumps import read_dump, server_layers, wait_finished
from tests.harness.reference import hf_hidden_states

pytestmark = pytest.mark.server

EXPECTED_LAYERS = {"llama_server": [2, 4, 5], "deepseek_server": [2, 4, 6]}


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within the bf16 bounds of ``verify_checks`` (the ones ``hsdump verify`` states)."""
    c = verify_checks.closeness(actual, expected)
    assert c.within(), f"{what}: {c.describe()}"


@pytest.fixture(params=["llama_server", "deepseek_server"])
def served(request) -> tuple[str, DumpServer]:
    return request.param, request.getfixturevalue(request.param)


def dump_prompt(s: DumpServer, rid: str, ids: list[int]) -> dict:
    meta = s.server.generate(ids, rid=rid)["meta_info"]
    assert meta["cached_tokens"] == 0 and meta["prompt_tokens"] == len(ids)
    return meta


def test_auto_layers_resolve_like_sglang_eagle3(served):
    name, s = served
    assert server_layers(s.dump_dir) == EXPECTED_LAYERS[name]
    # The writer's [T, S, H] buffer is reserved once, for the largest forward (the chunk).
    assert f"capture buffer of {CHUNK} tokens x 4 states x 64" in s.server.log()
    info = protocol.read_server_info(s.dump_dir)
    assert info.has_final and info.hidden_size == 64 and info.dtype == "bfloat16"
    assert info.sglang_version == "0.5.23" and info.rid_prefix == "hsdump-"


@pytest.mark.parametrize("length", [20, 3 * CHUNK + 5])
def test_dump_equals_hf_output_hidden_states(served, length):
    _, s = served
    ids = prompt(length, length)
    rid = f"hsdump-hf-{length}"
    dump_prompt(s, rid, ids)
    d = read_dump(s.dump_dir, rid)
    layers = server_layers(s.dump_dir)
    assert d.input_ids == ids
    assert d.positions == list(range(length))
    assert d.hidden.shape == (length, len(layers) + 1, 64) and d.hidden.dtype == torch.bfloat16
    expected_chunks = list(range(0, length, CHUNK))
    assert d.prefix_lens == expected_chunks
    ref = hf_hidden_states(s.model, ids, torch.bfloat16)
    for slot, layer in enumerate(layers):
        assert_bf16_close(d.hidden[:, slot], ref[layer], f"layer {layer}")
    assert_bf16_close(d.hidden[:, -1], ref[-1], "final state")


def test_dump_equals_sglang_own_aux_capture(served):
    """Train/serve consistency: the patch sees exactly what SGLang's EAGLE-3 path feeds a draft."""
    _, s = served
    ids = prompt(7, CHUNK - 4)  # one chunk: the built-in capture keeps only the last chunk
    dump_prompt(s, "hsdump-builtin", ids)
    body = {"input_ids": ids, "rid": "builtin-reference", "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    out = requests.post(f"{s.url}/generate", json=body, timeout=120).json()
    builtin = torch.tensor(out["meta_info"]["hidden_states"][0])  # [T, K*H] packed aux
    d = read_dump(s.dump_dir, "hsdump-builtin")
    k = d.hidden.shape[1] - 1
    ours = d.hidden[:, :k].reshape(len(ids), -1).float()
    assert builtin.shape == ours.shape
    assert torch.equal(ours, builtin), (ours - builtin).abs().max()


def test_sixteen_concurrent_requests_get_their_own_rows(llama_server):
    s = llama_server
    lengths = [5 + 9 * i for i in range(16)]  # 5 .. 140 tokens, several chunks for most
    prompts = {f"hsdump-conc-{i}": prompt(100 + i, n) for i, n in enumerate(lengths)}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: dump_prompt(s, *kv), prompts.items()))
    layers = server_layers(s.dump_dir)
    for rid, ids in prompts.items():
        d = read_dump(s.dump_dir, rid)
        assert d.input_ids == ids, rid
        assert d.positions == list(range(len(ids))), rid
        ref = hf_hidden_states(s.model, ids, torch.bfloat16)
        assert_bf16_close(d.hidden[:, 0], ref[layers[0]], rid)


def test_mixed_chunk_decode_tails_are_ignored(llama_server):
    """With --enable-mixed-chunk (on in ``llama_server``) a prompt prefilled beside running
    decodes runs as a MIXED forward, in which each decoding request is a one-token extend row
    (prefix = sequence length - 1). Those rows are not new attempts of their requests: every
    dump completes whole and no error marker appears later (issue 17)."""
    s = llama_server
    log_start = len(s.server.log())
    lengths = [7 + 11 * i for i in range(8)]  # 7 .. 84 tokens, up to 3 chunks
    prompts = {f"hsdump-mixed-{i}": prompt(300 + i, n) for i, n in enumerate(lengths)}

    def run(i: int) -> None:
        # The first request decodes long (its end of text ignored), so every later one, sent
        # while it runs, prefills beside its decode rows whatever the machine's speed.
        time.sleep(0.3 + 0.05 * i if i else 0)
        rid = f"hsdump-mixed-{i}"
        body = {"rid": rid, "input_ids": prompts[rid], "sampling_params": {
            "max_new_tokens": 256 if i == 0 else 12, "temperature": 0, "ignore_eos": True}}
        r = requests.post(f"{s.url}/generate", json=body, timeout=300)
        r.raise_for_status()
        meta = r.json()["meta_info"]
        assert meta["cached_tokens"] == 0 and meta["completion_tokens"] >= 2, meta

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(run, range(len(prompts))))
    log = s.server.log()[log_start:]
    assert re.search(r"Prefill batch.*#running-req: [1-9]", log), "no prefill beside a decode"
    layers = server_layers(s.dump_dir)
    for rid, ids in prompts.items():
        d = read_dump(s.dump_dir, rid)
        assert d.input_ids == ids and d.positions == list(range(len(ids))), rid
        assert_bf16_close(d.hidden[:, 0], hf_hidden_states(s.model, ids, torch.bfloat16)[layers[0]],
                          rid)
    # Every request has finished decoding: a decode row taken as an attempt would show by now.
    for rid in prompts:
        status = protocol.request_status(s.dump_dir, rid)
        assert status.error is None and status.done is not None, (rid, status)


def _tracked_after_probe(s: DumpServer, rid: str, seed: int) -> dict:
    """The writer rank's bookkeeping sizes, from the status.json that the dumped forward of
    a fresh probe request refreshes (its interval waited out first)."""
    time.sleep(STATUS_INTERVAL_S + 0.2)
    forwards = json.loads((s.dump_dir / protocol.STATUS).read_text())["forwards_dumped"]
    dump_prompt(s, rid, prompt(seed, 9))
    assert wait_finished(s.dump_dir, rid).done is not None, rid
    status = json.loads((s.dump_dir / protocol.STATUS).read_text())
    assert status["forwards_dumped"] > forwards, "status.json not refreshed by the probe"
    return status["tracked"]


def test_per_request_bookkeeping_only_for_dumped_prefill(llama_server):
    """Decode steps (plain and as MIXED-forward tails) and requests that are not dumped add no
    per-request entries: after dumped requests with long decodes beside many non-dumped ones,
    the writer rank's status.json shows its bookkeeping back where it was (issue 17). Before
    the fix each decode step re-noted its requests' prompt lengths, never to be dropped."""
    s = llama_server
    before = _tracked_after_probe(s, "hsdump-bookkeeping-probe-0", 900)
    dumped = [f"hsdump-bookkeeping-{i}" for i in range(4)]
    others = [f"plain-bookkeeping-{i}" for i in range(8)]

    def run(rid: str) -> None:
        i = int(rid.rsplit("-", 1)[1])
        # Prompts arrive while earlier requests decode (their rows: MIXED-forward decode
        # tails); the dumped ones decode on after the last prefill (plain decode steps).
        time.sleep(0.1 * i + 0.05 * (rid in dumped))
        n = 24 if rid in dumped else 4
        body = {"rid": rid, "input_ids": prompt(500 + i + 50 * (rid in others), 20 + 7 * i),
                "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                    "ignore_eos": True}}
        r = requests.post(f"{s.url}/generate", json=body, timeout=300)
        r.raise_for_status()
        assert r.json()["meta_info"]["completion_tokens"] == n

    with ThreadPoolExecutor(len(dumped) + len(others)) as pool:
        list(pool.map(run, dumped + others))
    for rid in dumped:
        assert wait_finished(s.dump_dir, rid).done is not None, rid
    after = _tracked_after_probe(s, "hsdump-bookkeeping-probe-1", 901)
    # The writer may or may not have finished the probe when its forward wrote the status.
    assert after.pop("writer_requests") <= before.pop("writer_requests") + 1
    assert after == before, f"bookkeeping grew: {before} -> {after}"
    assert not any(protocol.rid_dir(s.dump_dir, rid).exists() for rid in others)


def _request_dirs(dump_dir) -> set[str]:
    return {e.name for e in os.scandir(dump_dir) if e.is_dir()}


def test_warmup_health_and_foreign_rids_leave_no_files(llama_server):
    s = llama_server
    prefix_dir = protocol.rid_dirname("hsdump-")
    # The server's warm-up ran at start-up: only prefixed requests may have left directories.
    assert all(d.startswith(prefix_dir) for d in _request_dirs(s.dump_dir))
    before = _request_dirs(s.dump_dir)
    assert requests.get(f"{s.url}/health_generate", timeout=60).status_code == 200
    assert requests.get(f"{s.url}/health", timeout=60).status_code == 200
    s.server.generate(prompt(3, 40), rid="notdumped-1")
    s.server.generate(prompt(4, 10), max_new_tokens=4)  # no rid at all: a uuid
    dump_prompt(s, "hsdump-after", prompt(5, 10))  # a prefixed request right after is dumped
    assert wait_finished(s.dump_dir, "hsdump-after").done is not None
    assert _request_dirs(s.dump_dir) - before == {protocol.rid_dirname("hsdump-after")}


def test_dump_files_are_private_and_complete(llama_server):
    s = llama_server
    dump_prompt(s, "hsdump-perms", prompt(9, 50))
    wait_finished(s.dump_dir, "hsdump-perms")
    rdir = protocol.rid_dir(s.dump_dir, "hsdump-perms")
    assert stat.S_IMODE(os.stat(s.dump_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(rdir).st_mode) == 0o700
    names = sorted(os.listdir(rdir))
    assert names == [protocol.chunk_filename(0), protocol.chunk_filename(CHUNK),
                     protocol.DONE_MARKER]
    for n in names:
        assert stat.S_IMODE(os.stat(rdir / n).st_mode) == 0o600
