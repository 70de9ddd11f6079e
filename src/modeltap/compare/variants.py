"""The candidate of a comparison: the reference (or a second checkpoint) made into a variant.

`--against` names the variant: `bf16`, `fp16` (a copy in that dtype), `attn:IMPL` (the same
weights with another attention implementation), `cuda` (a copy on the GPU), `fp8`, `mxfp8`,
`nvfp4`, `int8-weight`, `int4-weight` (every nn.Linear quantized: see `quantize`). Copies share
nothing they don't have to: an attention variant shares the reference's parameters, a dtype copy
holds only its own low-precision weights, a quantized one only its Linears' weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modeltap.compare.quantize import RECIPES
from modeltap.errors import InputError
from modeltap.selection import ROOT, suggest

if TYPE_CHECKING:
    import torch
    from torch import nn

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEVICES = ("cuda",)
BACKENDS = ("compile", "export")
KEYWORDS = (*DTYPES, *DEVICES, "attn:IMPL", *BACKENDS, *RECIPES)
# The tolerance preset used when none is asked for, by kind of variant.
DEFAULT_PRESET = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "attn": "fp32",
    "cuda": "cross-device",
    "checkpoint": "fp32",
    "compile": "compile",  # fp32 where configs/tolerances.toml has no [compile]
    "export": "fp32",
    # a quantized variant: its own, scaled to the format's error (see tolerances.toml)
    **{name: name for name in RECIPES},
}


@dataclass(frozen=True)
class Variant:
    """What turns the base model into the candidate: a dtype, a device or an attention impl."""

    dtype: str | None = None
    device: str | None = None
    attn: str | None = None
    backend: str | None = None  # compile or export: see compare.backends
    quant: str | None = None  # fp8, mxfp8, nvfp4, int8-weight, int4-weight: see compare.quantize

    @property
    def label(self) -> str:
        if self.quant:
            return self.quant
        if self.backend:
            return self.backend
        if self.attn:
            return f"attn:{self.attn}"
        if self.device:
            return self.device
        return next((k for k, v in DTYPES.items() if v == self.dtype), "same")

    @property
    def kind(self) -> str:
        if self.quant:
            return self.quant
        if self.backend:
            return self.backend
        return "attn" if self.attn else (self.device or self.dtype or "checkpoint")


def parse_against(text: str | None) -> Variant:
    """`bf16`, `fp16`, `fp32`, `attn:IMPL`, `cuda`, `compile`, `export` or a quantized variant
    (`fp8`, `mxfp8`, `nvfp4`, `int8-weight`, `int4-weight`); None for a plain second checkpoint."""
    if text is None:
        return Variant()
    if text in DTYPES:
        return Variant(dtype=DTYPES[text])
    if text in DEVICES:
        return Variant(device=text)
    if text.startswith("attn:") and text[5:]:
        return Variant(attn=text[5:])
    if text in BACKENDS:
        return Variant(backend=text)
    if text in RECIPES:
        return Variant(quant=text)
    guess = suggest(text, KEYWORDS)
    hint = f"did you mean '{guess}'?" if guess else "use one of " + ", ".join(KEYWORDS)
    raise InputError(f"--against '{text}' is not a variant; {hint}")


def _copy(model: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers are `convert`ed, never copied first:
    the memo hands deepcopy the converted tensor for each one, so a dtype copy costs only its own
    size and an identity `convert` shares the weights."""
    import torch
    from torch import nn

    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        new = convert(tensor.detach())
        if isinstance(tensor, nn.Parameter):
            new = nn.Parameter(new, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = new
    with torch.no_grad():
        return copy.deepcopy(model, memo)


def make_candidate(base: nn.Module, variant: Variant, *, shared: bool) -> nn.Module:
    """The candidate model. `shared`: `base` is the reference itself, so copy rather than change
    it; a second checkpoint (loaded for this run) is changed in place."""
    import torch

    if variant.dtype or variant.device:
        dtype = getattr(torch, variant.dtype) if variant.dtype else None
        device = variant.device
        if device == "cuda" and not torch.cuda.is_available():
            raise InputError("--against cuda asked for, but torch sees no CUDA GPU")

        def convert(t: torch.Tensor) -> torch.Tensor:
            floating = dtype if t.is_floating_point() else None
            return t.to(device=device, dtype=floating, copy=shared)

        model = _copy(base, convert) if shared else base.to(device=device, dtype=dtype)
    else:
        model = _copy(base, lambda t: t) if shared else base
    if variant.attn:
        setter = getattr(model, "set_attn_implementation", None)
        if setter is None:
            raise InputError(
                f"{type(model).__name__} has no set_attn_implementation; attn:IMPL needs a "
                "transformers model"
            )
        try:
            setter(variant.attn)
        except (ValueError, ImportError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(
                f"attn:{variant.attn} can't be used with {type(model).__name__}: {first}"
            ) from exc
    if variant.quant:
        from modeltap.compare.quantize import quantize_linears

        quantize_linears(model, variant.quant)
    return model.eval()


def check_same_architecture(
    reference: nn.Module,
    candidate: nn.Module,
    rename: Sequence[str] = (),
    names: tuple[str, str] = ("MODEL", "CANDIDATE"),
) -> None:
    """`InputError` naming the first difference between the two module trees (after `rename`,
    the candidate's OLD=NEW globs) or the shapes of their parameters: a module's replay feeds the
    reference's inputs to its counterpart, which another architecture can't take."""
    from modeltap.diff.keymap import apply_map, parse_map

    rules = parse_map(rename)
    ref_name, cand_name = names
    theirs = {apply_map(n or ROOT, rules): m for n, m in candidate.named_modules()}
    ours = {n or ROOT: m for n, m in reference.named_modules()}

    def refuse(what: str) -> InputError:
        return InputError(
            f"'{cand_name}' is not the architecture of '{ref_name}': {what}; compare runs two "
            "variants of one model (dump each and `modeltap diff` them for others)"
        )

    for name, module in ours.items():
        other = theirs.get(name)
        if other is None:
            raise refuse(f"module '{name}' has no counterpart in it (--map renames)")
        shapes = {n: list(p.shape) for n, p in other.named_parameters(recurse=False)}
        for leaf, param in module.named_parameters(recurse=False):
            if leaf in shapes and shapes[leaf] != list(param.shape):
                where = leaf if name == ROOT else f"{name}.{leaf}"
                raise refuse(
                    f"'{where}' is {shapes[leaf]} in it, {list(param.shape)} in '{ref_name}'"
                )
    extra = next((name for name in theirs if name not in ours), None)
    if extra is not None:
        raise refuse(f"it has a module '{extra}' that '{ref_name}' lacks")


def unchanged(reference: nn.Module, candidate: nn.Module, variant: Variant) -> str | None:
    """A warning when `--against` built a candidate that computes as the reference does (the
    dtype, device and attention implementation it already has): every error is then 0."""
    if variant.backend or variant.quant:
        return None
    ours = (compute_dtype(reference), model_device(reference), attn_impl(reference))
    if (compute_dtype(candidate), model_device(candidate), attn_impl(candidate)) != ours:
        return None
    dtype, device, attn = ours
    how = f"{str(dtype).removeprefix('torch.')} on {device}" + (
        f", {attn} attention" if attn else ""
    )
    return (
        f"--against {variant.label} changes nothing: the model already runs {how}; every error is 0"
    )


def attn_impl(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model computes in: that of its first floating parameter (float32 if none)."""
    import torch

    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def model_device(model: nn.Module) -> torch.device:
    import torch

    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")
