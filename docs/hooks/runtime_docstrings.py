"""Griffe extension: a class whose docstring is assembled at import (`__doc__ = "..." +
ENGINE_ARGS`: ZeroAdamW, ZeroLion, ZeroOptimizer share their argument list so) has none for
static analysis; take the imported class's `__doc__` instead. check_api.py puts this checkout
first on sys.path before anything is imported."""

from __future__ import annotations

import importlib
import inspect

import griffe


class RuntimeDocstrings(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs) -> None:
        if cls.docstring is not None or not cls.path.startswith("zerokern."):
            return
        try:
            value = getattr(importlib.import_module(cls.module.path), cls.name)
        except Exception:  # noqa: BLE001 - then it stays undocumented, and check_api says so
            return
        doc = getattr(value, "__doc__", None)
        if doc:   # a class's own __doc__ only (Python does not inherit it)
            cls.docstring = griffe.Docstring(inspect.cleandoc(doc), parent=cls)
