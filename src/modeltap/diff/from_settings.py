"""A diff as the CLI asks for it: `diff` and `report A B` read two dumps the same way, their
settings (flags < config files) and tolerance values (preset < settings < flags), then
`diff_dumps` with them. (`modeltap.diff(a, b, ...)`, in `verb`, takes the same as keywords.)"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modeltap.config import Settings
    from modeltap.diff.dumps import DiffReport


def diff_settings(
    config: Path | None, *, atol: float | None, rtol: float | None, **flags: Any
) -> tuple[Settings, dict[str, float]]:
    """diff's settings (flags < config files) and tolerance values (preset < settings < flags),
    as `diff`, `report A B` and run diffs all read them: a preset made for comparing dtypes
    (`upcast = true`: bf16, fp16) turns --upcast on unless --no-upcast was given."""
    from modeltap.config import load_settings

    s = load_settings("diff", config_file=config, flags=flags)
    return s, diff_tolerances(s, atol=atol, rtol=rtol, upcast=flags.get("upcast"))


def diff_tolerances(
    s: Settings, *, atol: float | None, rtol: float | None, upcast: bool | None
) -> dict[str, float]:
    """The tolerance values of diff's settings `s` with --atol/--rtol over its preset; a preset
    made for comparing dtypes turns `s.upcast` on unless --upcast/--no-upcast was given."""
    from modeltap.config import read_preset, tolerance_values

    values = tolerance_values(s, atol=atol, rtol=rtol, preset=s.preset)
    if upcast is None and s.preset and read_preset(s.preset).get("upcast"):
        s.upcast = True
    return values


def diff_report(a: Path, b: Path, s: Settings, values: dict[str, float]) -> DiffReport:
    """`diff_dumps` of A and B with diff's settings and tolerance values (see diff_settings)."""
    from modeltap.diff.dumps import diff_dumps
    from modeltap.diff.tolerance import Tolerance, per_key

    tolerance = Tolerance(**values)
    return diff_dumps(
        a,
        b,
        tolerance=tolerance,
        overrides=per_key(tolerance, s.overrides),
        rename=s.map,
        include=s.include,
        exclude=s.exclude,
        equal_nan=s.equal_nan,
        upcast=s.upcast,
        strict=s.strict,
    )
