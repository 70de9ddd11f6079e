"""The flight record: what it takes to re-run, alone, the module that produced a non-finite value.

Written into a forward trip's step file (`on_nonfinite="dump"` or `"dump-warn"`): the module's
inputs (positional and keyword tensors, and plain values), its parameters and buffers as they were,
the RNG states at the call (so dropout draws the same mask), its class, call signature and mode.

Keys (full tensors, beside the step's own): `flight/arg/<i>`, `flight/kwarg/<name>`,
`flight/param/<name>`, `flight/buffer/<name>`, `flight/rng/<device>`. Metadata `flight` (JSON):
module, call, class, signature, training, args and kwargs (each {"tensor": key}, {"value": v}
for None/bool/int/float/str, or {"unsupported": type name}), params, buffers, rng, and the
output key that was non-finite.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.dump import DumpWriter
    from modeltap.record.tripwire import Call

PREFIX = "flight/"
_PLAIN = (type(None), bool, int, float, str)


def rng_states(module: nn.Module) -> dict[str, torch.Tensor]:
    """The generator states a call of `module` draws from: the CPU's, and its CUDA device's."""
    import torch

    states = {"cpu": torch.get_rng_state()}
    device = next((p.device for p in module.parameters()), None)
    if device is not None and device.type == "cuda":
        states[str(device)] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Put back what `rng_states` kept (a CUDA device's state only where CUDA is: a record
    replayed on a CPU-only machine)."""
    import torch

    for device, state in states.items():
        if device == "cpu":
            torch.set_rng_state(state)
        elif torch.cuda.is_available():
            torch.cuda.set_rng_state(state, device)


def write(
    writer: DumpWriter, call: Call, rng: dict[str, torch.Tensor] | None, bad_key: str
) -> dict[str, Any]:
    """Write the flight record of `call` through `writer`; returns its metadata entry."""
    import torch

    def spec(value: Any, key: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            writer.tensor(key, value.detach())
            return {"tensor": key}
        if isinstance(value, _PLAIN):
            return {"value": value}
        return {"unsupported": type(value).__name__}

    module = call.module
    args = [spec(a, f"{PREFIX}arg/{i}") for i, a in enumerate(call.args)]
    kwargs = {k: spec(v, f"{PREFIX}kwarg/{k}") for k, v in call.kwargs.items()}
    params = []
    for name, p in module.named_parameters(recurse=True):
        writer.tensor(f"{PREFIX}param/{name}", p.detach())
        params.append(name)
    buffers = []
    for name, b in module.named_buffers(recurse=True):
        writer.tensor(f"{PREFIX}buffer/{name}", b.detach())
        buffers.append(name)
    for device, state in (rng or {}).items():
        writer.tensor(f"{PREFIX}rng/{device}", state)
    try:
        signature = str(inspect.signature(module.forward))
    except (TypeError, ValueError):
        signature = "(...)"
    cls = type(module)
    return {
        "module": call.name,
        "call": call.call,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "signature": signature,
        "training": module.training,
        "args": args,
        "kwargs": kwargs,
        "params": params,
        "buffers": buffers,
        "rng": sorted(rng or {}),
        "output": bad_key,
    }
