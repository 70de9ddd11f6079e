"""`compare --generate N` from a run's settings: load the reference (and a CANDIDATE model when
given), make the variant, and run `compare_generation` (compare/generate.py) on the prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError
from modeltap.loading.resolve import Status, no_status

if TYPE_CHECKING:
    from modeltap.compare.generate import GenerationComparison
    from modeltap.config import Settings
    from modeltap.loading.resolve import Note


def check_generation_request(s: Settings, refused: dict[str, Any], *, seed_given: bool) -> None:
    """Options that are for one-forward comparisons (`refused`: flag -> value, plus the settings'
    own), and --do-sample without a seed, refused before anything loads."""
    refused = {
        **refused,
        "--input-file": s.input_file,
        "--train-mode": s.train_mode,
        "an image FILE": s.images,
    }
    given = [flag for flag, value in refused.items() if value]
    if given:
        raise InputError(f"{given[0]} is for one-forward comparisons; drop it with --generate")
    if s.do_sample and not seed_given:
        raise InputError(
            "--do-sample in compare needs --seed N: the candidate is forced to the tokens the "
            "reference sampled, and only a seeded reference run can be made again"
        )


def compare_generation_run(
    s: Settings,
    variant: Any,
    options: Any,
    work: Path | None,
    *,
    class_given: bool,
    offered: frozenset[str] | None = None,
    note: Note | None = None,
    status: Status = no_status,
) -> GenerationComparison:
    """Generate with `s.model` and with its variant (or `s.candidate`), step by step; `options`
    are compare's (tolerance, overrides, the accumulated-rounding allowance...). The result's
    `meta` names both sides."""
    import torch

    from modeltap.compare.forward_run import load_candidate, work_folder
    from modeltap.compare.generate import compare_generation
    from modeltap.generate import prompt_inputs
    from modeltap.generate.requested import decoding
    from modeltap.loading.generator import load_generator
    from modeltap.loading.resolve import processed_inputs
    from modeltap.selection import Selection

    options_ = decoding(s)
    # before the weights load
    media = processed_inputs(s, offered=offered, note=note) if s.audio else None
    with status(f"loading {s.model}"):
        loaded, tok = load_generator(s, class_given=class_given, note=note)
        _, candidate = load_candidate(
            s, loaded, variant, model_class_name=type(loaded.model).__name__, note=note
        )
    inputs = media if media is not None else prompt_inputs(loaded.model, tok, s.texts, chat=s.chat)
    inputs = inputs.to(loaded.device, getattr(torch, loaded.dtype))
    options = dataclasses.replace(options, rename=s.map)
    replay_note = ""
    if variant.backend:
        from modeltap.compare.backends import COMPILED_RENAME, transform_for_generation
        from modeltap.loading import Inputs

        with status(f"{variant.backend} of the modules at --depth {s.depth}"):
            replay_note = transform_for_generation(variant.backend, candidate, s.depth)
        # export can't carry the KV cache object: both sides decode without it (the note says so)
        inputs = Inputs(inputs.args, {**inputs.kwargs, "use_cache": False}, inputs.description)
        rename = list(s.map) + list(COMPILED_RENAME if variant.backend == "compile" else ())
        options = dataclasses.replace(options, rename=rename, replay_depth=s.depth)
    with work_folder(work) as folder:
        with status(f"generating with {loaded.model_class} and {variant.label}"):
            result = compare_generation(
                loaded.model,
                candidate,
                inputs,
                folder,
                decoding=options_,
                selection=Selection(s.depth, tuple(s.include), tuple(s.exclude)),
                options=options,
                tokenizer=tok,
            )
    result.meta = _sides(s, loaded, candidate, variant, replay_note)
    return result


def _sides(s: Settings, loaded: Any, candidate: Any, variant: Any, note: str) -> dict[str, Any]:
    from modeltap.compare.forward_run import candidate_meta

    return {
        **({"note": note} if note else {}),
        "reference": {"model": s.model, "model_class": loaded.model_class, "dtype": loaded.dtype},
        "candidate": candidate_meta(s, candidate, variant),
    }
