"""`compare --bisect`: the fewest modules to keep in the reference's precision so that a quantized
variant's output passes the tolerance.

Candidates are the quantized Linears, ranked by the error each introduces (their local error in
the compare report, which the replay measured, as a mean relative error: see `_ranking`). They
are kept one by one in that order, the model run after each, until its output is within the
tolerance; then each kept module is dropped again if the output stays within without it, so the
set is minimal for that ranking. The output is the model's own (every floating tensor it
returns), judged as compare judges cumulative errors, or against a `--target` (`Target`): every
output's rel_rmse = ||a - b|| / ||b|| at most X (`rel_rmse=X`) or its SQNR = -20 log10 rel_rmse at
least DB decibels (`sqnr=DB`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError

if TYPE_CHECKING:
    from torch import nn

    from modeltap.compare.quantize import Quantized
    from modeltap.compare.replay import Options
    from modeltap.compare.report import CompareReport
    from modeltap.loading import Inputs

OUT_SUFFIXES = (".toml", ".json")
TARGET_SYNTAX = "give rel_rmse=X (X > 0) or sqnr=DB, e.g. --target sqnr=30"
# how the output error is measured: against the tolerance, or against a --target
OF_TOLERANCE = "share of the tolerance; above 1 fails"


@dataclass(frozen=True)
class Target:
    """`--target`: the output's rel_rmse at most `rel_rmse` (given as itself or as an SQNR)."""

    text: str  # as given: rel_rmse=0.05, sqnr=30
    rel_rmse: float

    @property
    def sqnr_db(self) -> float:
        return -20.0 * math.log10(self.rel_rmse)


def parse_target(text: str) -> Target:
    """`rel_rmse=X` or `sqnr=DB` (`sqnr_db=DB` too), or the InputError naming the syntax."""
    metric, sep, raw = text.partition("=")
    metric = metric.strip().lower()
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not sep or metric not in ("rel_rmse", "sqnr", "sqnr_db") or not math.isfinite(value):
        raise InputError(f"--target '{text}' is not a target; {TARGET_SYNTAX}")
    if metric == "rel_rmse":
        if value <= 0:
            raise InputError(f"--target '{text}': rel_rmse must be above 0; {TARGET_SYNTAX}")
        return Target(f"rel_rmse={value:g}", value)
    return Target(f"sqnr={value:g}", 10.0 ** (-value / 20.0))


@dataclass
class Step:
    """The output with `kept` modules in high precision."""

    kept: int
    # the largest, over the model's floating outputs, of its share of the tolerance (the
    # elementwise rule's or the cosine's: diff.tolerance.margin), or of its rel_rmse (--target)
    error: float
    passed: bool


@dataclass
class Bisection:
    variant: str
    engine: str
    kept: list[str] = field(default_factory=list)  # the set, largest local error first
    kept_parameters: int = 0  # the weights it keeps in high precision
    quantized_parameters: int = 0  # the weights the variant quantizes
    error: float = 0.0  # the output error with the set kept
    passed: bool = False  # the output passes with the set kept (False: not even with all)
    curve: list[Step] = field(default_factory=list)  # greedy: error against modules kept
    target: str | None = None  # --target as given; None: the tolerance
    measure: str = OF_TOLERANCE  # what `error` is: the rel_rmse with a target

    @property
    def goal(self) -> str:
        """What passing means: 'tolerance' or '--target sqnr=30'."""
        return f"--target {self.target}" if self.target else "tolerance"

    @property
    def share(self) -> float:
        return self.kept_parameters / self.quantized_parameters if self.quantized_parameters else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "engine": self.engine,
            "passed": self.passed,
            "modules_to_not_convert": self.kept,
            "kept_parameters": self.kept_parameters,
            "quantized_parameters": self.quantized_parameters,
            "kept_share": self.share,
            "output_error": self.error,
            "output_error_measure": self.measure,
            "target": self.target,
            "curve": [
                {"kept": s.kept, "output_error": s.error, "passed": s.passed} for s in self.curve
            ],
        }


