"""A run's settings as the generation options they ask for: the decoding, and which steps keep
their tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap.errors import InputError
from modeltap.generate.options import Decoding, StepPlan

if TYPE_CHECKING:
    from modeltap.config import Settings


def step_plan(s: Settings) -> StepPlan:
    """--full, --steps and --stats-only: at most one of them."""
    given = [name for name, on in (("--full", s.full), ("--steps", s.steps)) if on]
    given += ["--stats-only"] if s.stats_only else []
    if len(given) > 1:
        raise InputError(f"give one of {' and '.join(given)}: each says which steps keep tensors")
    if s.full:
        return StepPlan("all")
    if s.stats_only:
        return StepPlan("none")
    if s.steps:
        return StepPlan.parse(s.steps)
    return StepPlan()


def decoding(s: Settings) -> Decoding:
    """The decoding options of `s`, checked."""
    d = Decoding(
        s.max_new_tokens, s.do_sample, s.seed, s.temperature, s.top_k, s.top_p, s.num_beams
    )
    d.check()
    return d
