"""CPU fix for SGLang 0.5.23, active in every process (spawned schedulers included) that has
this directory on PYTHONPATH and ``SGLANG_USE_CPU_ENGINE=1``.

On CPU without AMX, SGLang uses the torch_native attention backend, whose ``forward_extend``
ignores the k/v that DeepSeek's MHA prefill passes and re-reads the MLA latent pool: the prefill
is wrong for MLA models. Route torch_native to the absorbed-MLA path (the one decode uses),
which torch_native handles correctly.
"""

import importlib.abc
import importlib.util
import os
import sys


def _route_torch_native_to_absorbed_mla(module):
    module.AttentionBackendRegistry.register(
        "torch_native", lambda attn, fb: module._dispatch_mla_subtype(attn, fb)
    )


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Run ``patches[name](module)`` right after module ``name`` is first imported."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
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


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, PatchAfterImport({
        "sglang.srt.models.deepseek_common.attention_backend_handler":
            _route_torch_native_to_absorbed_mla}))
