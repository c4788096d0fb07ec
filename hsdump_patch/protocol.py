"""The file protocol between the capture patch (inside SGLang) and the client.

This module is the single definition of the on-disk layout; both sides import it and
``docs/protocol.md`` describes it for humans. It deliberately imports nothing heavy
(no torch) so that the reading side can be used in small tools.

Layout under the dump directory (``SGLANG_HS_DUMP_DIR``, mode 0700)::

    server.json                       written once per writer rank at start-up
    <rid-dir>/                        one per request, mode 0700
        chunk-<prefix_len:010d>.safetensors   one per prefill chunk, mode 0600
        done.json                     the whole prompt is covered
        error.json                    the request cannot be dumped; reason inside

Every file appears under its final name only when complete (temp file + rename);
names starting with ``.`` are in-progress temp files and never part of the protocol.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import struct
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

FORMAT_VERSION = 1

# The environment contract: what switches the capture on and shapes it (docs/capture.md).
ENV_DIR = "SGLANG_HS_DUMP_DIR"
ENV_LAYERS = "SGLANG_HS_DUMP_LAYERS"
ENV_DRAFT_CONFIG = "SGLANG_HS_DUMP_DRAFT_CONFIG"
ENV_RID_PREFIX = "SGLANG_HS_DUMP_RID_PREFIX"
ENV_FINAL = "SGLANG_HS_DUMP_FINAL"
ENV_MAX_INFLIGHT = "SGLANG_HS_DUMP_MAX_INFLIGHT_BYTES"
ENV_MIN_FREE = "SGLANG_HS_DUMP_MIN_FREE_BYTES"
ENV_WRITER_THREADS = "SGLANG_HS_DUMP_WRITER_THREADS"
DEFAULT_DUMP_DIR = "/dev/shm/sglang_hs"
DEFAULT_RID_PREFIX = "hsdump-"

SERVER_INFO = "server.json"
STATUS = "status.json"  # the writer rank's counters, refreshed as it dumps
DONE_MARKER = "done.json"
ERROR_MARKER = "error.json"
CHUNK_PREFIX = "chunk-"
CHUNK_SUFFIX = ".safetensors"

# Tensor names inside a chunk file.
# [n, S, H] in the model dtype. Slot s < K holds the residual stream at the input of decoder
# layer ``layers[s]`` (= HF output_hidden_states[layers[s]]); when ``has_final`` the last slot
# holds the post-final-norm hidden state (what feeds lm_head; SpecForge's ``hidden_state``).
HIDDEN_KEY = "hidden_states"
INPUT_IDS_KEY = "input_ids"  # [n], int64
POSITIONS_KEY = "positions"  # [n], int64

DIR_MODE = 0o700
MAX_DIRNAME = 200  # request directory names stay below this many bytes (+1 when hashed)
FILE_MODE = 0o600

# safetensors dtype names <-> torch dtype names (kept as strings: no torch import here).
SAFETENSORS_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "F8_E4M3": 1, "F8_E5M2": 1}


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable and the fix."""


def parse_size(text: str, var: str) -> int:
    """Parse ``4GiB``, ``512M``, ``1000000`` ... into bytes; ``var`` names the source."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(
            f"{var}={text!r} is not a size: use a number of bytes with an optional unit, "
            "e.g. 4GiB, 512MiB or 1000000"
        )
    unit = (m.group(2) or "").upper().rstrip("B")
    return int(float(m.group(1)) * _UNITS[unit])


def install_marker(dump_dir: str | os.PathLike[str], tp_rank: int, dp_rank: int = 0) -> Path:
    """The file each rank of a node writes when its capture is installed (``--dp-size``
    replicas on one node share the dump dir, so the name holds the DP rank too)."""
    return Path(dump_dir) / f".hsdump-installed-dp{dp_rank}-tp{tp_rank}.json"


class ProtocolError(RuntimeError):
    """A dump directory does not follow the protocol (missing, inconsistent or corrupt)."""


def rid_dirname(rid: str) -> str:
    """Return the directory name for a request id: percent-encoded so any rid is a safe name,
    shortened to a prefix + hash past ``MAX_DIRNAME`` bytes."""
    if not rid:
        raise ValueError("empty request id")
    name = urllib.parse.quote(rid, safe="-_")
    # '.' is encoded too, so a rid can never be '.', '..' or a hidden temp name.
    name = name.replace(".", "%2E")
    if len(name) <= MAX_DIRNAME:
        return name
    # Long (or non-ASCII, 9 bytes per character encoded) rids: a prefix + a hash, one byte
    # longer than any plain name, so the two kinds never meet; far below the 255-byte limit.
    digest = hashlib.sha256(rid.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return name[: MAX_DIRNAME - 32] + "+" + digest


def rid_dir(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    """Return the directory holding one request's files."""
    return Path(dump_dir) / rid_dirname(rid)


