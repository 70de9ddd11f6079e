"""`modeltap.diff(a, b, preset=...)`: what `modeltap diff A B` compares, from Python.

Two dump files give `diff_dumps`' report, two generation dumps `diff_generations`' (step by step)
and two run folders of `modeltap.record` `diff_runs`' (step by step, rank by rank); each has
`.passed` and `.to_json()`, and is what the command renders.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from modeltap.errors import InputError

if TYPE_CHECKING:
    from modeltap.diff.dumps import DiffReport
    from modeltap.diff.generations import GenerationDiff
    from modeltap.diff.runs import RunDiff


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    preset: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    scaled_atol: float | None = None,
    min_cosine: float | None = None,
    overrides: Mapping[str, Mapping[str, float]] | None = None,
    map: Sequence[str] = (),
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    equal_nan: bool = False,
    upcast: bool | None = None,
    strict: bool = False,
) -> DiffReport | GenerationDiff | RunDiff:
    """Compare dump `a` with dump `b`, the reference (rtol is relative to |b|, as
    torch.allclose(a, b)), or two generation dumps, or two run folders of `modeltap.record`.

    The tolerance is `preset`'s (see `modeltap diff --help`), else allclose's defaults, with
    `atol`, `rtol`, `scaled_atol`, `min_cosine` over it; `overrides` maps a glob of A's keys to
    the values that differ there (`{"pooler*": {"atol": 1e-3}}`). `upcast` (compare tensors of
    different dtypes) is on when the preset says so, unless given. `map`, `include`, `exclude`
    and `strict` are those of `modeltap diff`, for two dumps.
    """
    from modeltap.diff.tolerance import from_preset, per_key

    tolerance, preset_upcast = from_preset(
        preset, atol=atol, rtol=rtol, scaled_atol=scaled_atol, min_cosine=min_cosine
    )
    by_key = per_key(tolerance, overrides or {})
    for_dumps = {"map": map, "include": include, "exclude": exclude, "strict": strict}
    if Path(a).is_dir() or Path(b).is_dir():
        from modeltap.diff.runs import diff_runs

        given = {**for_dumps, "overrides": by_key, "equal_nan": equal_nan, "upcast": upcast}
        _refuse(given, "can't apply to run folders (their steps are compared by statistics first)")
        if not (Path(a).is_dir() and Path(b).is_dir()):
            raise InputError("give two run folders (or two dump files), not one of each")
        return diff_runs(a, b, tolerance=tolerance)
    from modeltap.diff.generations import diff_generations, is_generation

    upcast = preset_upcast if upcast is None else upcast
    if is_generation(a) or is_generation(b):
        _refuse(for_dumps, "is for one-forward dumps; diff generation dumps without it")
        return diff_generations(
            a, b, tolerance=tolerance, overrides=by_key, equal_nan=equal_nan, upcast=upcast
        )
    from modeltap.diff.dumps import diff_dumps

    return diff_dumps(
        a, b, tolerance=tolerance, overrides=by_key, rename=map, include=include,
        exclude=exclude, equal_nan=equal_nan, upcast=upcast, strict=strict,
    )  # fmt: skip


def _refuse(options: Mapping[str, object], why: str) -> None:
    given = [name for name, value in options.items() if value]
    if given:
        raise InputError(f"{given[0]} {why}")
