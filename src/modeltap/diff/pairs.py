"""One tensor of A against its match in B: the errors and the allclose verdict (`compare`).

The metrics are one code for torch tensors in memory and for numpy arrays read from dumps without
torch (`_Ops` holds what differs between the two).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from modeltap.diff.tolerance import Tolerance


@dataclass
class Pair:
    """The comparison of one tensor of A with its match in B."""

    key: str
    other: str
    status: str  # ok | differs | shape | dtype
    shape: list[int]
    dtype: str
    other_shape: list[int] | None = None
    other_dtype: str | None = None
    atol: float = 0.0
    rtol: float = 0.0
    max_abs: float | None = None
    mean_abs: float | None = None
    max_rel: float | None = None
    mean_rel: float | None = None
    cosine: float | None = None
    out_fraction: float | None = None
    out_count: int | None = None
    numel: int = 0
    nan_mismatch: int = 0
    aliases: list[str] = field(default_factory=list)
    # max |a - b| / max |b|: the error on the tensor's own scale, comparable across modules
    max_scaled: float | None = None
    # max over elements of |a - b| / (atol + scaled_atol * max|b| + rtol * |b|): the elementwise
    # rule's margin, above 1 out of tolerance (inf where a NaN or Inf does not match)
    of_limit: float | None = None
    # how `other` was found when it is not `key` itself: "mapped" (--map) or "structural" (the
    # same module's output, named parts on one side and positional ones on the other)
    match: str | None = None
    # with --formats on either side: format -> {"a": figures, "b": figures} (diff/formats.py)
    formats: dict[str, dict[str, Any]] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != []}


class _Buffers:
    """Work buffers reused from pair to pair: fresh temporaries per tensor cost more in page
    faults than the arithmetic on them."""

    def __init__(self) -> None:
        self._store: dict[tuple[Any, str], Any] = {}

    def get(self, ops: _Ops, like: Any, name: str, dtype: Any) -> Any:
        held = self._store.get((dtype, name))
        size = ops.numel(like)
        if held is None or ops.numel(held) < size or not ops.same_device(held, like):
            held = ops.empty(size, dtype, like)
            self._store[(dtype, name)] = held
        return held[:size].reshape(like.shape)


class _Ops:
    """What differs between numpy and torch in `compare`; everything else has the same name in
    both (`abs`, `subtract`, `count_nonzero`, `isclose`, `float32`...), so the metrics are one
    code for tensors in memory and for arrays read from dumps without torch."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.numpy = xp.__name__ == "numpy"
        self.boolean = xp.bool_ if self.numpy else xp.bool

    def numel(self, x: Any) -> int:
        return int(x.size) if self.numpy else x.numel()

    def cast(self, x: Any, dtype: Any) -> Any:
        return x.astype(dtype, copy=False) if self.numpy else x.to(dtype)

    def empty(self, size: int, dtype: Any, like: Any) -> Any:
        if self.numpy:
            return self.xp.empty(size, dtype=dtype)
        return self.xp.empty(size, dtype=dtype, device=like.device)

    def same_device(self, a: Any, b: Any) -> bool:
        return self.numpy or a.device == b.device

    def equal(self, a: Any, value: float, out: Any) -> Any:
        return self.xp.equal(a, value, out=out) if self.numpy else self.xp.eq(a, value, out=out)

    def zero_where(self, x: Any, mask: Any) -> None:
        if self.numpy:
            self.xp.putmask(x, mask, 0)
        else:
            x.masked_fill_(mask, 0)

    def norm(self, x: Any) -> float:
        """The L2 norm, accumulated in float64."""
        if self.numpy:
            flat = x.reshape(-1)
            wide = flat.astype(self.xp.complex128 if flat.dtype.kind == "c" else self.xp.float64)
            return float(self.xp.sqrt(self.xp.vdot(wide, wide).real))
        wide = self.xp.complex128 if x.is_complex() else self.xp.float64
        return float(self.xp.linalg.vector_norm(x, dtype=wide))

    def is_float(self, x: Any) -> bool:
        return x.dtype.kind == "f" if self.numpy else x.is_floating_point()

    def equal_all(self, a: Any, b: Any) -> bool:
        return bool(self.xp.array_equal(a, b)) if self.numpy else self.xp.equal(a, b)

    def extremes(self, x: Any) -> tuple[float, float]:
        if self.numpy:
            return float(x.min()), float(x.max())
        low, high = self.xp.aminmax(x)
        return float(low), float(high)

    def is_complex(self, x: Any) -> bool:
        return bool(self.xp.iscomplexobj(x)) if self.numpy else x.is_complex()

    def quiet(self) -> Any:
        """numpy warns where torch is silent (x / 0 is inf or nan in both)."""
        import contextlib

        return self.xp.errstate(all="ignore") if self.numpy else contextlib.nullcontext()


