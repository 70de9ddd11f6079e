"""Quantized variants of `compare`: every `nn.Linear`'s weight quantized then dequantized (and,
for the fp8 / MX / NV variants, its input activations too) with the recipes of `stats.formats`;
transformers' Conv1D (GPT-2's Linears) counts as one.

Where torchao is installed (the `quant` extra) and computes a recipe exactly, its quantizers run
(`TORCHAO_FORMATS`); every other format, and every format without torchao, is emulated by
`stats.formats.quantize`. The report says which ran (`Quantized.engine`).

The weights are quantized once, in a copy that shares every other tensor with the reference, so
the replay calls each candidate Linear as it is and measures the error it introduces. Which
Linears stay in the reference's precision can be changed afterwards (`Quantized.keep`), which is
what `--bisect` does between its runs.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
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
# The formats torchao quantizes on CPU exactly as stats.formats' recipe: fp8_e4m3 (its float8
# primitives: s = amax / 448, x / s saturated and cast, times s) and mxfp8 (prototype.mx_formats'
# to_mx, FLOOR scaling, bit-identical but for blocks whose amax is below 2^-118, where its scale
# floor is 2^-126 and the OCP spec's 2^-127). Not used: its affine int8 / int4 primitives round
# x * (1 / s), not x / s (about 1 in 1,400 bfloat16 values
# lands on the other integer), and its
# NVFP4 clamps a block's E4M3 scale to the smallest subnormal where the recipe's rounds to 0.
TORCHAO_FORMATS = ("fp8_e4m3", "mxfp8")
EMULATED = "emulated"
TORCHAO = "torchao"

_STATES: weakref.WeakKeyDictionary[Any, Quantized] = weakref.WeakKeyDictionary()


class _QuantizeInput:
    """A forward pre-hook: the Linear's input quantized then dequantized in `fmt`."""

    def __init__(self, fmt: str, engine: str) -> None:
        self.fmt = fmt
        self.engine = engine
        self.active = True

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        import torch

        if not self.active or not args or not isinstance(args[0], torch.Tensor):
            return None
        return (_quantize(args[0], self.fmt, self.engine), *args[1:])


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
    engine: str = EMULATED  # torchao or emulated: what quantized the weights and inputs
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
    state = Quantized(variant, engine(variant))
    for name, module in model.named_modules():
        transposed = _is_conv1d(module)
        if not isinstance(module, nn.Linear) and not transposed:
            continue
        original = module.weight
        with torch.no_grad():
            value = original.detach()
            if transposed:
                value = _quantize(value.t(), weights, state.engine).t()
            else:
                value = _quantize(value, weights, state.engine)
            quantized = nn.Parameter(value.contiguous(), requires_grad=False)
        hook = None
        if activations is not None:
            hook = _QuantizeInput(activations, state.engine)
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


def engine(variant: str) -> str:
    """`torchao` where torchao imports and quantizes every format of `variant` as the recipe
    does (TORCHAO_FORMATS), else `emulated`."""
    formats = {f for f in RECIPES[variant] if f is not None}
    if formats <= set(TORCHAO_FORMATS) and torchao_quantizers() is not None:
        return TORCHAO
    return EMULATED


@functools.cache
def torchao_quantizers() -> dict[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """torchao's quantize-dequantize of each of TORCHAO_FORMATS, for a finite float32 tensor, or
    None where torchao is not installed or does not import against this torch (its import-time
    messages are filtered in modeltap/__init__.py)."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.quantization.quant_primitives import (
            _choose_scale_float8,
            _dequantize_affine_float8,
            _quantize_affine_float8,
        )
    except Exception:  # ImportError, or a torchao built for another torch failing at import
        return None
    import torch

    def fp8(x: torch.Tensor) -> torch.Tensor:
        if not bool(x.any()):  # amax 0: torchao's scale would be 0 and x / 0 NaN
            return torch.zeros_like(x)
        scale = _choose_scale_float8(x, list(x.shape), torch.float8_e4m3fn)
        return _dequantize_affine_float8(_quantize_affine_float8(x, scale), scale)

    def mxfp8(x: torch.Tensor) -> torch.Tensor:
        last = x.shape[-1] if x.dim() else 1
        rows = torch.nn.functional.pad(x.reshape(-1, last), (0, -last % 32)).contiguous()
        scale, data = to_mx(rows, torch.float8_e4m3fn, 32)
        q = to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
        return q.reshape(rows.shape)[:, :last].reshape(x.shape)

    return {"fp8_e4m3": fp8, "mxfp8": mxfp8}


def _quantize(x: torch.Tensor, fmt: str, how: str = EMULATED) -> torch.Tensor:
    """`x` quantized then dequantized in `fmt`, computed in float32, back in its dtype: by
    torchao (`how` torchao) or stats.formats; non-finite values pass unchanged either way."""
    import torch

    from modeltap.stats.formats import quantize

    quantizers = torchao_quantizers() if how == TORCHAO else None
    if quantizers is None or fmt not in quantizers:
        return quantize(x.float(), fmt).to(x.dtype)
    x32 = x.detach().float()
    if x32.numel() == 0:
        return x.detach().clone()
    finite = torch.isfinite(x32)
    if bool(finite.all()):
        return quantizers[fmt](x32.contiguous()).to(x.dtype)
    clean = torch.where(finite, x32, torch.zeros((), dtype=x32.dtype))
    return torch.where(finite, quantizers[fmt](clean), x32).to(x.dtype)
