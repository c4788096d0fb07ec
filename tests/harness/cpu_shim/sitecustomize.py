"""Test-only additions to SGLang, active in every process (spawned schedulers included).

1. CPU fix. On CPU without AMX, SGLang uses the torch_native attention backend, whose
   ``forward_extend`` ignores the k/v that DeepSeek's MHA prefill passes and re-reads the MLA
   latent pool: the prefill is wrong for MLA models. Route torch_native to the absorbed-MLA path
   (the one decode uses), which torch_native handles correctly. Active only with
   ``SGLANG_USE_CPU_ENGINE=1``.
2. Fault injection. With ``HSDUMP_TEST_NO_PLUGINS_ON_TP_RANK=<r>``, the scheduler of TP rank r
   loads no plugin (``SGLANG_PLUGINS`` names none there), as when the hsdump plugin fails to
   load or apply in one scheduler: SGLang only logs that, and the rank serves without capture.
"""

import functools
import importlib.abc
import importlib.util
import os
import sys

_NO_PLUGINS_RANK = "HSDUMP_TEST_NO_PLUGINS_ON_TP_RANK"


def _route_torch_native_to_absorbed_mla(module):
    module.AttentionBackendRegistry.register(
        "torch_native", lambda attn, fb: module._dispatch_mla_subtype(attn, fb)
    )


def _drop_plugins_on_one_rank(module):
    original = module.run_scheduler_process

    @functools.wraps(original)
    def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, *args, **kwargs):
        if str(tp_rank) == os.environ.get(_NO_PLUGINS_RANK):
            os.environ["SGLANG_PLUGINS"] = "no-plugin-on-this-rank"
        return original(server_args, port_args, gpu_id, tp_rank, *args, **kwargs)

    module.run_scheduler_process = run_scheduler_process


_PATCHES = {}
if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    _PATCHES["sglang.srt.models.deepseek_common.attention_backend_handler"] = (
        _route_torch_native_to_absorbed_mla)
if os.environ.get(_NO_PLUGINS_RANK):
    _PATCHES["sglang.srt.managers.scheduler"] = _drop_plugins_on_one_rank


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _PATCHES:
    sys.meta_path.insert(0, _PatchAfterImport())
