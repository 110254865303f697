"""Stand-in modules for packages a peer imports but its cache code never calls.

Installed as an import hook (``sys.meta_path``) for whole package trees:

* ``RaisingModule``: every name is a function that raises when called (GPU
  kernels: ``tokenspeed_kernel``);
* ``InertModule``: every name is an inert class, subclassable, attribute
  chains work (``torchvision``: the PyPI wheel's compiled ops need a CUDA
  torch, and transformers and SGLang import it only for image processors).

A module may also get real attributes (``attributes``), e.g. the one kernel
helper a sizing path calls.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _InertClass(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _InertClass(name, (), {})


class InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _InertClass(name, (), {"__module__": self.__name__})


class RaisingModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def stand_in(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{name} is not available on CPU (a stand-in)")

        return stand_in


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str, module_class: type, attributes: dict[str, dict[str, Any]]) -> None:
        self.root, self.module_class, self.attributes = root, module_class, attributes

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = self.module_class(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        for name, value in self.attributes.get(module.__name__, {}).items():
            setattr(module, name, value)


def install(root: str, module_class: type, attributes: dict[str, dict[str, Any]] | None = None) -> None:
    """Serve ``root`` and every module below it from stand-ins (once per root)."""
    if any(isinstance(f, _Finder) and f.root == root for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(root, module_class, attributes or {}))
