"""Rules: small functions over one step's statistics that flag what training tends to break.

A rule is any callable `rule(observation) -> (value, message) | None` with a `name`; the built-in
ones are frozen dataclasses whose fields are their thresholds:

    VanishingGradient(threshold=1e-7)   gradient norm below (module outputs and parameters)
    ExplodingGradient(threshold=1e3)    gradient norm above
    DeadUnits(fraction=0.9)             share of dead units of a floating activation above
                                        (not logits unless logits=True)
    Saturation(threshold=0.95)          tanh/sigmoid output crowding its bounds
    UpdateRatio(low=1e-8, high=1e-1)    ||w_after - w_before|| / ||w_before|| outside [low, high],
                                        for parameters with at least min_dims=2 dimensions

The gradient thresholds are on the norm, as `modeltap grads` flags them. No built-in rule judges
a tensor holding NaN/Inf by its size: its norm and extremes are those of its finite values only
(a GradScaler-skipped step's gradient, NaN where a ReLU let it through and 0 elsewhere, would
read as vanishing); the tripwire and the `nonfinite` count report it. The defaults are
calibrated on healthy runs (scripts/calibrate_rules.py: MiniLM fine-tuned as a classifier,
bert-base MLM) so that those give no warning; docs/commands/record.md ("Rules") has the figures. A
signed output's share of units never above 0 sits near 50% by symmetry (0.50 on MiniLM's token
type embeddings), hence 0.9 for dead units.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from modeltap.stats import TensorStats

ACTIVATION = "activation"
GRADIENT = "gradient"  # of a module output
PARAM_GRAD = "param_grad"
UPDATE = "update"

# Module classes whose output lies in a bounded range, and that range.
BOUNDED = {"Tanh": (-1.0, 1.0), "Sigmoid": (0.0, 1.0), "Hardtanh": (-1.0, 1.0)}


@dataclass(frozen=True)
class Observation:
    """One thing a rule looks at: a tensor's statistics, or a parameter's update ratio."""

    key: str  # as in the step file: `fc1`, `grad/fc1`, `grad/fc1.weight`; `fc1.weight` for updates
    kind: str  # ACTIVATION, GRADIENT, PARAM_GRAD or UPDATE
    stats: TensorStats | None = None
    module_class: str | None = None
    value: float | None = None  # the update ratio
    dims: int | None = None  # the parameter's number of dimensions, for updates


@dataclass(frozen=True)
class RuleHit:
    rule: str
    step: int
    rank: int
    key: str
    value: float
    message: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RuleHit:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    def __str__(self) -> str:
        return f"step {self.step} rank {self.rank}: {self.rule}: {self.key}: {self.message}"


class Rule(Protocol):
    name: str

    def __call__(self, obs: Observation) -> tuple[float, str] | None: ...


@dataclass(frozen=True)
class VanishingGradient:
    threshold: float = 1e-7
    name = "vanishing_gradient"

    def __call__(self, obs: Observation) -> tuple[float, str] | None:
        norm = _grad_norm(obs)
        if norm is not None and norm < self.threshold:
            return norm, f"gradient norm {norm:.3g} < {self.threshold:g}"
        return None


@dataclass(frozen=True)
class ExplodingGradient:
    threshold: float = 1e3
    name = "exploding_gradient"

    def __call__(self, obs: Observation) -> tuple[float, str] | None:
        norm = _grad_norm(obs)
        if norm is not None and norm > self.threshold:
            return norm, f"gradient norm {norm:.3g} > {self.threshold:g}"
        return None


# Outputs that are signed scores by design: a "unit" never above 0 there is a class the batch
# does not favour, not a dead one. Output fields (`logits`, `start_logits`...) and head modules by
# their transformers names.
LOGIT_MODULES = ("classifier", "lm_head", "score", "qa_outputs")


def is_logits(key: str) -> bool:
    """A key of a signed-score output: a `logits` field, or a classification/LM head module."""
    module, _, part = key.partition(":")
    module = module.split("@")[0]
    return part.split("@")[0].endswith("logits") or module.rpartition(".")[2] in LOGIT_MODULES


@dataclass(frozen=True)
class DeadUnits:
    """Floating outputs only (an integer tensor passed through, token ids or a mask, has no
    units), and not logits unless `logits=True`."""

    fraction: float = 0.9
    logits: bool = False
    name = "dead_units"

    def __call__(self, obs: Observation) -> tuple[float, str] | None:
        if obs.kind != ACTIVATION or obs.stats is None or _nonfinite(obs.stats):
            return None  # NaN never counts as alive: the tripwire reports those
        if not obs.stats.dtype.startswith(("float", "bfloat")):
            return None
        if not self.logits and is_logits(obs.key):
            return None
        share = obs.stats.dead_fraction
        if share is not None and share > self.fraction:
            return share, (
                f"{obs.stats.dead}/{obs.stats.units} units dead ({share:.0%} > {self.fraction:.0%})"
            )
        return None


@dataclass(frozen=True)
class Saturation:
    """A tanh/sigmoid output whose root-mean-square distance from the middle of its range,
    as a share of the half-range, is at least `threshold` (1.0: every value at a bound).
    From the statistics alone: rms((y - c) / h) = sqrt(var + (mean - c)^2) / h."""

    threshold: float = 0.95
    name = "saturation"

    def __call__(self, obs: Observation) -> tuple[float, str] | None:
        bounds = BOUNDED.get(obs.module_class or "")
        s = obs.stats
        if obs.kind != ACTIVATION or bounds is None or s is None or s.mean is None or not s.numel:
            return None
        if _nonfinite(s):
            return None
        centre, half = (bounds[0] + bounds[1]) / 2, (bounds[1] - bounds[0]) / 2
        var = (s.std or 0.0) ** 2 * (s.numel - 1) / s.numel
        share = math.sqrt(var + (s.mean - centre) ** 2) / half
        if share >= self.threshold:
            return share, f"{obs.module_class} output at its bounds (rms {share:.3f} of range)"
        return None


@dataclass(frozen=True)
class UpdateRatio:
    """Weight matrices by default (`min_dims=2`): biases and norms start at or near zero, so
    their ratio says little."""

    low: float = 1e-8
    high: float = 1e-1
    min_dims: int = 2
    name = "update_ratio"

    def __call__(self, obs: Observation) -> tuple[float, str] | None:
        if obs.kind != UPDATE or obs.value is None or (obs.dims or 0) < self.min_dims:
            return None
        if not math.isfinite(obs.value):
            return None
        if obs.value > self.high:
            return obs.value, f"update/weight ratio {obs.value:.3g} > {self.high:g}"
        if obs.value < self.low:
            return obs.value, f"update/weight ratio {obs.value:.3g} < {self.low:g}"
        return None


def default_rules() -> list[Rule]:
    return [VanishingGradient(), ExplodingGradient(), DeadUnits(), Saturation(), UpdateRatio()]


def rule_name(rule: Callable[..., Any]) -> str:
    return str(getattr(rule, "name", getattr(rule, "__name__", type(rule).__name__)))


def apply_rules(
    rules: Sequence[Callable[[Observation], tuple[float, str] | None]],
    observations: Sequence[Observation],
    *,
    step: int,
    rank: int,
) -> list[RuleHit]:
    hits = []
    for obs in observations:
        for rule in rules:
            found = rule(obs)
            if found is not None:
                value, message = found
                hits.append(RuleHit(rule_name(rule), step, rank, obs.key, float(value), message))
    return hits


def _grad_norm(obs: Observation) -> float | None:
    """The norm of a gradient that holds finite values only, else None."""
    if obs.kind not in (GRADIENT, PARAM_GRAD) or obs.stats is None or _nonfinite(obs.stats):
        return None
    return obs.stats.norm


def _nonfinite(stats: TensorStats) -> bool:
    return bool(stats.nan or stats.inf)
