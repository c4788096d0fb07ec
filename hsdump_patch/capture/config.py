"""Configuration of the capture patch, read from environment variables once at start-up.

Every bad value raises :class:`ConfigError` naming the variable and the fix; the patch turns
that into a start-up failure of the server (never a silent no-op, never a hang).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hsdump_patch.protocol import (
    DEFAULT_RID_PREFIX,
    ENV_DIR,
    ENV_DRAFT_CONFIG,
    ENV_FINAL,
    ENV_LAYERS,
    ENV_MAX_INFLIGHT,
    ENV_MIN_FREE,
    ENV_RID_PREFIX,
    ENV_WRITER_THREADS,
    ConfigError,
    parse_size,
)

DEFAULT_MAX_INFLIGHT = 4 << 30
DEFAULT_MIN_FREE = 1 << 30
DEFAULT_WRITER_THREADS = 8
# Where chunk files are written: "process" (a writer process, off the forward's GIL: measured
# best on the H200, docs/PERFORMANCE.md) or "thread" (threads of the server's process).
ENV_WRITER_MODE = "SGLANG_HS_DUMP_WRITER"
WRITER_MODES = ("process", "thread")
DEFAULT_WRITER_MODE = "process"
# The longest the forward's thread waits for the writer (staging pages) before it fails the
# chunk's request and marks the writer stalled: far below SGLang's watchdog (300 s).
ENV_STALL_S = "SGLANG_HS_DUMP_STALL_S"
DEFAULT_STALL_S = 5.0
MAX_STALL_S = 60.0

_RID_PREFIX_RE = re.compile(r"^[A-Za-z0-9._:-]+$")


def parse_layers(text: str) -> tuple[int, ...] | None:
    """Parse ``SGLANG_HS_DUMP_LAYERS``: ``auto`` (None) or comma/space separated indices."""
    if text.strip().lower() in ("", "auto"):
        return None
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    try:
        layers = tuple(int(p) for p in parts)
    except ValueError:
        raise ConfigError(
            f"{ENV_LAYERS}={text!r} is not a list of layer indices: use 'auto' or integers "
            "separated by commas, e.g. 3,31,59 (index i = residual stream at the input of "
            "decoder layer i = HF output_hidden_states[i])"
        ) from None
    if any(i < 0 for i in layers):
        raise ConfigError(f"{ENV_LAYERS}={text!r}: layer indices must be >= 0")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{ENV_LAYERS}={text!r}: layer indices must be unique")
    return layers


def _parse_bool(text: str, var: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{var}={text!r} is not a boolean: use 1 or 0")


def read_draft_layer_ids(path: Path) -> list[int]:
    """Return ``eagle_aux_hidden_state_layer_ids`` from a drafter's config.json."""
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{ENV_DRAFT_CONFIG}={path}: file not found") from None
    except ValueError as e:
        raise ConfigError(f"{ENV_DRAFT_CONFIG}={path}: not valid JSON ({e})") from None
    for holder in (cfg.get("eagle_config") or {}, cfg):
        ids = holder.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
                raise ConfigError(
                    f"{ENV_DRAFT_CONFIG}={path}: eagle_aux_hidden_state_layer_ids must be a "
                    f"non-empty list of integers, got {ids!r}"
                )
            return ids
    raise ConfigError(
        f"{ENV_DRAFT_CONFIG}={path}: no eagle_aux_hidden_state_layer_ids in the file (looked at "
        "the top level and under eagle_config); point it at the drafter's config.json or set "
        f"{ENV_LAYERS} explicitly"
    )


