"""Replay a trip: re-run, alone, the module that produced a non-finite value, from its step file.

`replay(run_dir, model, step=N, rank=R)` reads the flight record of that step's file (see
`modeltap.record.flight`), puts the recorded parameters and buffers into the model's module of
that name, restores the RNG states and the module's mode, calls it with the recorded inputs, and
says whether the non-finite values come back at the same positions: the trip reproduced offline,
in a new process, with nothing from the training run but its file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, RunError, first_line
from modeltap.record.flight import PREFIX, set_rng_states

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.dump import Dump

# Positions listed in the report; the counts cover all of them.
SHOWN = 5


@dataclass
class Replayed:
    """What re-running the producing module gave."""

    file: Path
    step: int
    rank: int
    module: str
    module_class: str
    output: str  # the recorded non-finite output key
    reproduced: bool  # the same non-finite positions (and kinds) as recorded
    recorded: dict[str, int]  # {"nan": n, "inf": n} of the recorded output
    replayed: dict[str, int]  # ... of the replayed one
    positions: list[list[int]] = field(default_factory=list)  # the first bad positions
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> statistics
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> statistics
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["file"] = str(self.file)
        return out


def _stats(t: torch.Tensor) -> dict[str, Any]:
    import torch

    x = t.detach().double() if t.is_floating_point() else t.detach().to(torch.float64)
    finite = torch.isfinite(x)
    shown = x[finite]
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "nan": int(torch.isnan(x).sum()),
        "inf": int(torch.isinf(x).sum()),
        "absmax": float(shown.abs().max()) if shown.numel() else None,
    }


def replay(
    run_dir: str | os.PathLike[str], model: nn.Module, *, step: int, rank: int = 0
) -> Replayed:
    """Re-run the module a forward trip of `step` (on `rank`) blamed, with what the run's flight
    record kept; `model` is the trained model's architecture (its weights are not used)."""
    import torch

    path, dump, flight = _flight_record(run_dir, step, rank)
    name = flight["module"]
    module, state = _module_as_recorded(model, dump, flight)
    output = _rerun(module, dump, flight)
    replayed = _part(output, flight["output"], name)
    recorded = dump[flight["output"]]
    bad_recorded = ~torch.isfinite(recorded)
    bad_replayed = ~torch.isfinite(replayed)
    same = bad_replayed.shape == bad_recorded.shape and bool(
        torch.equal(bad_replayed, bad_recorded)
        and torch.equal(torch.isnan(replayed), torch.isnan(recorded))
    )
    positions = bad_replayed.nonzero()[:SHOWN].tolist() if bad_replayed.any() else []
    inputs = {s["tensor"]: _stats(dump[s["tensor"]]) for s in flight["args"] if "tensor" in s}
    inputs |= {
        s["tensor"]: _stats(dump[s["tensor"]]) for s in flight["kwargs"].values() if "tensor" in s
    }
    params = {n: _stats(t) for n, t in state.items() if t.is_floating_point()}
    note = ""
    if not same and int(bad_replayed.sum()):
        note = "non-finite again, at other positions: the module draws from another source"
    elif not same:
        note = (
            "all finite on replay: the value came from something the flight record does not "
            "hold (non-determinism, a thread race, state outside the module)"
        )
    return Replayed(
        file=path,
        step=step,
        rank=rank,
        module=name,
        module_class=type(module).__qualname__,
        output=flight["output"],
        reproduced=same,
        recorded=_counts(recorded),
        replayed=_counts(replayed),
        positions=positions,
        inputs=inputs,
        params=params,
        note=note,
    )


def _flight_record(
    run_dir: str | os.PathLike[str], step: int, rank: int
) -> tuple[Path, Dump, dict[str, Any]]:
    """The step file of `step` on `rank`, and its flight record (refused when it has none)."""
    from modeltap.dump import load_dump
    from modeltap.record.index import read_run

    path = read_run(run_dir).step_file(step, rank)
    dump = load_dump(path)
    if "flight" not in dump.metadata:
        trip = dump.metadata.get("tripwire")
        why = (
            "its trip was in the backward; replay re-runs forward trips"
            if trip and json.loads(trip).get("phase") == "backward"
            else "record with flight=True (or on_nonfinite='dump') to keep one on a trip"
        )
        raise InputError(f"step {step} of '{run_dir}' has no flight record: {why}")
    return path, dump, json.loads(dump.metadata["flight"])


def _module_as_recorded(
    model: nn.Module, dump: Dump, flight: dict[str, Any]
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The recorded module of `model`, with the run's parameters and buffers put into it."""
    name = flight["module"]
    try:
        module = model.get_submodule("" if name == "__root__" else name)
    except AttributeError as exc:
        raise InputError(
            f"the model has no module '{name}' (the run's {flight['class']}); give the model "
            "the run trained"
        ) from exc
    cls = type(module)
    if f"{cls.__module__}.{cls.__qualname__}" != flight["class"]:
        raise InputError(
            f"'{name}' is a {cls.__qualname__} here but was a {flight['class']} in the run; "
            "give the model the run trained"
        )
    state = {n: dump[f"{PREFIX}param/{n}"] for n in flight["params"]}
    state |= {n: dump[f"{PREFIX}buffer/{n}"] for n in flight["buffers"]}
    try:
        module.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise InputError(f"the run's parameters do not fit '{name}': {first_line(exc)}") from exc
    return module, state


def _rerun(module: nn.Module, dump: Dump, flight: dict[str, Any]) -> Any:
    """`module` called with the recorded inputs, mode and RNG states (both put back after)."""
    import torch

    name = flight["module"]

    def value(spec: dict[str, Any], what: str) -> Any:
        if "tensor" in spec:
            return dump[spec["tensor"]]
        if "value" in spec:
            return spec["value"]
        raise InputError(
            f"'{name}' was called with a {spec['unsupported']} as {what}, which the flight "
            "record cannot keep; this trip cannot be replayed"
        )

    args = [value(s, f"argument {i}") for i, s in enumerate(flight["args"])]
    kwargs = {k: value(s, f"'{k}'") for k, s in flight["kwargs"].items()}
    was_training = module.training
    saved_cpu = torch.get_rng_state()
    try:
        module.train(flight["training"])
        set_rng_states({device: dump[f"{PREFIX}rng/{device}"] for device in flight["rng"]})
        with torch.no_grad():
            return module(*args, **kwargs)
    except Exception as exc:  # the user's module can fail in any way
        raise RunError(f"re-running '{name}' failed: {first_line(exc)}") from exc
    finally:
        module.train(was_training)
        torch.set_rng_state(saved_cpu)


def _counts(t: torch.Tensor) -> dict[str, int]:
    import torch

    return {"nan": int(torch.isnan(t).sum()), "inf": int(torch.isinf(t).sum())}


def _part(output: Any, key: str, module: str) -> torch.Tensor:
    """The tensor of `output` that `key` (a module output key) names."""
    import torch

    from modeltap.capture import flatten, split_key

    _, _, part = split_key(key)
    for path, value in flatten(output):
        if path == part and isinstance(value, torch.Tensor):
            return value
    raise RunError(f"'{module}' returned no '{part or 'tensor'}' on replay ({key} was recorded)")
