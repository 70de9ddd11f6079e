"""`compare --generate N`: a generation and its variant, step by step, with the reference's tokens
forced on the candidate (teacher forcing), so that every step stays comparable after the texts part.

1. The reference generates (every step's tensors kept in the work folder).
2. The candidate generates with each step forced to choose the reference's token: its forwards
   read the very same tokens, and its own probabilities say which token it would have chosen.
3. The two generation dumps are compared step by step (`modeltap.diff.generations`).
4. Each step where the candidate's likeliest token is another than the reference's (a flip) is
   weighed against the preset: one forward of each model over the prompt and the reference's
   tokens gives both sides' logits at that step. The flip moved the two tokens' logit
   difference by `shift` (the reference's margin plus the candidate's); the preset lets each
   logit move by `atol + rtol * |logit| + scaled_atol * max|logits|` (its accumulated form,
   logits being a cumulative error), so `allowance` is that for the two tokens together. A
   flip with `shift <= allowance` is a near tie that the variant's precision can turn: a
   warning, not a defect. The run fails on a step out of tolerance or a flip beyond it.
5. At the first flip beyond the allowance (else the first step out of tolerance), the existing
   replay attribution runs once, on the prompt and the reference's tokens up to that step in one
   forward: the module that introduced the error.
6. The candidate also generates freely, for the user to read its own text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError
from modeltap.generate import Decoding, Generated, StepPlan, generate_model
from modeltap.selection import Selection

if TYPE_CHECKING:
    from torch import nn

    from modeltap.compare.replay import Options
    from modeltap.compare.report import CompareReport
    from modeltap.diff.generations import GenerationDiff
    from modeltap.loading import Inputs

REFERENCE_FILE = "reference.gen.safetensors"
CANDIDATE_FILE = "candidate.gen.safetensors"


@dataclass
class Departure:
    """The first step where the candidate's likeliest token is not the reference's."""

    step: int
    row: int
    reference: int
    candidate: int
    reference_text: str | None
    candidate_text: str | None
    p_reference: float  # the reference's probability of its token
    p_candidate: float  # the candidate's probability of its own likeliest token
    margin: float  # the candidate's p(its token) - p(the reference's token)
    # the reference's logit of its token minus its logit of the candidate's token
    logit_margin: float | None = None
    # how far the flip moved those two logits' difference: the reference's margin plus the
    # candidate's (its logit of its token minus of the reference's)
    shift: float | None = None
    # how far the preset lets those two logits' difference move (see the module docstring)
    allowance: float | None = None

    @property
    def within_precision(self) -> bool:
        """A near tie that the variant's precision can turn (not a defect)."""
        return (
            self.shift is not None and self.allowance is not None and (self.shift <= self.allowance)
        )

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "within_precision": self.within_precision}


@dataclass
class GenerationComparison:
    reference: Generated
    forced: Generated
    free: Generated
    steps: GenerationDiff
    departure: Departure | None  # the first flip
    attribution: CompareReport | None = None
    attributed_step: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # every flip (a step and row where the likeliest tokens differ), each weighed by the preset
    departures: list[Departure] = field(default_factory=list)

    @property
    def ties(self) -> list[Departure]:
        """Flips within the variant's precision: warned about, not failed."""
        return [d for d in self.departures if d.within_precision]

    @property
    def failed_flip(self) -> Departure | None:
        """The first flip beyond the preset's allowance."""
        return next((d for d in self.departures if not d.within_precision), None)

    @property
    def passed(self) -> bool:
        first = self.steps.first_divergence
        return self.failed_flip is None and first is None

    def to_json(self) -> dict[str, Any]:
        origins = self.attribution.origins if self.attribution is not None else []
        return {
            "schema": "modeltap.compare-generate/1",
            "passed": self.passed,
            **self.meta,
            "reference_text": self.reference.texts,
            "candidate_text": self.free.texts,
            "reference_ids": self.reference.new_ids,
            "candidate_ids": self.free.new_ids,
            "departure": None if self.departure is None else self.departure.to_json(),
            "departures": [d.to_json() for d in self.departures],
            "ties": [{"step": d.step, "row": d.row} for d in self.ties],
            "attributed_step": self.attributed_step,
            "origins": [{"module": m.name, "local_error": m.local_error} for m in origins],
            "steps": self.steps.to_json(),
            "attribution": None if self.attribution is None else self.attribution.to_json(),
        }


