"""Start-up guards: server configurations under which dumps would be silently wrong or empty.

They decide on what SGLang *resolved*, not on the flags as typed: resolution gives
``--cuda-graph-config`` and ``--cuda-graph-backend-prefill`` precedence over the deprecated
``--disable-cuda-graph``, and changes settings of its own (``--dwdp-size`` turns on attention
DP). The launcher checks the resolved ``ServerArgs`` right after ``resolve_once`` (fast
feedback, before anything is spawned); each scheduler checks again at install time, on the
published config and on its model runner (the prefill graph runner it actually built), and
that check is authoritative. Each message names the flag to change.

``problems_for_server_args`` and ``problems_for_runner`` return the messages without raising,
for tools that report them (``hsdump verify``); ``problems_for_cli_args`` is the earliest
check, on parsed ``launch_server`` arguments (``hsdump serve``).
"""

from __future__ import annotations

from typing import Any

DISABLE_GRAPHS_FLAGS = "--cuda-graph-backend-prefill disabled --cuda-graph-backend-decode disabled"


class UnsupportedServerConfig(RuntimeError):
    """The server is configured in a way the capture patch cannot dump correctly."""


def _prefill_graph_problem(cfg: Any) -> str | None:
    backend = str(cfg.cuda_graph_config.prefill.backend)
    if backend == "disabled":
        return None
    raw = cfg.cuda_graph_config_raw
    fix = "Pass --cuda-graph-backend-prefill disabled"
    if isinstance(raw, dict) and (raw.get("prefill") or {}).get("backend") is not None:
        cause = f"--cuda-graph-config sets the prefill backend {backend!r}"
        fix = "Remove the prefill backend from --cuda-graph-config"
    elif cfg.cuda_graph_backend_prefill is not None:
        cause = f"--cuda-graph-backend-prefill {backend}"
    else:
        cause = f"the default on this device: {backend!r}"
    if cfg.disable_cuda_graph:
        fix += (". --disable-cuda-graph does not turn them off: --cuda-graph-config and the "
                "per-phase flags take precedence over it (and it is deprecated)")
    return (f"prefill CUDA graphs are on ({cause}): graph replays never run the capture hooks, "
            f"so dumps would be empty. {fix}. The extraction profile is "
            f"{DISABLE_GRAPHS_FLAGS}.")


def find_problems(cfg: Any, dump_final: bool = False) -> list[str]:
    """One message per unsupported setting of ``cfg``, a resolved config: attribute reads
    return what SGLang resolved (see :class:`_Resolved`), with the post-norm final state
    dumped or not (``dump_final``). Empty if the dump can run."""
    problems = []
    graph = _prefill_graph_problem(cfg)
    if graph:
        problems.append(graph)
    if not cfg.disable_radix_cache:
        problems.append(
            "the radix cache is on: a cached prefix is never recomputed, so its tokens would "
            "have no hidden states. Pass --disable-radix-cache."
        )
    if cfg.enable_two_batch_overlap:
        problems.append(
            "two-batch overlap runs the layers through a path that bypasses the capture "
            "points. Remove --enable-two-batch-overlap."
        )
    if (cfg.pp_size or 1) > 1:
        problems.append(
            f"pipeline parallel size is {cfg.pp_size}: capture across pipeline "
            "stages is not supported. Use --pp-size 1 (tensor parallel only)."
        )
    if (cfg.attn_dp_size or 1) > 1 or cfg.enable_dp_attention:
        dwdp = (cfg.dwdp_size or 1) > 1
        cause = f" (--dwdp-size {cfg.dwdp_size} turns it on)" if dwdp else ""
        flags = "--dwdp-size" if dwdp else "--attn-dp-size / --enable-dp-attention"
        problems.append(
            f"DP attention is on{cause}: each attention-DP group holds different requests "
            f"and rows. Remove {flags} (plain --dp-size replicas on one node are fine)."
        )
    if cfg.enable_prefill_cp or (cfg.attn_cp_size or 1) > 1:
        problems.append(
            "prefill context parallel shards each prompt across ranks. Remove "
            "--enable-prefill-cp / --attn-cp-size."
        )
    if cfg.enable_attn_tp_input_scattered or cfg.enable_layernorm_sp:
        problems.append(
            "the residual stream is sharded across TP ranks. Remove "
            "--enable-attn-tp-input-scattered / --enable-layernorm-sp."
        )
    if cfg.enable_pdmux:
        problems.append(
            "PD-multiplexing runs prefill as split-prefill forwards, which are never dumped. "
            "Remove --enable-pdmux."
        )
    if str(cfg.disaggregation_mode) == "decode":
        problems.append(
            "--disaggregation-mode decode: this server only decodes; every prompt is "
            "prefilled (and so dumped) on the prefill server, so the client would wait for "
            "dumps that never come. Set SGLANG_HS_DUMP_DIR on the prefill server "
            "(--disaggregation-mode prefill) or on a server without disaggregation."
        )
    if (cfg.nnodes or 1) > 1 and (cfg.dp_size or 1) > 1:
        problems.append(
            f"--dp-size {cfg.dp_size} across --nnodes {cfg.nnodes}: the replicas on the other "
            "nodes write to their own node's dump dir, which the client never reads. Use "
            "--dp-size 1 with several nodes (or one server per node)."
        )
    a2a = str(cfg.moe_a2a_backend or "none")
    if dump_final and a2a != "none":
        problems.append(
            f"--moe-a2a-backend {a2a} with the final state dumped: an all-to-all MoE backend "
            "lets SGLang leave the last layer's output scattered across ranks before the final "
            "norm, so the final rows captured on rank 0 are not proven whole. Set "
            "SGLANG_HS_DUMP_FINAL=0 (layers only) or serve with --moe-a2a-backend none."
        )
    return problems


