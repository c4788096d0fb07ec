"""Training records: the two output formats, their atomic writing and the sidecar metadata.

``eagle3`` (default, this project's format), one ``<name>.pt`` per sample::

    input_ids       [L] int64
    loss_mask       [L] int64 (1 on assistant tokens)
    hidden_states   list of K tensors [L, H], model dtype, in the order of ``layers``
    final_hidden_state  [L, H] (only when the server captures the post-final-norm state)

``specforge``: exactly what SpecForge's ``scripts/prepare_hidden_states.py`` writes and its
offline trainer reads (``rows_<group>/<name>.ckpt``, or ``.ckpt.gz`` with ``--compress``)::

    input_ids, loss_mask   as above
    aux_hidden_state       [1, L, K*H]: the K layers concatenated in ascending layer order
    hidden_state           [1, L, H] post-final-norm state (required)

Files load with :func:`hsdump_patch.reader.load_record` (``weights_only=True``). ``<name>`` is
the sample id when it is short and plain, else a readable prefix + a hash of it (the manifest
maps names back to ids). ``hsdump-meta.json`` in the output directory says which model, layers,
convention and versions produced them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import torch

from hsdump_patch import __version__, protocol
from hsdump_patch.client.buffers import tensor_at, torch_dtype
from hsdump_patch.reader import load_record

__all__ = ["load_record"]

FORMATS = ("eagle3", "specforge")
# Formats whose records need the post-final-norm state (SpecForge's target is lm_head of it;
# eagle3 records without it cannot train a drafter either, see docs/client.md).
NEEDS_FINAL = {"eagle3": "final_hidden_state", "specforge": "hidden_state"}
META_FILE = "hsdump-meta.json"
RECORD_SUFFIX = ".pt"
SPECFORGE_SUFFIX = ".ckpt"
GZIP_LEVEL = 6  # SpecForge's --compression-level default
LAYER_CONVENTION = (
    "layers[i] = residual stream at the input of decoder layer i "
    "= HF transformers output_hidden_states[i] (0 = embeddings)"
)
FINAL_CONVENTION = "post-final-norm hidden state (the input of lm_head)"
# Fields of the sidecar that must not change between runs writing into one directory.
_STABLE_FIELDS = ("format", "model", "layers", "has_final", "hidden_size", "dtype", "compress",
                  "loss_mask_convention", "chat_template_kwargs")
_PLAIN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,79}")
_HASHED_STEM = re.compile(r"-[0-9a-f]{16}$")
_READABLE_LEN = 48


def record_stem(sample_id: str) -> str:
    """A short, stable, filesystem-safe name for any id.

    A plain id (``[A-Za-z0-9._-]``, at most 80 characters, no leading dot) is its own name;
    any other id becomes ``<readable prefix>-<16 hex of its SHA-256>`` (at most 65 bytes), so
    long and non-ASCII ids stay far below the 255-byte file-name limit. A plain id that looks
    like a hashed name is hashed too, so two ids never share a name.
    """
    if _PLAIN_ID.fullmatch(sample_id) and not _HASHED_STEM.search(sample_id):
        return sample_id
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", sample_id)[:_READABLE_LEN].strip("_") or "id"
    digest = hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable}-{digest}"


def record_name(sample_id: str, fmt: str = "eagle3", compress: bool = False) -> str:
    """Path of a sample's record relative to the output directory (``/``-separated).

    specforge records go to one of 256 groups ``rows_<2 hex>`` (a hash of the id) as
    SpecForge groups its own files in ``rows_<a>-<b>`` directories; its loader lists
    ``.ckpt`` / ``.ckpt.gz`` files recursively, whatever the directory names.
    """
    stem = record_stem(sample_id)
    if fmt == "eagle3":
        return stem + RECORD_SUFFIX + (".gz" if compress else "")
    group = hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:2]
    return f"rows_{group}/{stem}{SPECFORGE_SUFFIX}{'.gz' if compress else ''}"


def check_format(fmt: str, info: protocol.ServerInfo, allow_no_final: bool = False) -> None:
    """Refuse a format the server's dump cannot fill (raise ValueError saying how to fix it)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if info.has_final or (fmt == "eagle3" and allow_no_final):
        return
    hint = (" (or pass --allow-no-final to write eagle3 records without it)"
            if fmt == "eagle3" else "")
    raise ValueError(
        f"--format {fmt} needs the post-final-norm hidden state ({NEEDS_FINAL[fmt]}: the "
        f"drafter's target distribution is lm_head of it), but the server of {info.model} does "
        "not dump it (server.json: has_final false). Restart the server with "
        f"SGLANG_HS_DUMP_FINAL=1 (the default; it was set to 0){hint}")