def _top(step: dict[str, Any], row: int) -> tuple[int, float, str | None]:
    """(token, p, text) of the likeliest token of a step, from its chosen token and runner-up."""
    texts, seconds = step.get("text") or [], step.get("second_text") or []
    if step["p"][row] >= step["p_second"][row]:
        return step["token"][row], step["p"][row], texts[row] if texts else None
    return step["second"][row], step["p_second"][row], seconds[row] if seconds else None


def departure(reference: Generated, forced: Generated) -> Departure | None:
    """Where the teacher-forced candidate's likeliest token first differs from the reference's."""
    return next(iter(departures(reference, forced)), None)


def departures(reference: Generated, forced: Generated) -> list[Departure]:
    """Every step and row where the teacher-forced candidate's likeliest token differs from the
    reference's."""
    found = []
    for ref, cand in zip(reference.steps, forced.steps, strict=False):
        for row in range(len(ref["token"])):
            ref_top, p_ref, ref_text = _top(ref, row)
            cand_top, p_cand, cand_text = _top(cand, row)
            if ref_top != cand_top:
                # the candidate's probability of the reference's token: its forced choice
                p_forced = cand["p"][row] if cand["token"][row] == ref_top else 0.0
                found.append(
                    Departure(
                        ref["step"], row, ref_top, cand_top, ref_text, cand_text, p_ref, p_cand,
                        p_cand - p_forced,
                    )
                )  # fmt: skip
    return found


def weigh_flips(
    flips: list[Departure],
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    cand_inputs: Inputs,
    generated: Generated,
    options: Options,
) -> None:
    """Each flip's logit margin, shift and the preset's allowance for it (module docstring):
    from one forward of each model over the prompt and the reference's tokens, without cache."""
    from fnmatch import fnmatchcase

    if not flips:
        return
    last = max(d.step for d in flips)
    ref_logits, prompt_scale = _step_logits(reference, inputs, generated, last)
    cand_logits, _ = _step_logits(candidate, cand_inputs, generated, last)
    tol = next(
        (t for glob, t in options.overrides if fnmatchcase("__root__:logits", glob)),
        options.tolerance,
    )
    tol = options.accumulated(tol)
    for d in flips:
        ref, cand = ref_logits[d.row, d.step], cand_logits[d.row, d.step]
        a, b = d.reference, d.candidate
        d.logit_margin = float(ref[a] - ref[b])
        d.shift = d.logit_margin + float(cand[b] - cand[a])
        # max|logits| of the step's whole tensor, as the step's comparison takes it (the
        # prefill's covers every prompt position)
        scale = prompt_scale if d.step == 0 else float(ref_logits[:, d.step].abs().max())
        d.allowance = sum(
            tol.atol + tol.rtol * abs(float(ref[t])) + tol.scaled_atol * scale for t in (a, b)
        )


def _step_logits(
    model: nn.Module, inputs: Inputs, generated: Generated, last: int
) -> tuple[Any, float]:
    """Each row's logits at steps 0 to `last` (rows x steps x vocabulary, float64), from one
    forward over the prompt and the forced tokens (what each step computes at its position),
    and max|logits| over the prompt's positions (the prefill's)."""
    import torch

    forward = _forced_forward(model, inputs, generated, last)
    with torch.no_grad():
        out = model(*forward.args, **forward.kwargs)
    logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)
    if getattr(model.config, "is_encoder_decoder", False):
        start = len(generated.decoder_prompt_ids[0]) - 1
    else:
        start = inputs.kwargs["input_ids"].shape[1] - 1
    prompt_scale = float(logits[:, : start + 1].detach().abs().max())
    return logits[:, start : start + last + 1].detach().to("cpu", torch.float64), prompt_scale