def bisect(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    report: CompareReport,
    options: Options,
    target: Target | None = None,
) -> Bisection:
    """The smallest set of `candidate`'s quantized Linears to keep for its output to pass (the
    tolerance, or `target`), ranked by `report`'s local errors; `candidate` is left with every
    Linear quantized again."""
    from modeltap.compare.quantize import quantized

    state = quantized(candidate)
    if state is None:
        raise InputError("--bisect needs a quantized variant: --against int8-weight, fp8, ...")
    tolerance = options.accumulated(options.tolerance)
    expected = _outputs(reference, inputs, options.seed)

    def run(kept: list[str]) -> Step:
        state.keep(set(kept))
        got = _outputs(candidate, inputs, options.seed)
        if target is not None:
            return _meets(got, expected, target, len(kept))
        return _judge(got, expected, tolerance, len(kept), options.equal_nan)

    result = Bisection(
        state.name, state.engine, quantized_parameters=_weights(state, list(state.linears))
    )
    if target is not None:
        result.target = target.text
        result.measure = f"||a - b|| / ||b||; --target {target.text}: at most {target.rel_rmse:.3g}"
    try:
        result.curve.append(run([]))
        kept: list[str] = []
        for name in _ranking(state, report):
            if result.curve[-1].passed:
                break
            kept.append(name)
            result.curve.append(run(kept))
        if result.curve[-1].passed:
            for name in reversed(list(kept)):  # the least harmful first
                if run([k for k in kept if k != name]).passed:
                    kept.remove(name)
        last = run(kept)
    finally:
        state.keep()
    result.kept, result.error, result.passed = kept, last.error, last.passed
    result.kept_parameters = _weights(state, kept)
    return result


def _ranking(state: Quantized, report: CompareReport) -> list[str]:
    """The quantized Linears, largest local error first (those not measured last), as the mean
    of |a - b| / |b| over the replayed output: the report's max |a - b| / max |b| is blind to a
    module whose outlier channel sets max |b| while the quantization wipes out every other one."""
    local = {
        m.other or m.name: max((p.mean_rel for p in m.local if p.mean_rel is not None), default=0)
        for m in report.modules
        if m.compared
    }
    return sorted(state.linears, key=lambda n: (n not in local, -local.get(n, 0.0)))


def _weights(state: Quantized, names: list[str]) -> int:
    return sum(state.linears[n].original.numel() for n in names)


def _outputs(model: nn.Module, inputs: Inputs, seed: int) -> list[tuple[str, Any]]:
    import torch

    from modeltap.capture import flatten, run_model
    from modeltap.compare.variants import compute_dtype, model_device

    moved = inputs.to(str(model_device(model)), compute_dtype(model))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = run_model(model, moved.args, moved.kwargs)
    tensors = [(k, t) for k, t in flatten(out) if isinstance(t, torch.Tensor)]
    return [(k, t) for k, t in tensors if t.is_floating_point()]


def _judge(
    got: list[tuple[str, Any]],
    expected: list[tuple[str, Any]],
    tolerance: Any,
    kept: int,
    equal_nan: bool,
) -> Step:
    from modeltap.diff.pairs import compare
    from modeltap.diff.tolerance import margin

    pairs = [
        compare(key, key, a.float().cpu(), b.float().cpu(), tolerance, equal_nan=equal_nan)
        for (key, a), (_, b) in zip(got, expected, strict=True)
    ]
    errors = [margin(p, tolerance) for p in pairs]
    return Step(kept, max(errors, default=0.0), all(p.ok for p in pairs))


def _meets(
    got: list[tuple[str, Any]], expected: list[tuple[str, Any]], target: Target, kept: int
) -> Step:
    """The largest rel_rmse over the outputs (float64; NaN where either side is not finite, which
    fails), and whether it meets `target`."""
    import torch

    errors = []
    for (_, a), (_, b) in zip(got, expected, strict=True):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        norm = float(torch.linalg.vector_norm(b))
        diff = float(torch.linalg.vector_norm(a - b))
        errors.append(diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf))
    error = math.nan if any(math.isnan(e) for e in errors) else max(errors, default=0.0)
    return Step(kept, error, error <= target.rel_rmse)  # NaN compares False


def check_bisect_out(path: Path) -> None:
    """InputError for a --bisect-out file modeltap can't write, before anything runs."""
    from modeltap.dump import check_writable

    if path.suffix.lower() not in OUT_SUFFIXES:
        raise InputError(f"--bisect-out '{path}': give a .toml or a .json file")
    check_writable(path, "--bisect-out")


def bisect_file(result: Bisection, path: Path) -> str:
    """The set as --bisect-out writes it: `modules_to_not_convert` (transformers' quantization
    configs; torchao's filter_fn keeps the modules whose name is not in it), by `path`'s suffix."""
    if path.suffix.lower() == ".json":
        return json.dumps(result.to_json(), indent=1) + "\n"
    names = ", ".join(json.dumps(n) for n in result.kept)
    return (
        f"# modeltap compare --against {result.variant} --bisect ({result.engine}): keep these "
        "in high precision\n"
        f"# output error {result.error:.3g} with them kept, {result.share:.2%} of the quantized "
        f"weights; passed: {str(result.passed).lower()}\n"
        f"modules_to_not_convert = [{names}]\n"
    )
