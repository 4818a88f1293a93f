"""``torchft`` as another name for ``torchft_lite``, to run torchft's own tests on it.

``tests/compat/run.py`` puts the directory above this package first on
``PYTHONPATH`` for the torchft_lite run only. Importing ``torchft`` then installs
a finder that resolves every ``torchft.X`` as follows:

* torchft's Rust extension ``torchft._torchft`` and ``torchft.coordination`` are
  ``torchft_lite.coordination``;
* test code shipped inside torchft's wheel (modules named ``*_test`` or
  ``_test_utils``, and the ``torchft._test`` package) is loaded from the
  wheel's own files, so that its imports come back through this alias
  (benchmarks such as ``checkpointing.http_transport_bench`` are API torchft's
  tests call: they come from torchft_lite like any other module);
* anything else is ``torchft_lite.X``.

``torchft`` itself is the ``torchft_lite`` module. Nothing is implemented here:
a name torchft_lite lacks fails to import exactly as it does for a user
(``ModuleNotFoundError: No module named 'torchft_lite.local_sgd'``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

_RENAMED = {
    "torchft._torchft": "torchft_lite.coordination",
    "torchft.coordination": "torchft_lite.coordination",
}


def target_name(name: str) -> str:
    """The torchft_lite module that stands in for torchft module ``name``."""
    return _RENAMED.get(name, "torchft_lite" + name[len("torchft"):])


def is_wheel_test_code(name: str) -> bool:
    """Whether ``name`` is test code that ships in torchft's wheel."""
    parts = name.split(".")
    return "_test" in parts or parts[-1] == "_test_utils" or parts[-1].endswith("_test")


def _wheel_package_dir() -> str | None:
    """torchft's real package directory: the first ``torchft`` on sys.path after this one."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    search = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("torchft", search)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


class _AliasLoader(importlib.abc.Loader):
    """Hands out the already-imported target module under the torchft name."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._target_spec = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias spec on the target module; give it its own back.
        module.__spec__ = self._target_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._wheel_dir: str | None = None

    def find_spec(self, name: str, path=None, target=None):
        if not name.startswith("torchft."):
            return None
        if is_wheel_test_code(name):
            return self._find_in_wheel(name, target)
        return importlib.util.spec_from_loader(name, _AliasLoader(target_name(name)))

    def _find_in_wheel(self, name: str, target):
        if self._wheel_dir is None:
            self._wheel_dir = _wheel_package_dir()
            if self._wheel_dir is None:
                return None  # torchft is not installed: the import fails as usual
        where = [os.path.join(self._wheel_dir, *name.split(".")[1:-1])]
        # Ask the other finders (pytest's assertion rewriter, then the path finder)
        # to load the file from the wheel, as they would for torchft itself.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, where, target)
            if spec is not None:
                return spec
        return None


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())

sys.modules[__name__] = importlib.import_module("torchft_lite")
