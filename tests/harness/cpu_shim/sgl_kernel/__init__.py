"""Import stand-in for the CUDA-only ``sgl_kernel`` wheel, so SGLang 0.5.23 starts on CPU
(``make smoke``, ``make verify``'s CPU variant, the tests); never in the image.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang still imports a few names from ``sgl_kernel``; none is
called on the CPU torch_native path. Every attribute or submodule resolves to a stub that
raises only when called. Never put this on PYTHONPATH on a GPU machine.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.4.10"


class _Stub:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel CPU stand-in: {self._name} is not available on CPU")

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Stub(f"{self._name}.{item}")


def _module_getattr(modname: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{modname}.{name}")

    return __getattr__


__getattr__ = _module_getattr("sgl_kernel")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        if spec.name == "sgl_kernel.version":
            module.__version__ = __version__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