def chunk_filename(prefix_len: int) -> str:
    """Return the file name of the chunk whose first token is at position ``prefix_len``."""
    return f"{CHUNK_PREFIX}{prefix_len:010d}{CHUNK_SUFFIX}"


def parse_chunk_filename(name: str) -> int | None:
    """Return the prefix length encoded in a chunk file name, or None for other names."""
    if not (name.startswith(CHUNK_PREFIX) and name.endswith(CHUNK_SUFFIX)):
        return None
    digits = name[len(CHUNK_PREFIX) : -len(CHUNK_SUFFIX)]
    return int(digits) if digits.isdigit() else None


_TEMP_SALT = os.urandom(4).hex()  # with the pid: no other process's temp names
_TEMP_IDS = itertools.count()  # next() is atomic: no other thread's temp names


def temp_path(final: Path) -> Path:
    """Return a unique hidden temp name beside ``final`` (same filesystem, so rename is atomic).

    No system call: the capture writer's threads make one per file, and each call is a GIL
    hand-over that can delay the forward thread."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{_TEMP_SALT}{next(_TEMP_IDS):x}")


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) with mode 0700, tightening an existing directory."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(path, DIR_MODE)


PUBLIC_FILE_MODE = 0o666  # what open() creates: the umask decides


@contextmanager
def atomic_file(path: Path, *, mode: int = FILE_MODE, fsync: bool = True,
                fsync_dir: bool = False) -> Iterator[BinaryIO]:
    """Write ``path`` all at once or not at all: yield a new temp file beside it (O_EXCL,
    ``mode``), then flush, fsync (``fsync``) and rename it over ``path``, then fsync the
    directory (``fsync_dir``: the rename itself survives a crash). On any error the temp file
    is removed and ``path`` is left as it was."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync_dir:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_json_atomic(path: Path, payload: Mapping[str, Any], *, fsync: bool = True) -> None:
    """Write a small JSON file atomically (:func:`atomic_file`) with mode 0600.

    ``fsync=False`` (the capture's markers and status on ``/dev/shm``, written beside the
    forward): raw writes, four system calls in all, where a file object adds fstat, ioctl, ...
    and each call is a GIL hand-over that can delay the forward thread."""
    data = memoryview(json.dumps(payload, sort_keys=True).encode())
    if fsync:
        with atomic_file(path) as f:
            f.write(data)
        return
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        try:
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------
# safetensors header (the writer streams raw bytes after it, without an extra copy)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """Name, safetensors dtype and shape of one tensor in a chunk file."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def safetensors_header(specs: Iterable[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """Return the safetensors header (length prefix + JSON, 8-byte aligned) for ``specs``.

    The tensors' raw bytes follow in the order given, back to back.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


# --------------------------------------------------------------------------------------
# Metadata carried by each chunk and by server.json
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkMeta:
    """Metadata stored in every chunk file's safetensors ``__metadata__``."""

    rid: str
    prefix_len: int
    layers: tuple[int, ...]
    has_final: bool
    model: str
    tp_size: int
    sglang_version: str
    hsdump_version: str
    format_version: int = FORMAT_VERSION

    def to_strings(self) -> dict[str, str]:
        return {
            "rid": self.rid,
            "prefix_len": str(self.prefix_len),
            "layers": json.dumps(list(self.layers)),
            "has_final": "1" if self.has_final else "0",
            "model": self.model,
            "tp_size": str(self.tp_size),
            "sglang_version": self.sglang_version,
            "hsdump_version": self.hsdump_version,
            "format_version": str(self.format_version),
        }

    @classmethod
    def from_strings(cls, meta: Mapping[str, str]) -> ChunkMeta:
        try:
            return cls(
                rid=meta["rid"],
                prefix_len=int(meta["prefix_len"]),
                layers=tuple(json.loads(meta["layers"])),
                has_final=meta["has_final"] == "1",
                model=meta["model"],
                tp_size=int(meta["tp_size"]),
                sglang_version=meta["sglang_version"],
                hsdump_version=meta["hsdump_version"],
                format_version=int(meta["format_version"]),
            )
        except (KeyError, ValueError) as e:
            raise ProtocolError(f"chunk metadata is incomplete or malformed: {e!r}") from e


