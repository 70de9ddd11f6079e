"""`RecordOptions`: what `record(model, out_dir, **options)` takes, declared once with its checks.

`record`'s signature is built from these fields (`with_options`), so a new option is one field
here (and its line in `record`'s docstring), read where it is used as `recording.options.<name>`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from modeltap.errors import InputError
from modeltap.record.rules import Observation, default_rules
from modeltap.selection import Selection

ON_NONFINITE = ("raise", "dump", "warn", "dump-warn", "off")
# What `resume` takes: continue a run, and "truncate": continue it from a step before its last,
# the later steps moved aside.
RESUME = (False, True, "truncate")

RuleFn = Callable[[Observation], "tuple[float, str] | None"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass
class RecordOptions:
    """The options of one recording (what each does: `record`), checked when made."""

    every: int = 100
    grads: bool = True
    params: bool = True
    stats_only: bool = True
    full_every: int | None = None
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    depth: int | None = None
    on_nonfinite: str = "raise"
    # None: `rules.default_rules()`; a list once made
    rules: Sequence[RuleFn] | None = None
    gather: bool = False
    dead_threshold: float = 0.0
    # Given, it is the training's own step number (a framework's global_step): a resumed run
    # keeps it. Left out, a new run starts at 0 and a resumed one after its last step.
    start_step: int | None = None
    hist: bool = False
    # the low-precision what-if figures of each float tensor (stats/formats.py), checked when made
    formats: Sequence[str] = ()
    # every op of the selected modules' own code on recorded steps (record.step_ops)
    ops: bool = False
    eval: bool = False
    eval_batches: int | None = 1
    scaler: Any = None
    resume: bool | str = False
    overwrite: bool = False
    keep_last: int = 8
    # The flight recorder: a forward trip's file lets `modeltap replay` re-run its module. True
    # once made when on_nonfinite is "dump" or "dump-warn".
    flight: bool = False
    # Steps that are not recorded check where non-finite values end up and run again under the
    # full tripwire only when one does (record.sentinel); the flight recorder and "dump" take
    # what they keep from that run, which starts from the step's own RNG states.
    eager_tripwire: bool = False

    def __post_init__(self) -> None:
        every, full_every, eval_batches = self.every, self.full_every, self.eval_batches
        if not isinstance(every, int) or every < 1:
            raise InputError(f"every must be a whole number of steps >= 1, got {every!r}")
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise InputError(f"full_every must be None or a number of steps >= 1, not {full_every}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise InputError(
                f"on_nonfinite must be one of {', '.join(ON_NONFINITE)}, got {self.on_nonfinite!r}"
            )
        if eval_batches is not None and (not isinstance(eval_batches, int) or eval_batches < 1):
            raise InputError(f"eval_batches must be None or >= 1, got {eval_batches!r}")
        if self.resume not in RESUME:
            raise InputError(f"resume must be True, False or 'truncate', got {self.resume!r}")
        if self.resume and self.overwrite:
            raise InputError("resume and overwrite=True exclude each other; pick one")
        start = self.start_step
        if start is not None and (not isinstance(start, int) or start < 0):
            raise InputError(f"start_step must be None or a step number >= 0, got {start!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise InputError(f"keep_last must be a number of steps >= 0, got {self.keep_last!r}")
        if self.flight and self.on_nonfinite == "off":
            raise InputError("flight=True needs the tripwire; drop on_nonfinite='off'")
        self.flight = self.flight or self.on_nonfinite.startswith("dump")
        if self.formats:
            from modeltap.stats.formats import check_formats

            self.formats = tuple(check_formats(self.formats))
        self.rules = list(default_rules() if self.rules is None else self.rules)

    def selection(self) -> Selection:
        return Selection(self.depth, tuple(self.include), tuple(self.exclude))

    def settings(self) -> dict[str, Any]:
        """What the run's index and files record of the options (a resumed run must match)."""
        return {
            "every": self.every,
            "full_every": self.full_every,
            "grads": self.grads,
            "params": self.params,
            "gather": self.gather,
            "on_nonfinite": self.on_nonfinite,
            "flight": self.flight,
        }


def with_options(func: F) -> F:
    """`func(model, out_dir, **options)` shown with each option as a keyword of its own (`help`,
    editors and `inspect.signature` read `every: int = 100, ...` as if it were written out)."""
    signature = inspect.signature(func)
    named = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in dataclasses.fields(RecordOptions)
    ]
    func.__signature__ = signature.replace(parameters=[*named, *options])  # type: ignore[attr-defined]
    return func
