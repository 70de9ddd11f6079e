"""Key naming rules shared by every capture backend.

Keys: `module` for a module whose output is one tensor; `module:part` for a part of a structured
output (tuple index, dict or ModelOutput field, joined by dots); `module@N` for the N-th extra call
of a module called more than once in one forward (the first call has no suffix); `module:in.X`
for inputs; `module/opNN.name` (`module@N/opNN.name` in an extra call) for the NN-th op a
selected module's own code called (`dump --ops`, capture/ops.py; in an exported program or FX
graph the NN-th op node in the module's scope, capture/graph_ops.py), `:part` after it as above.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

PART_SEP = ":"
CALL_SEP = "@"
INPUT_PART = "in"
OP_SEP = "/"
_OP_PART = re.compile(r"op\d{2,}\.")


def make_key(module: str, call: int = 0, part: str = "") -> str:
    key = module if call == 0 else f"{module}{CALL_SEP}{call}"
    return f"{key}{PART_SEP}{part}" if part else key


def split_key(key: str) -> tuple[str, int, str]:
    """(module, call, part) of a key written by make_key."""
    head, _, part = key.partition(PART_SEP)
    module, sep, call = head.rpartition(CALL_SEP)
    if sep and call.isdigit():
        return module, int(call), part
    return head, 0, part


def op_owner(key: str) -> str | None:
    """The module key (`m`, `m@1`) of an op's key (`m/op07.softmax`), None for any other key."""
    owner, sep, op = key.partition(PART_SEP)[0].rpartition(OP_SEP)
    return owner if sep and owner and _OP_PART.match(op) else None


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples, lists, dicts, ModelOutputs and dataclasses."""
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):  # also ModelOutput, which holds only its non-None fields
        for name, item in value.items():
            yield from flatten(item, _join(prefix, str(name)))
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from flatten(item, _join(prefix, str(index)))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from flatten(getattr(value, f.name), _join(prefix, f.name))
    else:
        yield prefix, value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
