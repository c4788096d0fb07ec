"""Reused read/assembly buffers: records stay byte-identical, memory stays bounded, and a
damaged chunk file is a clear protocol error (no server needed)."""

from __future__ import annotations

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.client import buffers
from hsdump_patch.client.dumps import dumpdir
from hsdump_patch.client.output import records

INFO = protocol.ServerInfo(
    model="/m", architecture="LlamaForCausalLM", layers=(3, 1, 2), layers_source="test",
    has_final=True, hidden_size=8, num_hidden_layers=4, dtype="bfloat16", tp_size=1,
    rid_prefix="hsdump-", sglang_version="0.5.23", hsdump_version="0.1.0", pid=1)


def write_chunk(dump, rid: str, start: int, hidden: torch.Tensor) -> None:
    """One chunk file in the protocol's format (positions start .. start+n)."""
    d = protocol.rid_dir(dump, rid)
    protocol.make_private_dir(d)
    n = hidden.shape[0]
    tensors = [(protocol.HIDDEN_KEY, hidden.contiguous()),
               (protocol.INPUT_IDS_KEY, torch.arange(start, start + n)),
               (protocol.POSITIONS_KEY, torch.arange(start, start + n))]
    specs = [protocol.TensorSpec(k, protocol.SAFETENSORS_DTYPES[str(t.dtype)[6:]], tuple(t.shape))
             for k, t in tensors]
    meta = protocol.ChunkMeta(rid=rid, prefix_len=start, layers=INFO.layers, has_final=True,
                              model=INFO.model, tp_size=1, sglang_version="0.5.23",
                              hsdump_version="0.1.0")
    with open(d / protocol.chunk_filename(start), "wb") as f:
        f.write(protocol.safetensors_header(specs, meta.to_strings()))
        for _, t in tensors:
            f.write(t.view(torch.uint8).numpy())


@pytest.mark.parametrize("fmt", records.FORMATS)
def test_records_from_reused_buffers_are_byte_identical_to_fresh_ones(tmp_path, fmt):
    chunk_pool = buffers.BufferPool(1 << 30)
    record_pool = buffers.BufferPool(1 << 30)
    for i, length in enumerate((9, 5)):  # the second record reuses the first one's buffers
        full = torch.randn(length, 4, 8).to(torch.bfloat16)
        rid = f"hsdump-r{i}"
        write_chunk(tmp_path, rid, 0, full[:4])
        write_chunk(tmp_path, rid, 4, full[4:])
        ids, mask = list(range(length)), [1] * length
        fresh = records.RecordBuilder(fmt, length, INFO)
        fresh.put(0, full)
        with record_pool.lend(records.RecordBuilder.nbytes(length, INFO)) as buf:
            pooled = records.RecordBuilder(fmt, length, INFO, buf)
            assert dumpdir.read_request(tmp_path, rid, ids, INFO, pooled, chunk_pool) == 2
            records.save_atomic(pooled.record(ids, mask), tmp_path / "pooled.pt")
        records.save_atomic(fresh.record(ids, mask), tmp_path / "fresh.pt")
        assert (tmp_path / "pooled.pt").read_bytes() == (tmp_path / "fresh.pt").read_bytes()


def test_pool_reuses_and_keeps_at_most_its_limit():
    """Buffers are reused; beyond the limit they are let go of, each reported to ``on_drop``
    (the bridge's sink unregisters it from Mooncake there)."""
    dropped: list[memoryview] = []
    pool = buffers.BufferPool(limit_bytes=3 << 24, on_drop=dropped.append)
    with pool.lend(100) as a:
        first = a
    with pool.lend(50) as b:
        assert b is first  # reused, not allocated again
    with pool.lend(1 << 24) as x, pool.lend(1 << 24) as y, pool.lend(1 << 24) as z:
        assert len({id(x), id(y), id(z)}) == 3
        with pool.lend(1 << 24) as fourth:  # four lent at once: over the limit while lent
            pass
    assert pool._held <= pool.limit
    assert [id(d) for d in dropped] == [id(fourth)]
    with pool.lend(2 << 24) as big:  # none fits: two free ones go so that it stays in the limit
        assert len(dropped) == 3 and all(len(d) == 1 << 24 for d in dropped)
        assert all(d is not big for d in dropped)
    assert pool._held <= pool.limit


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_chunk_is_a_protocol_error_naming_the_file(tmp_path, damage):
    write_chunk(tmp_path, "hsdump-x", 0, torch.zeros(4, 4, 8, dtype=torch.bfloat16))
    path = next(protocol.rid_dir(tmp_path, "hsdump-x").iterdir())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not safetensors")
    builder = records.RecordBuilder("eagle3", 4, INFO)
    with pytest.raises(protocol.ProtocolError, match=str(path)):
        dumpdir.read_request(tmp_path, "hsdump-x", [0, 1, 2, 3], INFO, builder,
                              buffers.BufferPool(1 << 30))