@dataclass(frozen=True)
class ServerInfo:
    """What the capture patch announces in ``server.json`` when it is installed."""

    model: str
    architecture: str
    layers: tuple[int, ...]
    layers_source: str
    has_final: bool
    hidden_size: int
    num_hidden_layers: int
    dtype: str
    tp_size: int
    rid_prefix: str
    sglang_version: str
    hsdump_version: str
    pid: int
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of hidden states one prompt token produces in the dump dir."""
        itemsize = ITEMSIZE[SAFETENSORS_DTYPES[self.dtype]]
        return (len(self.layers) + int(self.has_final)) * self.hidden_size * itemsize

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> ServerInfo:
        data = dict(payload)
        data["layers"] = tuple(data["layers"])
        return cls(**data)


def read_server_info(dump_dir: str | os.PathLike[str]) -> ServerInfo:
    """Read ``server.json``; raise ProtocolError with a hint if dumping is not active."""
    path = Path(dump_dir) / SERVER_INFO
    try:
        return ServerInfo.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ProtocolError(
            f"{path} does not exist: the hsdump capture patch is not active on this server "
            "(is hsdump installed in the server's environment and SGLANG_HS_DUMP_DIR set to "
            "this directory?)"
        ) from None
    except (ValueError, TypeError, KeyError) as e:
        raise ProtocolError(f"{path} is malformed: {e!r}") from e


# --------------------------------------------------------------------------------------
# Reading a request's files (client side)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DoneMarker:
    """``done.json``: every token of the prompt is in the request's chunks."""

    rid: str
    prompt_len: int
    tokens: int
    chunks: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"rid": self.rid, "prompt_len": self.prompt_len, "tokens": self.tokens,
                "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DoneMarker:
        return cls(str(d["rid"]), int(d["prompt_len"]), int(d["tokens"]),
                   [int(c) for c in d["chunks"]])


@dataclass(frozen=True)
class ErrorMarker:
    """``error.json``: the request cannot be dumped; ``chunks`` were written before."""

    rid: str
    reason: str
    chunks: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"rid": self.rid, "reason": self.reason, "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ErrorMarker:
        return cls(str(d["rid"]), str(d["reason"]), [int(c) for c in d["chunks"]])


@dataclass(frozen=True)
class RequestStatus:
    """What the markers of one request directory say."""

    done: DoneMarker | None
    error: ErrorMarker | None

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None


def _read_marker(path: Path, kind: type[DoneMarker] | type[ErrorMarker]) -> Any:
    try:
        return kind.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as e:
        raise ProtocolError(f"{path} is malformed: {e!r}") from e


def request_status(dump_dir: str | os.PathLike[str], rid: str) -> RequestStatus:
    """Return the done/error markers of a request (None where absent)."""
    d = rid_dir(dump_dir, rid)
    return RequestStatus(done=_read_marker(d / DONE_MARKER, DoneMarker),
                         error=_read_marker(d / ERROR_MARKER, ErrorMarker))


def list_chunks(dump_dir: str | os.PathLike[str], rid: str) -> list[tuple[int, Path]]:
    """Return ``(prefix_len, path)`` for every complete chunk of a request, sorted."""
    d = rid_dir(dump_dir, rid)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    chunks = [(p, d / n) for n in names if (p := parse_chunk_filename(n)) is not None]
    return sorted(chunks)


def check_coverage(prefix_lens_and_sizes: Iterable[tuple[int, int]], prompt_len: int) -> None:
    """Raise ProtocolError unless the chunks cover ``[0, prompt_len)`` contiguously, once."""
    pos = 0
    for prefix_len, n in prefix_lens_and_sizes:
        if prefix_len != pos:
            kind = "gap" if prefix_len > pos else "overlap"
            raise ProtocolError(
                f"chunks do not cover the prompt contiguously: {kind} at token {pos} "
                f"(next chunk starts at {prefix_len})"
            )
        if n <= 0:
            raise ProtocolError(f"empty chunk at token {prefix_len}")
        pos += n
    if pos != prompt_len:
        raise ProtocolError(f"chunks cover {pos} tokens but the prompt has {prompt_len}")
