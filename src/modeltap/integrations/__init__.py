"""Recording inside training frameworks: one module per framework, each importing its framework
only when used.

    from modeltap.integrations import ModeltapCallback            # transformers.Trainer
    from modeltap.integrations.lightning import ModeltapCallback  # Lightning

Accelerate needs none: `with modeltap.record(model, ...)` around its loop (see
docs/guides/nan-in-training.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modeltap.integrations.transformers import ModeltapCallback


def __getattr__(name: str) -> Any:
    if name == "ModeltapCallback":
        from modeltap.integrations.transformers import ModeltapCallback

        return ModeltapCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ModeltapCallback"]