class _Resolved:
    """Attribute reads of a config: the published one of this process where there is one
    (it includes runtime overrides), else what resolution declared over ``server_args``."""

    def __init__(self, server_args: Any, *, published: bool) -> None:
        from sglang.srt.arg_groups.overrides import resolved_view

        self._view = resolved_view(server_args)
        self._raw_graph = getattr(server_args, "cuda_graph_config", None)
        self._context = None
        if published:
            from sglang.srt.runtime_context import get_context

            self._context = get_context()

    @property
    def cuda_graph_config_raw(self) -> Any:
        """``--cuda-graph-config`` as given (JSON string or dict), to name it in messages."""
        raw = self._raw_graph
        if isinstance(raw, str):
            import json

            try:
                return json.loads(raw)
            except ValueError:
                return None
        return raw if isinstance(raw, dict) else None

    def __getattr__(self, name: str) -> Any:
        if self._context is not None:
            try:
                return self._context.config_leaf(name)
            except (ValueError, AttributeError):
                pass  # not a published leaf: what resolution declared
        return getattr(self._view, name)


def problems_for_cli_args(namespace: Any) -> list[str]:
    """Messages for parsed ``launch_server`` arguments (an ``argparse.Namespace``) before
    SGLang resolves them: the CUDA-graph settings go through SGLang's own precedence
    (``parse_cuda_graph_config``); the rest are checked as given."""
    import copy

    from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config

    args = copy.copy(namespace)
    parse_cuda_graph_config(args)  # declares the resolved config on the copy
    return find_problems(_Resolved(args, published=False))


def problems_for_server_args(server_args: Any, dump_final: bool = False) -> list[str]:
    """Messages for a ``ServerArgs`` on which ``resolve_once()`` has run."""
    return find_problems(_Resolved(server_args, published=False), dump_final)


def problems_for_runner(runner: Any, dump_final: bool = False) -> list[str]:
    """Messages for a scheduler's target ``ModelRunner`` after graph capture: the published
    config, and the prefill graph runner the model runner actually built."""
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    problems = find_problems(_Resolved(runner.server_args, published=True), dump_final)
    graph_runner = getattr(runner, "prefill_cuda_graph_runner", None)
    # The same test as ModelRunner._forward_raw's before it replays a prefill graph.
    if graph_runner is not None and not isinstance(graph_runner, EagerRunner):
        message = (f"the model runner replays prefill from a {type(graph_runner).__name__}: "
                   "the capture hooks would never run. Pass --cuda-graph-backend-prefill "
                   f"disabled (the profile: {DISABLE_GRAPHS_FLAGS}).")
        if not any(p.startswith("prefill CUDA graphs are on") for p in problems):
            problems.insert(0, message)
    return problems


def raise_if(problems: list[str]) -> None:
    """Raise :class:`UnsupportedServerConfig` listing every problem, if there is one."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise UnsupportedServerConfig(
            "hsdump: SGLANG_HS_DUMP_DIR is set, but this server configuration cannot be "
            f"dumped correctly:\n{lines}\n(Unset SGLANG_HS_DUMP_DIR to serve without dumping.)"
        )
