"""Names of a package imported from their modules when first used (PEP 562), so that importing
the package is free and `modeltap --help` or `modeltap show` loads only the modules it needs; and
the facade's verbs that share a name with a subpackage: the package itself made callable
(`callable_package`)."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """The package's `__getattr__`: `homes` maps each name to the submodule that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def callable_package(package: str, home: str, name: str) -> None:
    """Make the package `package` callable as the function `name` of the module `home` (imported at
    the first call): a verb named like its package (`modeltap.dump(model, inputs, path)`) that is
    the package itself, so it hides none of the package's names (`modeltap.dump.DumpWriter`,
    `import modeltap.dump.writer as w`), whichever import comes first."""

    def verb() -> Callable[..., Any]:
        return getattr(importlib.import_module(home), name)

    class CallablePackage(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return verb()(*args, **kwargs)

        @property
        def __signature__(self) -> Any:  # what inspect.signature and help() show
            import inspect

            return inspect.signature(verb())

    sys.modules[package].__class__ = CallablePackage
