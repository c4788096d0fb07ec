"""CPU stand-ins for SGLang 0.5.23, active in every process (spawned schedulers included) that has
this directory on PYTHONPATH and ``SGLANG_USE_CPU_ENGINE=1``.

On CPU without AMX, SGLang uses the torch_native attention backend, whose ``forward_extend``
ignores the k/v that DeepSeek's MHA prefill passes and re-reads the MLA latent pool: the prefill
is wrong for MLA models. Route torch_native to the absorbed-MLA path (the one decode uses),
which torch_native handles correctly.

FlashInfer (a CUDA-only library SGLang installs) is not importable here: SGLang imports it
only where it may be absent (``try: import flashinfer``, ``is_flashinfer_available()``, which is
false without CUDA), and importing it costs 3-4 s of CPU in each of a server's processes.

Start-up cost, which the suite pays for each of its ~30 servers (each 3+ processes that import
SGLang whole, 12-20 s of CPU apiece on the 2-core CI machine):
- ``ml_dtypes`` is left out too: only ``tvm_ffi`` imports it on this path, inside ``try``, for
  numpy names of bf16/fp8 dtypes (~1-1.5 s of CPU per process).
- The collector's oldest generation is swept 100x less often: the import builds ~10^6
  long-lived objects, and each full sweep walks them all (~10-20% of the import).

One OpenMP thread per process (unless ``OMP_NUM_THREADS`` says otherwise): a CPU test server runs
beside other work on the 2-core CI machine (the other lanes, a TP 2 server's other rank), where
a 2-thread pool waits at every parallel region for its preempted second thread, spinning. The
Kimi chat-faithful test beside a one-core busy loop (2026-12-03): 382 s of wall and 379 s of CPU
with torch's default 2 threads, 125 s and 123 s with one. On an idle machine a TP 1 prefill is
about half as fast with one thread (``hsdump verify``'s CPU variant: 199 -> 103 tokens/s).

``torch.compile`` stays on, although SGLang's compiled MoE top-k and rotary helpers cost a cold
DeepSeek or Kimi server 30-40 s of gcc before its warm-up answers (the servers of one test run
share an inductor cache, ``cpu_env``): run eagerly in bfloat16 they round at every step, and
the tiny DeepSeek's records moved from HF fp32 past the suite's bound (0.0201 > 0.02, 2026-12-03).
The float32 Kimi server turns it off for itself (``TORCHDYNAMO_DISABLE``, tests/server/conftest.py):
in float32 eager and compiled agree far within the bounds (ready in 34 s instead of 61).
"""

import gc
import importlib.abc
import importlib.machinery
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


class Absent(importlib.abc.Loader):
    """Loader that fails the import, as for a package that is not installed."""

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (CPU test server: the CUDA-only "
                                  f"{spec.name.partition('.')[0]} is left out)", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("unreachable: create_module raised")


class LeaveOut(importlib.abc.MetaPathFinder):
    """Make the packages ``names`` (and their submodules) fail to import."""

    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, Absent())
        return None


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch loads its OpenMP runtime
    gc.set_threshold(700, 10, 1000)  # Python's default: (700, 10, 10)
    sys.meta_path.insert(0, LeaveOut({"flashinfer", "ml_dtypes"}))
    sys.meta_path.insert(0, PatchAfterImport({
        "sglang.srt.models.deepseek_common.attention_backend_handler":
            _route_torch_native_to_absorbed_mla}))
