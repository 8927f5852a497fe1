"""Modules that dependencies import at start-up but swarm never uses, loaded only when first used.

hivemind's package init imports its averager, whose load balancing imports `scipy.optimize` for one
function swarm does not call: a third of hivemind's import time (0.35 s of 1.7 s before a peer can
start). A placeholder stands in for such a module until something reads one of its attributes, and
then loads the real one: code that uses it works as before, a little later.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

DEFERRED = ("scipy.optimize",)


class DeferredModule(types.ModuleType):
    """Stands in for a module in `sys.modules` until one of its attributes is read."""

    # import statements read __spec__ (a lazy loader would load the module there): None passes as loaded
    __spec__ = None

    def __getattr__(self, name: str):
        if name.startswith("__"):  # tools that walk sys.modules (inspect reads every __file__) must not load it
            raise AttributeError(name)
        return getattr(self._load(), name)

    def __dir__(self) -> list[str]:
        return dir(self._load())

    def _load(self) -> types.ModuleType:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return importlib.import_module(self.__name__)


def defer_unused_imports() -> None:
    """Puts placeholders in for DEFERRED modules that are installed and not imported yet."""
    for name in DEFERRED:
        if name in sys.modules:
            continue
        parent = name.rpartition(".")[0]
        try:
            if importlib.util.find_spec(parent) is None:  # not installed: nothing imports it either
                continue
        except (ImportError, ValueError):
            continue
        sys.modules[name] = DeferredModule(name)
