"""Capture: hook a model's modules, name what they return, and hand it to a sink.

One module per concern: `keys` (naming rules), `recorder` (events -> sink), `hooks` (the eager
backend). Importing this package imports no torch.
"""

from __future__ import annotations

from modeltap.capture.hooks import capture, hooks, run_model
from modeltap.capture.keys import CALL_SEP, INPUT_PART, PART_SEP, flatten, make_key, split_key
from modeltap.capture.recorder import Captured, MemorySink, Recorder, Sink

__all__ = [
    "CALL_SEP",
    "INPUT_PART",
    "PART_SEP",
    "Captured",
    "MemorySink",
    "Recorder",
    "Sink",
    "capture",
    "flatten",
    "hooks",
    "make_key",
    "run_model",
    "split_key",
]
