"""A stand-in for Ray where it is not installed (the GPU check of examples/grpo.py, whose image has no Ray and
cannot fetch it): veRL imports ray and its submodules at module level, for annotations, decorators and helpers that
the in-process InferenceEngine never calls. Any `ray.x.y` imports; a capitalised name is a class, any other a
function that returns what it decorates (or a no-op)."""
import importlib.abc
import importlib.machinery
import sys
import types


def _attr(module, name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name[:1].isupper():
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
    else:
        def value(*args, **kwargs):
            if len(args) == 1 and not kwargs and (callable(args[0]) or isinstance(args[0], type)):
                return args[0]  # @ray.remote
            if not args and kwargs:
                return lambda f: f  # @ray.remote(num_cpus=1)
            return None
        if name in ("is_initialized",):
            value = lambda *a, **k: False  # noqa: E731
    setattr(module, name, value)
    return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name, m=module: _attr(m, name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []  # noqa: F811 - a package, so ray.x imports go through the finder


def __getattr__(name):
    return _attr(sys.modules[__name__], name)
