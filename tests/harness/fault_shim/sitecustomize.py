"""Test-only fault injection, active in every server process (spawned schedulers included):
with ``HSDUMP_TEST_NO_PLUGINS_ON_TP_RANK=<r>``, the scheduler of TP rank r loads no plugin
(``SGLANG_PLUGINS`` names none there), as when the hsdump plugin fails to load or apply in one
scheduler: SGLang only logs that, and the rank serves without capture.

Python imports one ``sitecustomize``: this one (first on the test servers' PYTHONPATH) then runs
the next one on the path, the CPU stand-ins' (tests/harness/cpu_shim/sitecustomize.py).
"""

import functools
import importlib.machinery
import importlib.util
import os
import sys

_NO_PLUGINS_RANK = "HSDUMP_TEST_NO_PLUGINS_ON_TP_RANK"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_next_sitecustomize():
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _drop_plugins_on_one_rank(module):
    original = module.run_scheduler_process

    @functools.wraps(original)
    def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, *args, **kwargs):
        if str(tp_rank) == os.environ.get(_NO_PLUGINS_RANK):
            os.environ["SGLANG_PLUGINS"] = "no-plugin-on-this-rank"
        return original(server_args, port_args, gpu_id, tp_rank, *args, **kwargs)

    module.run_scheduler_process = run_scheduler_process


_cpu = _run_next_sitecustomize()
if os.environ.get(_NO_PLUGINS_RANK):
    if _cpu is None or not hasattr(_cpu, "PatchAfterImport"):
        raise RuntimeError(f"{_NO_PLUGINS_RANK} needs tests/harness/cpu_shim on PYTHONPATH")
    sys.meta_path.insert(0, _cpu.PatchAfterImport(
        {"sglang.srt.managers.scheduler": _drop_plugins_on_one_rank}))