def _ops(x: Any) -> _Ops:
    if type(x).__module__ == "numpy":
        import numpy

        return _Ops(numpy)
    import torch

    return _Ops(torch)


# Float dtypes whose every value float32 holds exactly: a pair of them is compared in float32.
_FLOAT32_EXACT = {"bfloat16", "float16", "float32"}


def compare(
    key: str,
    other: str,
    a: Any,
    b: Any,
    tol: Tolerance,
    *,
    equal_nan: bool = False,
    upcast: bool = False,
    norms: tuple[float | None, float | None] = (None, None),
    buffers: _Buffers | None = None,
    dtypes: tuple[str, str] | None = None,
) -> Pair:
    """Errors and the allclose verdict of one pair; B is the reference (rtol scales |b|).

    `a` and `b` are both torch tensors or both numpy arrays (`dtypes` then names the stored
    dtypes, where an array was widened from bfloat16). `norms` are the L2 norms of a and b when
    already known (a dump's statistics), for the cosine.
    """
    from modeltap.stats import dtype_name

    ops = _ops(a)
    xp = ops.xp
    dtype_a, dtype_b = dtypes or (dtype_name(a.dtype), dtype_name(b.dtype))
    pair = Pair(key, other, "ok", list(a.shape), dtype_a, atol=tol.atol, rtol=tol.rtol)
    atol = tol.atol
    pair.numel = ops.numel(a)
    if tuple(a.shape) != tuple(b.shape):
        pair.status, pair.other_shape = "shape", list(b.shape)
        return pair
    if dtype_a != dtype_b:
        pair.other_dtype = dtype_b
        if not upcast:
            pair.status = "dtype"
            return pair
    if pair.numel == 0:
        return pair
    if dtype_a == dtype_b and ops.is_float(a) and _identical(pair, ops, a, b, tol, norms):
        return pair
    if ops.is_complex(a) or ops.is_complex(b):
        work = xp.complex128
    elif (dtype_a == dtype_b and dtype_a != "float64") or {dtype_a, dtype_b} <= _FLOAT32_EXACT:
        work = xp.float32  # a bfloat16 or float16 against a float32: each value exact there
    else:
        work = xp.float64
    x, y = ops.cast(a, work), ops.cast(b, work)
    buf = buffers or _Buffers()
    real = xp.float64 if work == xp.complex128 else work
    with ops.quiet():
        _metrics(pair, ops, x, y, tol, atol, real, buf, equal_nan, norms)
    pair.out_fraction = pair.out_count / pair.numel
    low_cosine = (
        tol.min_cosine is not None and pair.cosine is not None and pair.cosine < tol.min_cosine
    )
    if pair.out_count or low_cosine:
        pair.status = "differs"
    return pair


def _metrics(
    pair: Pair,
    ops: _Ops,
    x: Any,
    y: Any,
    tol: Tolerance,
    atol: float,
    real: Any,
    buf: _Buffers,
    equal_nan: bool,
    norms: tuple[float | None, float | None],
) -> None:
    """Fill `pair`'s errors and out-of-tolerance count (x, y already in the working dtype)."""
    xp = ops.xp
    diff = buf.get(ops, x, "diff", real)
    if real == x.dtype:
        xp.abs(xp.subtract(x, y, out=diff), out=diff)
    else:  # complex: |x - y| is real
        xp.abs(x - y, out=diff)
    scale = buf.get(ops, y, "scale", real)
    xp.abs(y, out=scale)
    total = float(diff.sum())
    if math.isfinite(total):
        absmax = float(scale.max())
        atol += tol.scaled_atol * absmax
        limit = buf.get(ops, y, "limit", real)
        xp.multiply(scale, tol.rtol, out=limit)
        xp.add(limit, atol, out=limit)
        out = buf.get(ops, x, "out", ops.boolean)
        pair.out_count = int(xp.count_nonzero(xp.greater(diff, limit, out=out)))
        pair.of_limit = _of_limit(ops, xp.divide(diff, limit, out=limit), pair.out_count)
        pair.max_abs = float(diff.max())
        pair.max_scaled = pair.max_abs / absmax if absmax else (0.0 if not pair.max_abs else None)
        pair.mean_abs = total / pair.numel
        flat = diff.reshape(-1)
        squared = float(xp.dot(flat, flat))
        pair.cosine = _cosine(ops, x, y, squared, norms)
        rel = xp.divide(diff, scale, out=limit)
        zeros = int(pair.numel - xp.count_nonzero(scale))
        if zeros:  # relative error is over positions where b != 0
            ops.zero_where(rel, ops.equal(scale, 0, out=out))
        if pair.numel > zeros:
            pair.max_rel = float(rel.max())
            pair.mean_rel = float(rel.sum()) / (pair.numel - zeros)
    else:
        # NaN or Inf somewhere: torch.isclose's semantics, metrics over positions finite on both.
        if tol.scaled_atol:
            finite_y = y[xp.isfinite(y)]
            atol += tol.scaled_atol * (float(abs(finite_y).max()) if ops.numel(finite_y) else 0.0)
        close = xp.isclose(x, y, rtol=tol.rtol, atol=atol, equal_nan=equal_nan)
        pair.out_count = int(xp.count_nonzero(~close))
        nan_x, nan_y = xp.isnan(x), xp.isnan(y)
        mismatch = nan_x ^ nan_y
        if not equal_nan:
            mismatch |= nan_x & nan_y
        pair.nan_mismatch = int(mismatch.sum())
        usable = xp.isfinite(x) & xp.isfinite(y)
        d, sc = ops.cast(diff[usable], xp.float64), ops.cast(scale[usable], xp.float64)
        finite_out = int(xp.count_nonzero(d > atol + tol.rtol * sc))
        if pair.out_count > finite_out:  # a NaN or Inf where the other side has none
            pair.of_limit = math.inf
        elif ops.numel(d):
            pair.of_limit = _of_limit(ops, d / (atol + tol.rtol * sc), pair.out_count)
        if ops.numel(d):
            pair.max_abs = float(d.max())
            pair.mean_abs = float(d.mean())
            nonzero = sc > 0
            if bool(nonzero.any()):
                rel = d[nonzero] / sc[nonzero]
                pair.max_rel, pair.mean_rel = float(rel.max()), float(rel.mean())
    pair.atol = atol  # the absolute tolerance in effect, scale-relative term included


