"""Loading a user's own function or class from ``path/to/file.py:name`` or ``module:name``.

This is how a recipe points at a custom workflow or reward in a single file of its own.
A file is imported under a module name derived from its resolved path, so loading the
same file twice (or in each worker process) gives the same module, and the file may
import its own neighbours only through normal installed packages.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class SpecError(ValueError):
    """A ``file.py:name`` / ``module:name`` spec that cannot be loaded; says why."""


def split_spec(spec: str) -> tuple[str, str]:
    """``"a/b.py:fn"`` -> ``("a/b.py", "fn")``; raises :class:`SpecError` if malformed."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise SpecError(f"{spec!r} is not of the form 'path/to/file.py:name' or 'module:name'")
    return target, name


def is_file_spec(spec: str) -> bool:
    return split_spec(spec)[0].endswith(".py")


def load_callable(spec: str) -> Any:
    """The object named by ``spec``; it must be callable (a function or a class)."""
    target, name = split_spec(spec)
    if target.endswith(".py"):
        module = _import_file(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise SpecError(f"cannot import module {target!r} of {spec!r}: {exc}") from exc
    try:
        obj = getattr(module, name)
    except AttributeError:
        raise SpecError(f"{target!r} has no attribute {name!r}") from None
    if not callable(obj):
        raise SpecError(f"{spec!r} is a {type(obj).__name__}, not a function or class")
    return obj


def _import_file(path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise SpecError(f"file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"asyncrl_user_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot import {str(path)!r} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
