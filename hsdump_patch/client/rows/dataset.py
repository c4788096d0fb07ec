"""Reading the input dataset: JSONL chat rows or pre-tokenized rows -> token ids + loss mask.

Accepted row shapes (one JSON object per line, blank lines ignored):

* ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}`` (OpenAI style)
* ``{"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}`` (ShareGPT style)
* ``{"id": ..., "input_ids": [...], "loss_mask": [...]}`` (pre-tokenized)

``id`` is optional (the 1-based line number is used instead). Chat rows (also with
``tool_calls``, ``tool`` messages, ``reasoning_content``, list-of-parts content, a row-level
``tools`` list and ``system``) are turned into serving-faithful samples by
:mod:`hsdump_patch.client.rows.conversation`; a row may give several samples (multi-turn policy).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hsdump_patch.client.rows.conversation import (
    ChatRenderer,
    ConversationError,
    RenderCheckDown,
    parse_conversation,
)

MAX_ID_CHARS = 200  # the id becomes a file name (percent-encoded)


class SampleError(ValueError):
    """A dataset row cannot be turned into a sample; ``where`` is ``file:line``."""

    def __init__(self, where: str, problem: str, sample_id: str | None = None) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem
        self.sample_id = sample_id


@dataclass(frozen=True)
class RowRef:
    """Where one dataset row is (its id, line number and byte offset in the file) and a digest
    of its bytes."""

    id: str
    line: int
    offset: int
    digest: str

    def key(self, render_key: str) -> str:
        """The row's resume key: its bytes under the render settings ``render_key`` (the
        manifest keeps it with the row's records; a resumed run compares it)."""
        return hashlib.blake2b(f"{render_key}:{self.digest}".encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Sample:
    """One tokenized sample, ready to be sent."""

    id: str
    where: str
    input_ids: list[int]
    loss_mask: list[int]
    # On the first sample of a chat row that ``auto`` split into per-turn samples: why.
    fallback: str | None = None
    row: RowRef | None = None  # the row it comes from
    row_samples: int = 1  # how many samples that row gives

    @property
    def digest(self) -> str:
        """A hash of the tokens and mask: a resumed run checks it to catch a changed dataset."""
        h = hashlib.sha256()
        h.update(json.dumps([self.input_ids, self.loss_mask], separators=(",", ":")).encode())
        return h.hexdigest()[:32]


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: a deterministic, disjoint subset of the sample ids."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """Parse ``i/N`` (0 <= i < N)."""
        try:
            i, n = (int(p) for p in text.split("/"))
        except ValueError:
            raise ValueError(f"--shard {text!r} is not of the form i/N, e.g. 0/4") from None
        if n < 1 or not 0 <= i < n:
            raise ValueError(f"--shard {text!r}: need 0 <= i < N")
        return cls(i, n)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def tag(self) -> str:
        """A file-name friendly form: ``shard-0-of-4``."""
        return f"shard-{self.index}-of-{self.count}"

    def contains(self, sample_id: str) -> bool:
        """Hash-based membership: stable when rows are reordered or appended."""
        if self.count == 1:
            return True
        h = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
        return int.from_bytes(h, "big") % self.count == self.index


def _row_id(obj: dict[str, Any], line: int, where: str) -> str:
    raw = obj.get("id", line)
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise SampleError(where, f'"id" must be a string or an integer, got {type(raw).__name__}')
    sample_id = str(raw)
    if not sample_id or len(sample_id) > MAX_ID_CHARS:
        raise SampleError(where, f'"id" must have 1 to {MAX_ID_CHARS} characters')
    return sample_id


def _parse_line(raw: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SampleError(
            where, f"not valid JSON ({e}); each line must be one JSON object") from None
    if not isinstance(obj, dict):
        raise SampleError(where, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def read_row(f: BinaryIO, ref: RowRef, where: str) -> dict[str, Any]:
    """The JSON object of the row ``ref`` points at in the open dataset ``f``; a
    :class:`SampleError` naming ``where`` when the line is not one."""
    f.seek(ref.offset)
    return _parse_line(f.readline(), where)


def index_dataset(path: Path) -> tuple[list[RowRef], list[SampleError]]:
    """Read every line's id; return the rows and the lines that are malformed.

    Only JSON syntax, the id and id uniqueness are checked here; the shape of each row is
    checked when it is loaded (:func:`load_samples`).
    """
    rows: list[RowRef] = []
    errors: list[SampleError] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                sample_id = _row_id(_parse_line(raw, where), line_no, where)
                if sample_id in seen:
                    raise SampleError(
                        where, f"duplicate id {sample_id!r} (first on line {seen[sample_id]}); "
                        "ids must be unique because they name the output files", sample_id)
            except SampleError as e:
                errors.append(e)
                continue
            seen[sample_id] = line_no
            rows.append(RowRef(sample_id, line_no, start,
                               hashlib.blake2b(raw.strip(), digest_size=16).hexdigest()))
    return rows, errors


def index_shard(path: Path, shard: Shard) -> tuple[list[RowRef], list[SampleError]]:
    """:func:`index_dataset`, kept to the rows (and malformed lines) of ``shard``."""
    rows, errors = index_dataset(path)
    return ([r for r in rows if shard.contains(r.id)],
            [e for e in errors if shard.contains(e.sample_id or e.where)])


def _int_list(value: Any, key: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise SampleError(where, f'"{key}" must be a list of integers')
    return value


def _pretokenized(obj: dict[str, Any], where: str) -> tuple[list[int], list[int]]:
    ids = _int_list(obj["input_ids"], "input_ids", where)
    if "loss_mask" not in obj:
        raise SampleError(where, 'a pre-tokenized row needs "loss_mask" next to "input_ids"')
    mask = _int_list(obj["loss_mask"], "loss_mask", where)
    if len(mask) != len(ids):
        raise SampleError(where, f'"loss_mask" has {len(mask)} entries but "input_ids" '
                          f"has {len(ids)}")
    if any(v not in (0, 1) for v in mask):
        raise SampleError(where, '"loss_mask" must contain only 0 and 1')
    return ids, mask


# Why ``auto`` gave per-turn samples (ChatRenderer._single's cases).
FALLBACK_REASON = ("the turns' serving prompts are not provably token prefixes of one stream "
                   "(the template rewrites or drops past turns, a boundary is not a token "
                   "boundary, a message quotes a turn marker, or a regenerated turn's ids are "
                   "not its text's own encoding, so the server serves later turns another "
                   "prompt)")


def _chat(obj: dict[str, Any], renderer: ChatRenderer | None,
          where: str) -> tuple[list[tuple[str, list[int], list[int]]], str | None]:
    """The row's (suffix, ids, mask) samples and, when ``auto`` fell back to per-turn samples,
    the reason."""
    if renderer is None:
        raise SampleError(where, "chat rows need the model's tokenizer (--model)")
    try:
        turns = renderer.render(parse_conversation(obj, renderer.parts_sep))
        fallback = FALLBACK_REASON if renderer.policy == "auto" and len(turns) > 1 else None
        return [(t.suffix, t.input_ids, t.loss_mask) for t in turns], fallback
    except ConversationError as e:
        raise SampleError(where, str(e)) from None
    except RenderCheckDown:
        raise  # the server checking the prompts went away: the run stops, the row is not bad
    except Exception as e:  # template errors come as jinja2 / ValueError / TypeError
        raise SampleError(where, f"the chat template failed on this row: {e}") from None


def load_samples(f: BinaryIO, path: Path, ref: RowRef, renderer: ChatRenderer | None,
                 max_len: int | None) -> list[Sample]:
    """Read (from the open file ``f``), validate and tokenize one row into its samples.

    A chat row gives one sample per the multi-turn policy, or several (ids ``<id>``,
    ``<id>#<message index>``). Raises :class:`SampleError` naming file and line.
    """
    where = f"{path}:{ref.line}"
    out = []
    try:
        obj = read_row(f, ref, where)
        fallback = None
        if "input_ids" in obj:
            parts = [("", *_pretokenized(obj, where))]
        elif "messages" in obj or "conversations" in obj:
            parts, fallback = _chat(obj, renderer, where)
        else:
            raise SampleError(where, 'a row needs "messages" (OpenAI style), "conversations" '
                              '(ShareGPT style) or "input_ids" + "loss_mask" (pre-tokenized)')
        for suffix, ids, mask in parts:
            if max_len is not None:
                ids, mask = ids[:max_len], mask[:max_len]
            if not ids:
                raise SampleError(where, "the sample has no tokens")
            if not any(mask):
                cut = f" within the first {max_len} tokens (--max-len)" if max_len else ""
                raise SampleError(where, f"the loss mask is all zeros{cut}: the sample has no "
                                  "assistant tokens to train on")
            out.append(Sample(ref.id + suffix, where, ids, mask, None if out else fallback, ref,
                              len(parts)))
    except SampleError as e:
        e.sample_id = ref.id
        raise
    return out


def render_key(renderer: ChatRenderer | None, max_len: int | None) -> str:
    """A digest of the settings that turn a row's bytes into samples (:meth:`RowRef.key`)."""
    settings = [renderer.fingerprint() if renderer is not None else None, max_len]
    return hashlib.blake2b(json.dumps(settings).encode(), digest_size=16).hexdigest()


def iter_samples(path: Path, refs: Sequence[RowRef], renderer: ChatRenderer | None,
                 max_len: int | None) -> Iterator[Sample | SampleError]:
    """Yield each referenced row's Samples, or the SampleError explaining why it is bad."""
    with open(path, "rb") as f:
        for ref in refs:
            try:
                yield from load_samples(f, path, ref, renderer, max_len)
            except SampleError as e:
                yield e
