"""Capture: hook a model's modules, name what they return, and hand it to a sink.

One module per concern: `keys` (naming rules), `recorder` (events -> sink), then one per backend:
`eager` (forward hooks: `hooks`, `capture`), `compile`, `export`, `torchscript`, `fx`. Importing
this package imports no torch, and each of these modules only when one of its names is first used:
`modeltap show` needs `split_key`, not the hooks. (No name here is also a module's: importing the
module would bind it over the name.) This package is also the verb: `modeltap.capture(model, x)`
calls `eager.capture` (`_lazy.callable_package`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap._lazy import callable_package, lazy_names

if TYPE_CHECKING:
    from modeltap.capture.eager import capture, hooks, run_model
    from modeltap.capture.keys import (
        CALL_SEP,
        INPUT_PART,
        PART_SEP,
        flatten,
        make_key,
        split_key,
    )
    from modeltap.capture.recorder import Captured, MemorySink, Recorder, Sink

_HOMES = {
    **dict.fromkeys(["capture", "hooks", "run_model"], "eager"),
    **dict.fromkeys(
        ["CALL_SEP", "INPUT_PART", "PART_SEP", "flatten", "make_key", "split_key"], "keys"
    ),
    **dict.fromkeys(["Captured", "MemorySink", "Recorder", "Sink"], "recorder"),
}


__getattr__ = lazy_names(__name__, _HOMES)


# _HOMES declares the names; the imports under TYPE_CHECKING repeat them for type checkers
# (tests/test_architecture.py checks that they match).
__all__ = sorted(_HOMES)

callable_package(__name__, "modeltap.capture.eager", "capture")
