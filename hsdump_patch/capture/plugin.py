"""SGLang plugin entry point (group ``sglang.srt.plugins``): registration only.

``register()`` runs in every SGLang process. With ``SGLANG_HS_DUMP_DIR`` unset it does nothing
at all. Otherwise it registers three hooks with SGLang's ``HookRegistry``:

* after ``ServerArgs.resolve_once`` (the launcher, before anything is spawned): validate the
  environment and refuse unsupported resolved settings, so a bad configuration fails in
  seconds;
* after ``ModelRunner.init_cuda_graphs`` (each scheduler, after graph capture, every TP rank):
  check again on what the scheduler actually runs (authoritative), then install the capture on
  the target model runner (never on a draft runner);
* after ``ForwardBatch.init_new``: note the prompt length of each dumped request prefilled
  in an extend forward, so the writer knows which chunk completes it, and which rows are
  decode tails (CPU-side, no device sync).

SGLang only logs an exception raised by ``register()`` itself, so errors are raised from the
hooks, where they stop the server at start-up with the message.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hsdump_patch.capture.model_adapter import HOOK_TARGETS
from hsdump_patch.protocol import ENV_DIR

logger = logging.getLogger("hsdump")

_PLACEHOLDER_MODELS = ("dummy", "none")
_registered = False
_session: Any = None  # the CaptureSession of this process's target model runner


def register() -> None:
    """Register the hooks when ``SGLANG_HS_DUMP_DIR`` is set (re-entrant)."""
    global _registered
    if _registered or not os.environ.get(ENV_DIR, "").strip():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGETS[0], _validate_after_resolution, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS[1], _install_after_graphs, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS[2], _note_prompt_lengths, HookType.AFTER)
    _registered = True


def _validate_after_resolution(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    if str(getattr(server_args, "model_path", "")).lower() in _PLACEHOLDER_MODELS:
        return  # SGLang builds placeholder ServerArgs internally; not a server launch
    from hsdump_patch.capture import guards
    from hsdump_patch.capture.config import DumpConfig

    config = DumpConfig.from_env()
    guards.raise_if(guards.problems_for_server_args(server_args, config.dump_final))


def _install_after_graphs(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    global _session
    if getattr(runner, "is_draft_worker", False):
        return
    from hsdump_patch.capture import guards
    from hsdump_patch.capture.config import DumpConfig
    from hsdump_patch.capture.session import CaptureSession

    config = DumpConfig.from_env()
    guards.raise_if(guards.problems_for_runner(runner, config.dump_final))
    _session = CaptureSession(config, runner)


def _note_prompt_lengths(result: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    if _session is None or batch is None:
        return
    try:
        _session.record_prompt_lengths(batch, result)
    except Exception:
        logger.exception("hsdump: could not record prompt lengths; the server keeps serving")
