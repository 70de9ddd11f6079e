"""Names of a package imported from their modules when first used (PEP 562), so that importing
the package is free and `modeltap --help` or `modeltap show` loads only the modules it needs; and
the facade's verbs that share a name with a subpackage (`over_package`, or the package itself made
callable: `callable_package`)."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """The package's `__getattr__`: `homes` maps each name to the submodule that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def over_package(verb: F) -> F:
    """Decorate a facade verb named like a subpackage beside it (`modeltap.record`, the function,
    and `modeltap/record/`): the package is imported before the verb is bound. The import system
    binds a package on its parent once, at the package's first import; done here, that binding
    comes first and the verb's after it, so no later import (`import modeltap.record.index`)
    puts the package back in the verb's place."""
    importlib.import_module(f"{verb.__module__}.{verb.__name__}")
    return verb


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
