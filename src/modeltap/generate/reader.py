"""Reading a generation dump: its `generate` metadata, its steps, and one step as a `Dump`."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from modeltap.dump import Dump, load_dump
from modeltap.errors import InputError
from modeltap.generate.keys import split_step, step_key

if TYPE_CHECKING:
    import torch


def generation_meta(dump: Dump) -> dict[str, Any] | None:
    """The `generate` metadata of a generation dump, None for any other file."""
    raw = dump.metadata.get("generate")
    return json.loads(raw) if raw else None


def steps_of(dump: Dump) -> list[int]:
    """The steps that have keys, in order."""
    seen = dict.fromkeys(
        parsed[0] for parsed in map(split_step, dump.order or dump.stored) if parsed
    )
    return sorted(seen)


class StepDump(Dump):
    """One step of a generation dump as an ordinary one-forward `Dump`: its keys without the
    `gen/step{k}/` prefix, its tensors read from the same memory-mapped file."""

    prefix: str = ""

    def _mapping(self) -> tuple[Any, int, dict[str, Any]] | None:
        mapping = super()._mapping()
        if mapping is None:
            return None
        buffer, start, entries = mapping
        n = len(self.prefix)
        return buffer, start, {k[n:]: v for k, v in entries.items() if k.startswith(self.prefix)}

    def __getitem__(self, key: str) -> torch.Tensor:
        target = self.resolve(key)
        if target not in self.stored:
            raise KeyError(key)
        view = self._mapped(target)
        if view is not None:
            return view
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle.get_tensor(self.prefix + target)


def step_view(dump: Dump | str | os.PathLike[str], step: int) -> StepDump:
    """Step `step` of a generation dump, readable as a one-forward dump (show, diff, compare)."""
    dump = dump if isinstance(dump, Dump) else load_dump(dump)
    gen = generation_meta(dump)
    if gen is None:
        raise InputError(f"'{dump.path}' is not a generation dump (written by `modeltap generate`)")
    steps = steps_of(dump)
    if step not in steps:
        raise InputError(
            f"'{dump.path.name}' has steps 0 to {steps[-1] if steps else -1}; no step {step}"
        )
    prefix = step_key(step, "")

    def strip(keys: Any) -> list[str]:
        return [k[len(prefix) :] for k in keys if k.startswith(prefix)]

    meta = dict(dump.metadata)
    full = step in gen.get("full_steps", [])
    meta["stats_only"] = "false" if full else "true"
    meta["order"] = json.dumps(strip(dump.order or []))
    meta["step"] = str(step)
    view = StepDump(
        dump.path,
        meta,
        strip(dump.stored),
        aliases={
            k[len(prefix) :]: v[len(prefix) :]
            for k, v in dump.aliases.items()
            if k.startswith(prefix)
        },
        order=strip(dump.order or []),
        stats={k[len(prefix) :]: v for k, v in dump.stats.items() if k.startswith(prefix)},
    )
    view.prefix = prefix
    return view