def _of_limit(ops: _Ops, ratio: Any, out_count: int) -> float:
    """The largest |a - b| / limit; 0 / 0 (equal where the limit is 0: atol = 0) counts 0."""
    value = float(ratio.max())
    if math.isnan(value):
        value = float(ops.xp.nan_to_num(ratio, nan=0.0, posinf=math.inf).max())
    return value if value <= 1 or out_count else 1.0  # rounding at the limit: still within


def _identical(
    pair: Pair, ops: _Ops, a: Any, b: Any, tol: Tolerance, norms: tuple[Any, Any]
) -> bool:
    """Fill `pair` for two equal tensors with finite values (what the passes in `_metrics` would
    find, without them: most pairs of a same-dtype comparison are equal); False when not equal."""
    if not ops.equal_all(a, b):
        return False
    low, high = ops.extremes(b)
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    absmax = max(-low, high)
    pair.atol = tol.atol + tol.scaled_atol * absmax
    pair.out_count, pair.out_fraction = 0, 0.0
    pair.max_abs = pair.mean_abs = pair.max_scaled = pair.of_limit = 0.0
    if absmax:  # relative error is over positions where b != 0
        pair.max_rel = pair.mean_rel = 0.0
    known = [n for n in norms if n is not None]
    pair.cosine = _cosine(ops, a, b, 0.0, norms) if len(known) == 2 else 1.0
    return True


def _cosine(
    ops: _Ops, x: Any, y: Any, diff_squared: float, norms: tuple[float | None, float | None]
) -> float:
    """Cosine similarity from squared norms, |a-b|^2 = |a|^2 + |b|^2 - 2 a.b: no extra product
    pass, and the norms often come free from the dumps' statistics."""
    nx, ny = (n if n is not None else ops.norm(t) for n, t in zip(norms, (x, y), strict=True))
    if nx == 0 or ny == 0:
        return 1.0 if nx == ny else 0.0
    return max(-1.0, min(1.0, (nx * nx + ny * ny - diff_squared) / (2 * nx * ny)))


def failure_message(pair: Pair) -> str:
    if pair.status == "shape":
        return f"shape {pair.shape} vs {pair.other_shape}"
    if pair.status == "dtype":
        return f"dtype {pair.dtype} vs {pair.other_dtype} (--upcast compares them anyway)"
    parts = [
        f"{pair.out_count} of {pair.numel} elements out of tolerance "
        f"(atol={pair.atol:g}, rtol={pair.rtol:g})"
    ]
    if pair.max_abs is None:
        parts.append("no position is finite on both sides")
    else:
        parts.append(f"max abs {pair.max_abs:.3g}")
        if pair.max_rel is not None:
            parts.append(f"max rel {pair.max_rel:.3g}")
        if pair.cosine is not None:
            parts.append(f"cosine {pair.cosine:.9f}")
    note = nan_note(pair)
    return "; ".join(parts) + (f"; {note}" if note else "")


def nan_note(pair: Pair) -> str:
    """What NaN did to a pair, with the option that changes it ('' when NaN played no part)."""
    if not pair.nan_mismatch:
        return ""
    return f"{pair.nan_mismatch} NaN mismatches (--equal-nan counts NaN == NaN as equal)"