def compare_generation(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    work_dir: str | os.PathLike[str],
    *,
    decoding: Decoding,
    selection: Selection | None = None,
    options: Options | None = None,
    tokenizer: Any = None,
    cand_inputs: Inputs | None = None,
    metadata: tuple[dict[str, str], dict[str, str]] = ({}, {}),
) -> GenerationComparison:
    """Generate with `reference`, then with `candidate` forced to the reference's tokens; compare
    them step by step and attribute the first departure (see the module docstring)."""
    from modeltap.compare.replay import Options
    from modeltap.compare.variants import compute_dtype, model_device
    from modeltap.diff.generations import diff_generations
    from modeltap.selection import select_modules

    options = options or Options()
    work = Path(work_dir)
    selection = selection or Selection()
    ids = inputs.kwargs.get("input_ids")
    decoding = decoding.resolve(reference, None if ids is None else ids.shape[1])
    if (decoding.num_beams or 1) > 1:
        raise InputError(
            f"compare --generate forces the reference's tokens on one sequence per prompt, and "
            f"the decoding is beam search ({decoding.num_beams} beams, from --num-beams or the "
            "model's generation config); pass --num-beams 1"
        )
    modules = select_modules(reference, selection)
    if cand_inputs is None:
        cand_inputs = inputs.to(str(model_device(candidate)), compute_dtype(candidate))
    common = {"tokenizer": tokenizer, "decoding": decoding, "plan": StepPlan("all")}
    ref = generate_model(
        reference, inputs, work / REFERENCE_FILE, selection=selection, metadata=metadata[0],
        **common,
    )  # fmt: skip
    forced = generate_model(
        candidate, cand_inputs, work / CANDIDATE_FILE, selection=selection,
        forced=ref.new_ids, metadata=metadata[1], **common,
    )  # fmt: skip
    free_path = work / ".candidate.free.safetensors"
    try:
        free = generate_model(
            candidate, cand_inputs, free_path, selection=Selection(depth=0),
            plan=StepPlan("none"), tokenizer=tokenizer, decoding=decoding,
        )  # fmt: skip
    finally:
        free_path.unlink(missing_ok=True)
    steps = diff_generations(
        work / CANDIDATE_FILE,
        work / REFERENCE_FILE,
        # Every step's outputs carry the error of everything before them: cumulative errors,
        # judged as compare judges them, with the preset widened for accumulated rounding.
        tolerance=options.accumulated(options.tolerance),
        overrides=[(glob, options.accumulated(tol)) for glob, tol in options.overrides],
        equal_nan=options.equal_nan,
        upcast=True,  # a bfloat16 candidate against a float32 reference, as compare does
    )
    flips = departures(ref, forced)
    weigh_flips(flips, reference, candidate, inputs, cand_inputs, ref, options)
    result = GenerationComparison(ref, forced, free, steps, next(iter(flips), None))
    result.departures = flips
    _attribute(result, reference, candidate, inputs, modules, work, options)
    return result


def _attribute(
    result: GenerationComparison,
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    modules: list[str],
    work: Path,
    options: Options,
) -> None:
    """Attribute the first departure (a flip beyond tolerance, else the first step that
    diverges) to modules: `compare_models` on that step's forced forward, in a scratch folder
    removed after."""
    from modeltap.compare.replay import compare_models

    first = result.steps.first_divergence
    beyond = result.failed_flip
    at = beyond.step if beyond is not None else (first.step if first is not None else None)
    if at is None:
        return
    forward = _forced_forward(reference, inputs, result.reference, at)
    replay_dir = work / f".replay-step{at}"
    replay_dir.mkdir(exist_ok=True)
    try:
        result.attribution = compare_models(
            reference,
            candidate,
            forward,
            modules,
            replay_dir,
            options=options,
        )
    finally:
        for leftover in replay_dir.iterdir():
            leftover.unlink()
        replay_dir.rmdir()
    result.attributed_step = at


def _forced_forward(model: nn.Module, inputs: Inputs, reference: Generated, step: int) -> Any:
    """One forward, without a cache, over the prompt and the first `step` forced tokens: what
    step `step` computes at its last position (an encoder-decoder: its decoder prompt, the start
    and any forced tokens, then the forced ones; its encoder reads the inputs as they are)."""
    import torch

    from modeltap.loading import Inputs

    kwargs = dict(inputs.kwargs)
    forced = [row[:step] for row in reference.new_ids]
    if getattr(model.config, "is_encoder_decoder", False):
        rows = [p + f for p, f in zip(reference.decoder_prompt_ids, forced, strict=True)]
        kwargs["decoder_input_ids"] = torch.tensor(rows, device=_device(kwargs))
    else:
        ids = kwargs.get("input_ids")
        if ids is None:
            raise InputError("compare --generate needs token ids (a TEXT prompt)")
        tokens = torch.tensor(forced, dtype=ids.dtype, device=ids.device)
        kwargs["input_ids"] = torch.cat([ids, tokens], dim=1)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            ones = torch.ones(mask.shape[0], step, dtype=mask.dtype, device=mask.device)
            kwargs["attention_mask"] = torch.cat([mask, ones], dim=1)
    kwargs["use_cache"] = False
    description = {**inputs.description, "forced_tokens": step}
    return Inputs(inputs.args, kwargs, description)


def _device(kwargs: dict[str, Any]) -> Any:
    """Where the inputs are (the encoder's ids or features): the decoder's ids go there too."""
    return next((v.device for v in kwargs.values() if hasattr(v, "device")), None)