@dataclass(frozen=True)
class DumpConfig:
    """The validated dump configuration."""

    dump_dir: Path
    layers: tuple[int, ...] | None  # capture indices; None = auto (EAGLE-3 serving layers)
    draft_layer_ids: tuple[int, ...] | None  # from the drafter config, for 'auto'
    draft_config: Path | None
    rid_prefix: str
    dump_final: bool
    max_inflight_bytes: int
    min_free_bytes: int
    writer_threads: int
    writer_mode: str = DEFAULT_WRITER_MODE
    stall_s: float = DEFAULT_STALL_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DumpConfig | None:
        """Return the configuration, or None when ``SGLANG_HS_DUMP_DIR`` is unset (dump off)."""
        env = os.environ if environ is None else environ
        raw_dir = env.get(ENV_DIR, "").strip()
        if not raw_dir:
            return None
        dump_dir = Path(raw_dir)
        if not dump_dir.is_absolute():
            raise ConfigError(
                f"{ENV_DIR}={raw_dir!r} must be an absolute path, e.g. /dev/shm/sglang_hs"
            )

        layers = parse_layers(env.get(ENV_LAYERS, "auto"))
        draft_config = None
        draft_ids = None
        if env.get(ENV_DRAFT_CONFIG, "").strip():
            draft_config = Path(env[ENV_DRAFT_CONFIG].strip())
            if layers is not None:
                raise ConfigError(
                    f"{ENV_LAYERS}={env[ENV_LAYERS]!r} and {ENV_DRAFT_CONFIG} are both set: "
                    f"set {ENV_LAYERS}=auto to take the layers from the drafter config, or unset "
                    f"{ENV_DRAFT_CONFIG}"
                )
            draft_ids = tuple(read_draft_layer_ids(draft_config))

        prefix = env.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX)
        if not _RID_PREFIX_RE.match(prefix):
            raise ConfigError(
                f"{ENV_RID_PREFIX}={prefix!r} must be non-empty and use only letters, digits "
                "and . _ : - (it selects which requests are dumped)"
            )
        max_inflight = parse_size(
            env.get(ENV_MAX_INFLIGHT, str(DEFAULT_MAX_INFLIGHT)), ENV_MAX_INFLIGHT
        )
        if max_inflight <= 0:
            raise ConfigError(f"{ENV_MAX_INFLIGHT} must be > 0")
        min_free = parse_size(env.get(ENV_MIN_FREE, str(DEFAULT_MIN_FREE)), ENV_MIN_FREE)
        threads_raw = env.get(ENV_WRITER_THREADS, str(DEFAULT_WRITER_THREADS))
        if not threads_raw.strip().isdigit() or not 1 <= int(threads_raw) <= 64:
            raise ConfigError(f"{ENV_WRITER_THREADS}={threads_raw!r} must be an integer in 1..64")
        mode = env.get(ENV_WRITER_MODE, DEFAULT_WRITER_MODE).strip().lower()
        if mode not in WRITER_MODES:
            raise ConfigError(
                f"{ENV_WRITER_MODE}={env[ENV_WRITER_MODE]!r} must be one of "
                f"{', '.join(WRITER_MODES)} (default {DEFAULT_WRITER_MODE}: a writer process, "
                "off the forward's GIL)")
        stall_raw = env.get(ENV_STALL_S, str(DEFAULT_STALL_S))
        try:
            stall_s = float(stall_raw)
        except ValueError:
            stall_s = -1.0
        if not 0 < stall_s <= MAX_STALL_S:
            raise ConfigError(
                f"{ENV_STALL_S}={stall_raw!r} must be a number of seconds in (0, {MAX_STALL_S:g}] "
                f"(default {DEFAULT_STALL_S:g}): the longest a forward waits for a stalled "
                "writer, far below SGLang's watchdog")
        return cls(
            dump_dir=dump_dir,
            layers=layers,
            draft_layer_ids=draft_ids,
            draft_config=draft_config,
            rid_prefix=prefix,
            dump_final=_parse_bool(env.get(ENV_FINAL, "1"), ENV_FINAL),
            max_inflight_bytes=max_inflight,
            min_free_bytes=min_free,
            writer_threads=int(threads_raw),
            writer_mode=mode,
            stall_s=stall_s,
        )
