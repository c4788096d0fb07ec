"""Start-up guards: server configurations under which dumps would be silently wrong or empty.

Each guard names the flag to change. They read the server arguments as the user declared
them, so they run in the launcher before anything is spawned, and again in each scheduler.
"""

from __future__ import annotations

from typing import Any


class UnsupportedServerConfig(RuntimeError):
    """The server is configured in a way the capture patch cannot dump correctly."""


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def prefill_graphs_disabled(args: Any) -> bool:
    """True when the prefill phase runs eagerly (Python hooks fire on every prefill)."""
    return bool(
        _get(args, "disable_cuda_graph")
        or _get(args, "disable_prefill_cuda_graph")
        or _get(args, "cuda_graph_backend_prefill") == "disabled"
    )


def find_problems(args: Any) -> list[str]:
    """Return one message per unsupported setting in ``args`` (a ServerArgs), empty if fine."""
    problems = []
    if not prefill_graphs_disabled(args):
        problems.append(
            "prefill CUDA graphs are on (the 0.5.23 default): graph replays never run the "
            "capture hooks, so dumps would be empty. Pass --disable-cuda-graph (or "
            "--cuda-graph-backend-prefill disabled)."
        )
    if not _get(args, "disable_radix_cache"):
        problems.append(
            "the radix cache is on: a cached prefix is never recomputed, so its tokens would "
            "have no hidden states. Pass --disable-radix-cache."
        )
    if _get(args, "enable_two_batch_overlap"):
        problems.append(
            "two-batch overlap runs the layers through a path that bypasses the capture "
            "points. Remove --enable-two-batch-overlap."
        )
    if (_get(args, "pp_size") or 1) > 1:
        problems.append(
            f"pipeline parallel size is {_get(args, 'pp_size')}: capture across pipeline "
            "stages is not supported. Use --pp-size 1 (tensor parallel only)."
        )
    if (_get(args, "attn_dp_size") or 1) > 1 or _get(args, "enable_dp_attention"):
        problems.append(
            "DP attention is on: each attention-DP group holds different requests and rows. "
            "Remove --attn-dp-size / --enable-dp-attention (plain --dp-size replicas are fine)."
        )
    if _get(args, "enable_prefill_cp") or (_get(args, "attn_cp_size") or 1) > 1:
        problems.append(
            "prefill context parallel shards each prompt across ranks. Remove "
            "--enable-prefill-cp / --attn-cp-size."
        )
    if _get(args, "enable_attn_tp_input_scattered") or _get(args, "enable_layernorm_sp"):
        problems.append(
            "the residual stream is sharded across TP ranks. Remove "
            "--enable-attn-tp-input-scattered / --enable-layernorm-sp."
        )
    return problems


def check(args: Any) -> None:
    """Raise :class:`UnsupportedServerConfig` listing every unsupported setting in ``args``."""
    problems = find_problems(args)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise UnsupportedServerConfig(
            "hsdump: SGLANG_HS_DUMP_DIR is set, but this server configuration cannot be "
            f"dumped correctly:\n{lines}\n(Unset SGLANG_HS_DUMP_DIR to serve without dumping.)"
        )
