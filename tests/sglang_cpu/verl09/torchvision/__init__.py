"""Stand-in for torchvision on the verl09 lane's CPU test machine (tests/sglang_cpu/README.md): SGLang 0.5.12 imports
it at start, and PyPI's torchvision 0.28 is a CUDA build whose ops do not load on CPU torch. Any torchvision.*
module imports; any name in it is a stub that raises when called (a text model calls none)."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0"


class _Stub:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"torchvision stub: {self._name} is not available on the CPU test machine")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision.") and importlib.machinery.PathFinder.find_spec(name, path) is None:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.append(_Finder())
