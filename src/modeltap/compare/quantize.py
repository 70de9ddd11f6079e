"""Quantized variants of `compare`: every `nn.Linear`'s weight quantized then dequantized (and,
for the fp8 / MX / NV variants, its input activations too) with the recipes of `stats.formats`;
transformers' Conv1D (GPT-2's Linears) counts as one.

The weights are quantized once, in a copy that shares every other tensor with the reference, so
the replay calls each candidate Linear as it is and measures the error it introduces. Which
Linears stay in the reference's precision can be changed afterwards (`Quantized.keep`), which is
what `--bisect` does between its runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn

# --against NAME -> (the weights' format, the input activations' format or None)
RECIPES: dict[str, tuple[str, str | None]] = {
    "fp8": ("fp8_e4m3", "fp8_e4m3"),
    "mxfp8": ("mxfp8", "mxfp8"),
    "nvfp4": ("nvfp4", "nvfp4"),
    "int8-weight": ("int8", None),
    "int4-weight": ("int4", None),
}
# How the formats ran: modeltap's own quantize-dequantize (stats.formats), not torchao's kernels.
ENGINE = "emulated"

_STATES: weakref.WeakKeyDictionary[Any, Quantized] = weakref.WeakKeyDictionary()


class _QuantizeInput:
    """A forward pre-hook: the Linear's input quantized then dequantized in `fmt`."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.active = True

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        import torch

        if not self.active or not args or not isinstance(args[0], torch.Tensor):
            return None
        return (_quantize(args[0], self.fmt), *args[1:])


@dataclass
class _Linear:
    module: Any
    original: Any  # the weight Parameter in the reference's precision
    quantized: Any  # its quantized-dequantized copy
    hook: _QuantizeInput | None


@dataclass
class Quantized:
    """The quantized Linears of a candidate, by name; `keep` leaves some in high precision."""

    name: str
    linears: dict[str, _Linear] = field(default_factory=dict)
    kept: frozenset[str] = frozenset()

    def keep(self, names: frozenset[str] | set[str] = frozenset()) -> None:
        """Run the modules `names` in the reference's precision, every other Linear quantized."""
        for name, linear in self.linears.items():
            held = name in names
            linear.module.weight = linear.original if held else linear.quantized
            if linear.hook is not None:
                linear.hook.active = not held
        self.kept = frozenset(names)

    def parameters(self, names: frozenset[str] | set[str]) -> int:
        """How many weights the modules `names` hold (all their parameters)."""
        return sum(
            p.numel() for n in names for p in self.linears[n].module.parameters(recurse=False)
        )


def quantize_linears(model: nn.Module, variant: str) -> Quantized:
    """Quantize `model`'s Linears in place as the variant `variant` says (see RECIPES); the
    InputError of a model without any."""
    import torch
    from torch import nn

    weights, activations = RECIPES[variant]
    state = Quantized(variant)
    for name, module in model.named_modules():
        transposed = _is_conv1d(module)
        if not isinstance(module, nn.Linear) and not transposed:
            continue
        original = module.weight
        with torch.no_grad():
            value = original.detach()
            value = _quantize(value.t(), weights).t() if transposed else _quantize(value, weights)
            quantized = nn.Parameter(value.contiguous(), requires_grad=False)
        hook = None
        if activations is not None:
            hook = _QuantizeInput(activations)
            module.register_forward_pre_hook(hook)
        state.linears[name] = _Linear(module, original, quantized, hook)
    if not state.linears:
        raise InputError(
            f"--against {variant}: the variant has nothing to quantize ({type(model).__name__} "
            "has no nn.Linear nor transformers Conv1D); compare it with --against bf16 or a "
            "quantized CANDIDATE instead"
        )
    state.keep()
    _STATES[model] = state
    return state


def quantized(model: nn.Module) -> Quantized | None:
    """The quantized Linears of a candidate `quantize_linears` made, or None."""
    return _STATES.get(model)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's Linear, its weight stored as [in, out]): its blocks and
    groups run along the input features, as a Linear's do."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers.")


def _quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` quantized then dequantized in `fmt`, computed in float32, back in its dtype."""
    from modeltap.stats.formats import quantize

    return quantize(x.float(), fmt).to(x.dtype)
