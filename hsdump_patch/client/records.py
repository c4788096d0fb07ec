"""Training records: the two output formats, their atomic writing and the sidecar metadata.

``eagle3`` (default), one ``<id>.pt`` per sample::

    input_ids       [L] int64
    loss_mask       [L] int64 (1 on assistant tokens)
    hidden_states   list of K tensors [L, H], model dtype, in the order of ``layers``
    final_hidden_state  [L, H] (only when the server captures the post-final-norm state)

``specforge`` (the keys SpecForge's offline trainer reads)::

    input_ids, loss_mask   as above
    aux_hidden_state       [L, K*H]: the K layers concatenated on the last dim, ``layers`` order
    hidden_state           [L, H] post-final-norm state (only when captured)

Files load with ``torch.load(path, weights_only=True)``. ``hsdump-meta.json`` in the output
directory says which model, layers, convention and versions produced them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from hsdump_patch import __version__, protocol

FORMATS = ("eagle3", "specforge")
META_FILE = "hsdump-meta.json"
RECORD_SUFFIX = ".pt"
LAYER_CONVENTION = (
    "layers[i] = residual stream at the input of decoder layer i "
    "= HF transformers output_hidden_states[i] (0 = embeddings)"
)
FINAL_CONVENTION = "post-final-norm hidden state (the input of lm_head)"
# Fields of the sidecar that must not change between runs writing into one directory.
_STABLE_FIELDS = ("format", "model", "layers", "has_final", "hidden_size", "dtype")


def record_name(sample_id: str) -> str:
    """File name of a sample's record: the id, percent-encoded into a safe name."""
    return protocol.rid_dirname(sample_id) + RECORD_SUFFIX


def torch_dtype(name: str) -> torch.dtype:
    """``bfloat16`` -> ``torch.bfloat16`` (names as in server.json)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in server.json")
    return dtype


class RecordBuilder:
    """Collects a request's chunks straight into the output format's tensors (one copy)."""

    def __init__(self, fmt: str, length: int, info: protocol.ServerInfo) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.k = len(info.layers)
        dtype, h = torch_dtype(info.dtype), info.hidden_size
        if fmt == "eagle3":
            self.layers = [torch.empty(length, h, dtype=dtype) for _ in range(self.k)]
        else:
            self.aux = torch.empty(length, self.k, h, dtype=dtype)
        self.final = torch.empty(length, h, dtype=dtype) if info.has_final else None

    def put(self, start: int, hidden: torch.Tensor) -> None:
        """Copy one chunk's ``hidden_states`` [n, S, H] to positions ``start .. start+n``."""
        end = start + hidden.shape[0]
        if self.fmt == "eagle3":
            for s, dst in enumerate(self.layers):
                dst[start:end] = hidden[:, s]
        else:
            self.aux[start:end] = hidden[:, : self.k]
        if self.final is not None:
            self.final[start:end] = hidden[:, self.k]

    def record(self, input_ids: list[int], loss_mask: list[int]) -> dict[str, Any]:
        """Return the finished record."""
        rec: dict[str, Any] = {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
        }
        if self.fmt == "eagle3":
            rec["hidden_states"] = self.layers
            if self.final is not None:
                rec["final_hidden_state"] = self.final
        else:
            rec["aux_hidden_state"] = self.aux.view(self.aux.shape[0], -1)
            if self.final is not None:
                rec["hidden_state"] = self.final
        return rec


def save_atomic(record: dict[str, Any], path: Path) -> int:
    """Write ``record`` to ``path`` (temp file, fsync, rename); return the bytes written."""
    tmp = protocol.temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(record, f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def load_record(path: Path) -> dict[str, Any]:
    """Load a record safely (no pickled code)."""
    return torch.load(path, weights_only=True)


def sidecar(fmt: str, info: protocol.ServerInfo, *, tokenizer: str | None,
            max_len: int | None) -> dict[str, Any]:
    """The metadata describing every record of an output directory."""
    return {
        "format": fmt,
        "model": info.model,
        "architecture": info.architecture,
        "layers": list(info.layers),
        "layers_source": info.layers_source,
        "layer_convention": LAYER_CONVENTION,
        "has_final": info.has_final,
        "final_convention": FINAL_CONVENTION if info.has_final else None,
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_hidden_layers,
        "dtype": info.dtype,
        "tp_size": info.tp_size,
        "sglang_version": info.sglang_version,
        "hsdump_server_version": info.hsdump_version,
        "hsdump_client_version": __version__,
        "python": sys.version.split()[0],
        "tokenizer": tokenizer,
        "max_len": max_len,
    }


def ensure_sidecar(out_dir: Path, meta: dict[str, Any]) -> None:
    """Write the sidecar, or check that an existing one describes the same records."""
    path = out_dir / META_FILE
    if path.exists():
        old = json.loads(path.read_text())
        diff = [k for k in _STABLE_FIELDS if old.get(k) != meta[k]]
        if diff:
            shown = ", ".join(f"{k}: {old.get(k)!r} -> {meta[k]!r}" for k in diff)
            raise ValueError(
                f"{out_dir} already holds records made differently ({shown}); use a new --out "
                "directory, or the same server configuration and --format as before")
        return
    protocol.write_json_atomic(path, meta)
