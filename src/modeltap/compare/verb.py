"""`modeltap.compare(model, candidate, inputs)`: what `modeltap compare` reports, from Python."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from modeltap.compare.report import CompareReport


def compare(
    model: nn.Module,
    candidate: nn.Module | str,
    inputs: Any,
    *,
    preset: str | None = None,
    depth: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    atol: float | None = None,
    rtol: float | None = None,
    tokenizer: Any = None,
    equal_nan: bool = False,
    seed: int = 0,
    out_dir: str | os.PathLike[str] | None = None,
    ops: bool = False,
    bisect: bool = False,
    target: str | None = None,
) -> CompareReport:
    """Run `model` and `candidate` on `inputs`, replay each selected module with the reference's
    inputs, and return the report (`.passed`, `.origins`: the modules that introduced the error).

    `candidate`: a model with `model`'s module names, or a variant of `model` as `--against`
    names it (`"bf16"`, `"fp16"`, `"attn:sdpa"`, `"int8-weight"`...). `preset`: the tolerances
    (default: the variant's, as `modeltap compare`); `atol`, `rtol` over it. `inputs`, `depth`,
    `include`, `exclude` and `tokenizer` as `modeltap.dump`'s; `out_dir` keeps both dumps.
    `ops`: as `--ops`, the op inside the worst origin that introduces the most error
    (`.op_blame`: `.path()`, `.worst` with its source line). `bisect`: with a quantized variant,
    as `--bisect`, the fewest modules to keep in high precision for the output to pass the
    preset, or to reach `target` (`"rel_rmse=0.05"`, `"sqnr=30"`) (`.bisection`: `.kept`,
    `.share`, `.error`, `.passed`, `.curve`); `.candidate["quantization"]` says whether torchao
    or modeltap's emulation quantized it."""
    from pathlib import Path

    from modeltap.compare.replay import Options, compare_models
    from modeltap.config import read_preset
    from modeltap.config.files import ACCUMULATED_KEY
    from modeltap.diff.tolerance import from_preset
    from modeltap.dumping import as_inputs
    from modeltap.selection import Selection, select_modules

    if isinstance(candidate, str):
        candidate, preset = _variant(model, candidate, preset)
    goal = _check_bisect(candidate, bisect, target)
    tolerance, _ = from_preset(preset, atol=atol, rtol=rtol)
    accumulated = float(read_preset(preset).get(ACCUMULATED_KEY, 0.0)) if preset else 0.0
    options = Options(
        tolerance=tolerance, accumulated_scaled_atol=accumulated, equal_nan=equal_nan, seed=seed
    )
    selection = Selection(depth=depth, include=tuple(include), exclude=tuple(exclude))
    modules = select_modules(model, selection)
    if bisect:  # the replay measures each quantized Linear's own error, which ranks them
        from modeltap.compare.forward_run import with_linears

        modules = with_linears(model, candidate, modules)
    run_on = as_inputs(inputs, tokenizer=tokenizer)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        report = compare_models(
            model, candidate, run_on, modules, out_dir, options=options, keep=True
        )
    else:
        with tempfile.TemporaryDirectory(prefix="modeltap-compare-") as work:
            report = compare_models(model, candidate, run_on, modules, work, options=options)
    report.preset = preset
    quantized = _quantized(candidate)
    if quantized is not None:
        report.candidate = {**report.candidate, "quantization": quantized.engine}
    if bisect:
        from modeltap.compare.bisect import bisect as find

        report.bisection = find(model, candidate, run_on, report, options, goal)
    if ops and report.origins:
        from modeltap.compare.ops import blame_ops

        origin = report.origins[0].name
        report.op_blame = blame_ops(model, candidate, run_on, origin, seed=seed)
    return report


def _variant(model: nn.Module, name: str, preset: str | None) -> tuple[nn.Module, str | None]:
    """The candidate `name` (as --against names it) makes of `model`, and the preset it is
    judged by (`preset`, else the variant's)."""
    from modeltap.compare.variants import DEFAULT_PRESET, make_candidate, parse_against
    from modeltap.config import preset_names
    from modeltap.errors import InputError

    variant = parse_against(name)
    if variant.backend:
        raise InputError(
            f"'{name}' rebuilds the model's modules; run `modeltap compare --against {name}` "
            "for it"
        )
    default = DEFAULT_PRESET[variant.kind]
    preset = preset or (default if default in preset_names() else "fp32")
    return make_candidate(model, variant, shared=True), preset


def _quantized(candidate: Any) -> Any:
    from modeltap.compare.quantize import quantized

    return quantized(candidate)


def _check_bisect(candidate: Any, bisect: bool, target: str | None) -> Any:
    """The parsed `target` (None without one); InputError for `target` without `bisect`, or
    `bisect` without a quantized variant."""
    from modeltap.compare.bisect import parse_target
    from modeltap.errors import InputError

    goal = parse_target(target) if target is not None else None
    if goal is not None and not bisect:
        raise InputError("target= sets what bisect aims for; add bisect=True")
    if bisect and (isinstance(candidate, str) or _quantized(candidate) is None):
        raise InputError(
            "bisect=True keeps modules out of a quantized variant: give candidate='fp8', "
            "'mxfp8', 'nvfp4', 'int8-weight' or 'int4-weight'"
        )
    return goal
