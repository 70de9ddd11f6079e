"""The in-graph path: statistics as plain torch ops a compiled graph computes where the tensor is
made (`graph_stats`), finished on the host (`stats_from_graph`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from modeltap.stats.tensor import Moments, TensorStats, dtype_name, moments_into, work_dtype

if TYPE_CHECKING:
    import torch

# Rows of `graph_stats` summed in float32 before float64 takes over: the float64 work is a 16th
# of the tensor's, and a partial sum of 16 squares keeps std and norm within 2e-7 of float64's
# (32 rows: 2e-7 exceeded in tests/test_stats.py, 12 GB/s against 11 for a 12 MB tensor compiled
# on this 2-core machine; 8 rows: 1e-7, 9 GB/s).
GRAPH_ROWS = 16


def graph_stats(
    x: torch.Tensor, keep: torch.Tensor | None = None, dead_threshold: float = 0.0
) -> torch.Tensor:
    """The statistics of `x` as plain torch ops, for a compiled graph to compute where `x` is made
    (inductor fuses them into its kernels, and `x` need not leave the graph): one float64 vector,
    [mean, m2 (sum of squared deviations), min, max] and, for 2 or more dims, the dead-unit count
    (`keep`: `rows_kept`). Finish it with `stats_from_graph`.

    It is exact only for a tensor of finite values: a NaN or Inf (or a sum past float32's range)
    makes one of the numbers non-finite, and `stats_from_graph` says None. Moments: each unit
    (last-dim index) is taken relative to its value in the first row, summed over GRAPH_ROWS
    rows at a time in the CPU path's working dtype (`work_dtype`: float32, or float64 for
    float64 and 32- and 64-bit integers), and the rest in float64, the units combined exactly
    (Chan et al.): within float32 rounding of a float64 reference (tested to 1e-7 relative for
    the mean, 2e-7 for the standard deviation and the norm). Extremes and the dead count (in the
    working dtype, as the CPU path compares) are exact."""
    import torch

    if x.numel() == 0:
        return x.new_zeros(0, dtype=torch.float64)
    units = x.shape[-1] if x.dim() >= 2 else 1
    # the dtype the CPU path reduces in (`work_dtype`); extremes of a float from its own values
    # (the same numbers), of an integer from the widened ones (no min/max for every int dtype)
    work = work_dtype(x.dtype)
    rows = x.reshape(-1, units).to(work)
    native = x.reshape(-1, units) if x.is_floating_point() else rows
    alive = None  # what decides dead units, where rows are left out
    if keep is not None and x.dim() >= 2:
        alive = native.masked_fill(~keep[:, None], -math.inf)
    n = rows.shape[0]
    pivot = rows[:1]
    full = n - n % GRAPH_ROWS
    parts = []
    if full:
        # every reduction over the same GRAPH_ROWS rows: inductor makes them one kernel, one read
        parts.append(_unit_reductions(rows, pivot, native, alive, 0, full, GRAPH_ROWS))
    if full < n:
        parts.append(_unit_reductions(rows, pivot, native, alive, full, n, None))
    s1, s2, lo, hi, unit_max = parts[0]
    if len(parts) == 2:
        r1, r2, rlo, rhi, rmax = parts[1]
        s1, s2 = s1 + r1, s2 + r2
        lo, hi = torch.minimum(lo, rlo), torch.maximum(hi, rhi)
        unit_max = torch.maximum(unit_max, rmax)
    unit_shift = s1 / n
    unit_mean = pivot[0].to(torch.float64) + unit_shift
    mean = unit_mean.mean()
    m2 = (s2 - s1 * unit_shift).sum() + n * (unit_mean - mean).square().sum()
    numbers = [mean, m2, lo.amin().to(torch.float64), hi.amax().to(torch.float64)]
    if x.dim() >= 2:  # compared in the working dtype, as the CPU path compares
        numbers.append((unit_max.to(work) <= dead_threshold).sum().to(torch.float64))
    return torch.stack(numbers)


def _unit_reductions(
    rows: torch.Tensor,
    pivot: torch.Tensor,
    native: torch.Tensor,
    alive: torch.Tensor | None,
    start: int,
    stop: int,
    group: int | None,
) -> tuple[torch.Tensor, ...]:
    """Per unit, over rows start:stop: float64 sum and square sum of the deviations from `pivot`,
    min, max, and the max of `alive` (or of the values), each summed `group` rows at a time in
    the rows' dtype first (None: all in float64)."""
    import torch

    width = native.shape[1]
    deviation = rows[start:stop] - pivot
    values = native[start:stop]
    live = values if alive is None else alive[start:stop]
    if group is None:
        deviation = deviation.to(torch.float64)
        s1, s2 = deviation.sum(0), (deviation * deviation).sum(0)
        return s1, s2, values.amin(0), values.amax(0), live.amax(0)
    shape = ((stop - start) // group, group, width)
    deviation, values = deviation.reshape(shape), values.reshape(shape)
    s1 = deviation.sum(1).to(torch.float64).sum(0)
    s2 = (deviation * deviation).sum(1).to(torch.float64).sum(0)
    hi = values.amax(1).amax(0)
    unit_max = hi if alive is None else live.reshape(shape).amax(1).amax(0)
    return s1, s2, values.amin(1).amin(0), hi, unit_max


def stats_from_graph(
    numbers: list[float], shape: list[int], dtype: torch.dtype
) -> TensorStats | None:
    """`TensorStats` from `graph_stats`' numbers for a tensor of `shape` and `dtype`; None when
    a number is not finite (the tensor held a NaN or Inf, or values past 1e19 whose float32 sums
    overflowed: take it by `tensor_stats`); ValueError when they are not `graph_stats`' numbers
    for that shape."""
    base = {"shape": list(shape), "dtype": dtype_name(dtype), "numel": math.prod(shape)}
    if base["numel"] == 0:  # what tensor_stats says of an empty tensor
        return TensorStats(**base)
    if len(numbers) != 4 + (len(shape) >= 2):
        raise ValueError(f"{len(numbers)} numbers for a tensor of shape {list(shape)}")
    if not all(math.isfinite(v) for v in numbers):
        return None
    mean, m2, lo, hi = numbers[:4]
    n = base["numel"]
    m2 = max(m2, 0.0)  # rounding of an all-equal unit
    result: dict[str, Any] = dict(base, nan=0, inf=0)
    moments_into(result, Moments(n, mean, m2), lo, hi)
    if len(shape) >= 2:
        result.update(units=shape[-1], dead=int(numbers[4]))
    return TensorStats(**result)
