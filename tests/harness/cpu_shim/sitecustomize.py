"""Test-only CPU fix for SGLang, active in every process (spawned schedulers included).

On CPU without AMX, SGLang uses the torch_native attention backend, whose ``forward_extend``
ignores the k/v that DeepSeek's MHA prefill passes and re-reads the MLA latent pool: the
prefill is wrong for MLA models. Route torch_native to the absorbed-MLA path (the one decode
uses), which torch_native handles correctly. Active only with ``SGLANG_USE_CPU_ENGINE=1``.
"""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "sglang.srt.models.deepseek_common.attention_backend_handler"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
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
            module.AttentionBackendRegistry.register(
                "torch_native", lambda attn, fb: module._dispatch_mla_subtype(attn, fb)
            )

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _PatchAfterImport())