class RecordBuilder:
    """Collects a request's chunks straight into the output format's tensors (one copy)."""

    def __init__(self, fmt: str, length: int, info: protocol.ServerInfo,
                 buf: memoryview | None = None) -> None:
        """Tensors for ``length`` tokens, in ``buf`` (at least :meth:`nbytes` long; the record
        must be written before it is reused) or freshly allocated."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.k = len(info.layers)
        dtype, h = torch_dtype(info.dtype), info.hidden_size
        offset = 0

        def empty(*shape: int) -> torch.Tensor:
            nonlocal offset
            if buf is None:
                return torch.empty(shape, dtype=dtype)
            t = tensor_at(buf, offset, dtype, shape)
            offset += t.nbytes
            return t

        if fmt == "eagle3":
            self.layers = [empty(length, h) for _ in range(self.k)]
        else:
            self.aux = empty(length, self.k, h)
            # SGLang's EAGLE-3 serving concatenates the aux layers in ascending layer order.
            order = sorted(range(self.k), key=lambda s: info.layers[s])
            self.order = None if order == list(range(self.k)) else order
        self.final = empty(length, h) if info.has_final else None

    @staticmethod
    def nbytes(length: int, info: protocol.ServerInfo) -> int:
        """Bytes of a record's hidden states (the buffer a builder needs)."""
        slots = len(info.layers) + int(info.has_final)
        return length * slots * info.hidden_size * torch_dtype(info.dtype).itemsize

    def put(self, start: int, hidden: torch.Tensor) -> None:
        """Copy one chunk's ``hidden_states`` [n, S, H] to positions ``start .. start+n``."""
        end = start + hidden.shape[0]
        if self.fmt == "eagle3":
            for s, dst in enumerate(self.layers):
                dst[start:end] = hidden[:, s]
        elif self.order is None:
            self.aux[start:end] = hidden[:, : self.k]
        else:
            self.aux[start:end] = hidden[:, self.order]
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
        else:  # SpecForge's batch dimension: [1, L, ...]
            if self.final is None:
                raise ValueError("specforge records need the post-final-norm state")
            rec["aux_hidden_state"] = self.aux.view(1, self.aux.shape[0], -1)
            rec["hidden_state"] = self.final.unsqueeze(0)
        return rec


def save_atomic(record: dict[str, Any], path: Path, compress: bool = False) -> int:
    """Write ``record`` to ``path`` (:func:`protocol.atomic_file`; gzip when ``compress``);
    return the bytes written. Creates the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with protocol.atomic_file(path, mode=protocol.PUBLIC_FILE_MODE) as f:
        if compress:
            with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=GZIP_LEVEL) as gz:
                torch.save(record, gz)
        else:
            torch.save(record, f)
        size = f.tell()
    return size


def sidecar(fmt: str, info: protocol.ServerInfo, *, tokenizer: str | None,
            max_len: int | None, compress: bool = False,
            trust_remote_code: bool = False, loss_mask: str = "completion",
            chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata describing every record of an output directory."""
    return {
        "format": fmt,
        "compress": compress,
        "model": info.model,
        "architecture": info.architecture,
        "layers": list(info.layers),
        "layers_source": info.layers_source,
        "aux_layer_order": sorted(info.layers) if fmt == "specforge" else list(info.layers),
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
        "trust_remote_code": trust_remote_code,
        "max_len": max_len,
        "loss_mask_convention": loss_mask,  # hsdump_patch.client.rows.mask
        "chat_template_kwargs": chat_template_kwargs,
    }


def ensure_sidecar(out_dir: Path, meta: dict[str, Any]) -> str:
    """Write the sidecar, or check that an existing one describes the same records; return
    the directory's run id (``run_id``: made by its first run, kept by every later one, so a
    resumed run finds its own leftovers in the dump dir and no other output's)."""
    path = out_dir / META_FILE
    if path.exists():
        old = json.loads(path.read_text())
        old.setdefault("compress", False)  # sidecars written before --compress existed
        old.setdefault("loss_mask_convention", "completion")  # ... before --loss-mask
        diff = [k for k in _STABLE_FIELDS if old.get(k) != meta[k]]
        if diff:
            shown = ", ".join(f"{k}: {old.get(k)!r} -> {meta[k]!r}" for k in diff)
            raise ValueError(
                f"{out_dir} already holds records made differently ({shown}); use a new --out "
                "directory, or the same server configuration and --format as before")
        if isinstance(old.get("run_id"), str) and old["run_id"]:
            return old["run_id"]
        meta = {**old, "run_id": secrets.token_hex(6)}  # a sidecar from before run ids
    else:
        meta = {**meta, "run_id": secrets.token_hex(6)}
    protocol.write_json_atomic(path, meta)
    return meta["run_id"]
