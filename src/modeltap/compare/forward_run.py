"""`compare` of one forward from a run's settings: load the reference and its inputs (and a
CANDIDATE model when given), make the variant, and run `compare_models` (compare/replay.py)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.loading.resolve import Status, no_status

if TYPE_CHECKING:
    from modeltap.compare.report import CompareReport
    from modeltap.config import Settings
    from modeltap.loading.resolve import Note


def compare_forward_run(
    s: Settings,
    variant: Any,
    options: Any,
    work: Path | None,
    *,
    command: str = "modeltap compare",
    offered: frozenset[str] | None = None,
    note: Note | None = None,
    status: Status = no_status,
) -> CompareReport:
    """Load `s.model` and its inputs, make the variant (of `s.candidate` when given) and run
    `compare_models` on one forward; `options` are compare's tolerances and run options. The
    report names both sides; work files go to `work` (kept) or a temporary folder."""
    import dataclasses

    from modeltap.compare import compare_models
    from modeltap.loading.resolve import resolve, run_metadata
    from modeltap.selection import Selection, select_modules

    with status(f"loading {s.model}"):
        resolved = resolve(s, command=command, offered=offered, note=note)
        loaded, inputs = resolved.loaded, resolved.inputs
        shared = s.candidate is None
        other, candidate = load_candidate(
            s, loaded, variant, model_class_name=s.model_class, note=note
        )
    inputs = _no_cache(loaded.model, inputs, s.use_cache)
    modules = select_modules(loaded.model, Selection(s.depth, tuple(s.include), tuple(s.exclude)))
    if s.bisect:
        modules = with_linears(loaded.model, candidate, modules)
    replay_note, rename = "", list(s.map)
    if variant.backend:
        from modeltap.compare.backends import COMPILED_RENAME, transform

        with status(f"{variant.backend} of the modules at --depth {s.depth}"):
            replay_note = transform(variant.backend, candidate, loaded.model, inputs, s.depth)
        rename += COMPILED_RENAME if variant.backend == "compile" else ()
    options = dataclasses.replace(
        options, rename=rename, replay_depth=s.depth if variant.backend else None
    )
    ref_meta = run_metadata(s, loaded)
    cand_meta = candidate_meta(s, candidate, variant)
    if other is not None and other.missing_weights:
        cand_meta["missing_weights"] = json.dumps(other.missing_weights)
    with work_folder(work) as folder:
        with status(f"comparing {loaded.model_class} with {variant.label}"):
            report = compare_models(
                loaded.model,
                candidate,
                inputs,
                modules,
                folder,
                options=options,
                keep=work is not None,
                stats_only=s.stats_only,
                metadata=(ref_meta, cand_meta),
            )
    report.replay_note = replay_note
    if s.bisect:
        from modeltap.compare.bisect import bisect, parse_target

        target = parse_target(s.target) if s.target else None
        with status("bisecting: the fewest modules to keep in high precision"):
            report.bisection = bisect(loaded.model, candidate, inputs, report, options, target)
    if s.ops and report.origins:
        from modeltap.compare.ops import blame_ops

        origin = report.origins[0].name
        with status(f"running the ops of {origin} one by one"):
            report.op_blame = blame_ops(loaded.model, candidate, inputs, origin, seed=s.seed)
    if shared:
        from modeltap.compare.variants import unchanged

        warning = unchanged(loaded.model, candidate, variant)
        report.warnings += [warning] if warning else []
    report.reference = {**ref_meta, "model_class": loaded.model_class}
    report.candidate = {**cand_meta, "model_class": type(candidate).__name__}
    return report


@contextmanager
def work_folder(work: Path | None) -> Iterator[Path]:
    """Where a comparison writes its work files: `work` (kept), else a temporary folder removed
    after."""
    if work is not None:
        yield work
        return
    with tempfile.TemporaryDirectory(prefix="modeltap-compare-") as tmp:
        yield Path(tmp)


def load_candidate(
    s: Settings, loaded: Any, variant: Any, *, model_class_name: str, note: Note | None = None
) -> tuple[Any, Any]:
    """(the CANDIDATE model loaded, or None; the variant to run): `variant` made of the
    candidate when one is given (checked to have the reference's architecture), else of the
    reference itself."""
    from modeltap.compare import make_candidate
    from modeltap.loading.resolve import load_hf

    other = None
    if s.candidate is not None:
        other = load_hf(
            s,
            model=s.candidate,
            model_class_name=model_class_name,
            device_map=None,
            max_memory=None,
            offload_folder=None,
            note=note,
        )
        from modeltap.compare.variants import check_same_architecture

        check_same_architecture(loaded.model, other.model, s.map, (s.model or "", s.candidate))
    base = loaded.model if other is None else other.model
    return other, make_candidate(base, variant, shared=other is None)


def candidate_meta(s: Settings, candidate: Any, variant: Any) -> dict[str, str]:
    """The candidate side of a comparison's report: its model, variant, dtype and device."""
    from modeltap.compare.variants import compute_dtype, model_device

    meta = {
        "model": s.candidate or s.model or "",
        "variant": variant.label,
        "dtype": str(compute_dtype(candidate)).removeprefix("torch."),
        "device": str(model_device(candidate)),
    }
    if variant.quant:
        from modeltap.compare.quantize import quantized

        state = quantized(candidate)
        meta["quantization"] = state.engine if state else "emulated"  # or torchao
    return meta


def with_linears(reference: Any, candidate: Any, modules: list[str]) -> list[str]:
    """`modules` and every quantized Linear, in the model's order: --bisect ranks the Linears by
    the local error their replay measures."""
    from modeltap.compare.quantize import quantized
    from modeltap.selection import ROOT

    state = quantized(candidate)
    wanted = set(modules) | set(state.linears if state else ())
    return [n or ROOT for n, _ in reference.named_modules() if (n or ROOT) in wanted]


def _no_cache(model: Any, inputs: Any, use_cache: bool) -> Any:
    """use_cache=False unless asked: a cache is state, and a replayed module would see it."""
    import inspect

    from modeltap.loading import Inputs

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return inputs
    if "use_cache" not in params or "use_cache" in inputs.kwargs:
        return inputs
    return Inputs(inputs.args, {**inputs.kwargs, "use_cache": use_cache}, inputs.description)
