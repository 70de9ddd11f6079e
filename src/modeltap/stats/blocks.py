"""The CPU path: a tensor read once, a cache-sized block at a time, every statistic (moments,
extremes, dead units, zeros, histogram) taken from the block while it is in cache."""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from modeltap.stats.tensor import (
    HIST_BINS,
    Moments,
    TensorStats,
    hist_edges,
    moments_into,
    rows_to_keep,
    work_dtype,
)

if TYPE_CHECKING:
    import torch


def cpu_stats(
    x: torch.Tensor,
    base: dict[str, Any],
    *,
    dead_threshold: float,
    row_mask: torch.Tensor | None,
    count_zeros: bool,
    hist: bool = False,
    block_elements: int | None = None,
) -> TensorStats:
    """The CPU path, in one read of the tensor's memory.

    The values are taken a block of about `BLOCK` (or `block_elements`) elements at a time (whole
    rows of the last dim, or pieces of one row when a row is longer), and everything is done to a
    block while it is in the core's cache: its sum, its square sum about the mean (`_block_pass`),
    its min, the per-unit max, zeros and histogram counts. Blocks combine in float64 (Chan et
    al.), which is as accurate as one two-pass over the whole tensor or better; the last bits
    depend on the block size and on nothing else (not the layout, nor the thread). Narrower
    dtypes are widened a block at a time into a reused buffer (`_blocks`).
    """
    import numpy as np

    moments = Moments()
    lo, hi = math.inf, -math.inf
    nan = inf = nonzero = 0
    unit_max: Any = None
    counts = np.zeros(HIST_BINS, dtype=np.int64) if hist else None
    per_prefix: Any = None  # histogram counts per float32 16-bit prefix (_count_finite_bins)
    units = base["shape"][-1] if x.dim() >= 2 else None
    keep_rows = rows_to_keep(x, row_mask)
    keep = None if keep_rows is None else keep_rows.numpy()
    for block, rows, columns in _blocks(x, units, block_elements or BLOCK):
        count = block.size
        passed = _block_pass(block)
        if passed is not None:
            mean, m2, block_lo = passed
            moments.add(count, mean, m2)
            lo = min(lo, block_lo)
            values = block
        else:  # NaN/Inf present (or float32 overflowed)
            block_nan, block_inf, block_lo, block_hi, values = _nonfinite_block(block, moments)
            nan, inf = nan + block_nan, inf + block_inf
            lo, hi = min(lo, block_lo), max(hi, block_hi)
        alive = None
        if units is not None:
            alive = values.max(axis=0)
            if passed is not None:
                hi = max(hi, float(alive.max()))  # the per-unit maxima give the max as well
            if keep is not None:
                kept_rows = values[keep[rows]]
                alive = kept_rows.max(axis=0) if kept_rows.shape[0] else None
            if alive is not None:
                if unit_max is None:
                    unit_max = np.full(units, -np.inf, dtype=alive.dtype)
                np.maximum(unit_max[columns], alive, out=unit_max[columns])
        elif passed is not None:
            hi = max(hi, float(block.max()))
        if count_zeros:
            nonzero += int(np.count_nonzero(block))
        if counts is not None:
            per_prefix = _histogram_block(counts, per_prefix, block, passed is not None)

    result: dict[str, Any] = dict(base, nan=nan, inf=inf)
    moments_into(result, moments, lo, hi)
    if count_zeros:
        result["zeros"] = base["numel"] - nonzero
    if counts is not None:
        result["hist"] = _histogram(counts, per_prefix, nan)
    if units is not None:
        # Compared in the working dtype (float32 for narrower ones), as torch compares a tensor
        # with a Python float.
        dead = units
        if unit_max is not None:
            dead = int(np.count_nonzero(unit_max <= unit_max.dtype.type(dead_threshold)))
        result.update(units=units, dead=dead)
    return TensorStats(**result)


def _nonfinite_block(block: Any, moments: Moments) -> tuple[int, int, float, float, Any]:
    """A block with NaN/Inf (or whose float32 sums overflowed): its NaN and Inf counts, the moments
    of its finite values added to `moments`, their min and max, and the values with NaN as -inf
    (NaN never makes a unit alive; +inf does, -inf doesn't)."""
    import numpy as np

    finite = np.isfinite(block)
    is_nan = np.isnan(block)
    nan = int(np.count_nonzero(is_nan))
    inf = block.size - nan - int(np.count_nonzero(finite))
    lo, hi = math.inf, -math.inf
    kept = block[finite].astype(np.float64)
    if kept.size:
        kmean = float(kept.mean())
        moments.add(kept.size, kmean, float(np.square(kept - kmean).sum()))
        lo, hi = float(kept.min()), float(kept.max())
    return nan, inf, lo, hi, np.where(is_nan, block.dtype.type(-math.inf), block)


def _histogram_block(counts: Any, per_prefix: Any, block: Any, finite: bool) -> Any:
    """Count a block's values into the histogram; returns the per-prefix counts (made at the
    first finite float32 block, see `_count_finite_bins`)."""
    import numpy as np

    if finite and block.dtype == np.float32:
        if per_prefix is None:
            per_prefix = np.zeros(1 << 16, dtype=np.int64)
        _count_finite_bins(per_prefix, counts, block)
    else:
        _count_bins(counts, block)
    return per_prefix


def _histogram(counts: Any, per_prefix: Any, nan: int) -> list[int]:
    """The tensor's bin counts: `counts`, plus the per-prefix counts summed by bin, less NaN."""
    import numpy as np

    if per_prefix is not None:
        by_bin = np.bincount(_prefix_bins()[0], weights=per_prefix, minlength=HIST_BINS + 1)
        counts += by_bin[:HIST_BINS].astype(np.int64)
    counts[-1] -= nan  # NaN sorts last: the top bin took them
    return counts.tolist()


# Elements of a block: what one core's share of this machine's cache holds twice over (the block
# and its centred copy). scripts/bench_stats_block.py times each size; 2^17 (512 KB of float32)
# was the fastest here, 2^16 and 2^18 within 10%, 2^20 half as fast.
BLOCK = 1 << 17


def _blocks(x: torch.Tensor, units: int | None, size: int) -> Iterator[tuple[Any, slice, slice]]:
    """(block, its rows, its columns) of x as a [rows, units] numpy array, in row order: whole
    rows when a block holds at least one, else pieces of a row (a 1-D tensor is one row). The
    block is a view where x is float32/float64, else a copy widened exactly (`work_dtype`) into
    a reused buffer."""
    import numpy as np
    import torch

    width = units or max(1, x.numel())
    wide = work_dtype(x.dtype)
    work = None if wide == x.dtype else np.dtype(str(wide).removeprefix("torch."))
    bfloat = x.dtype == torch.bfloat16
    values: Any
    # rows of `width` laid out by numpy (a copy only for a strided tensor): the writer thread
    # that runs this starts no torch parallel op, so no OpenMP team beside the model's
    if bfloat:  # numpy has no bfloat16: its bits are a float32's upper half
        values = x.view(torch.int16).numpy().view(np.uint16).reshape(-1, width)
    else:
        try:
            values = x.numpy().reshape(-1, width)
        except TypeError:  # a dtype numpy lacks (float8): torch widens each block
            values = x.reshape(-1, width)
    step = max(1, size // width)
    span = min(width, size)
    for start in range(0, values.shape[0], step):
        rows = slice(start, start + step)
        for first in range(0, width, span):
            columns = slice(first, first + span)
            block = values[rows, columns] if span < width else values[rows]
            if work is not None:
                n = math.prod(block.shape)
                into = _buffer("widened", work, n)[:n].reshape(block.shape)
                if bfloat:
                    np.left_shift(block, 16, out=into.view(np.uint32), dtype=np.uint32)
                elif isinstance(block, torch.Tensor):
                    torch.from_numpy(into).copy_(block)
                else:
                    np.copyto(into, block, casting="unsafe")
                block = into
            yield block, rows, columns


# One reusable buffer per thread and dtype: a fresh temporary per block costs more in page faults
# than the arithmetic itself.
_LOCAL = threading.local()


def _buffer(use: str, dtype: Any, size: int) -> Any:
    import numpy as np

    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = {}
    key = (use, np.dtype(dtype))
    buffer = buffers.get(key)
    if buffer is None or buffer.size < size:
        buffer = buffers[key] = np.empty(max(size, BLOCK), dtype=dtype)
    return buffer


# Rows a block's values are laid in for a sum: each of the block's 1/ROWS-long columns adds ROWS
# values in turn, vectorised across columns (twice the speed of numpy's pairwise sum here), and
# the column sums are then added pairwise. 32 values in turn round no worse than 32 float32
# epsilons, and in practice as little as a pairwise sum (tests/test_stats.py compares with float64).
_SUM_ROWS = 32


def _sum(flat: Any) -> float:
    """The sum of a 1-D numpy array on one core, whatever torch's thread count (so the same bits
    in any thread, and no OpenMP team started beside the model's)."""
    import numpy as np

    whole = flat.size - flat.size % _SUM_ROWS
    if not whole:
        return float(flat.sum())
    total = float(np.add.reduce(flat[:whole].reshape(_SUM_ROWS, -1), axis=0).sum())
    return total + float(flat[whole:].sum()) if whole < flat.size else total


def _square_sum(flat: Any) -> float:
    """`_sum` of the squares of `flat`, the same bits, without writing the squares out: einsum
    multiplies and adds each column's values in turn, as `_sum` adds them (a 2^17-element block
    in cache: 25 GB/s on this machine, against 15 for squares written to a buffer and summed).
    The same bits where numpy's einsum rounds the product before adding it, as this machine's
    does (tests/test_stats.py checks); one that fused them would differ within float32 rounding."""
    import numpy as np

    whole = flat.size - flat.size % _SUM_ROWS
    if whole < _SUM_ROWS * 16:  # einsum loops otherwise (a single column: over its rows)
        return _sum(np.square(flat))
    columns = flat[:whole].reshape(_SUM_ROWS, -1)
    total = float(np.einsum("ij,ij->j", columns, columns).sum())
    return total + float(np.square(flat[whole:]).sum()) if whole < flat.size else total


def _block_pass(block: Any) -> tuple[float, float, float] | None:
    """(mean, centred square sum, min) of a finite block, each read while it is in cache;
    None if it holds NaN/Inf or its sums overflow the dtype. numpy only, on one core.

    The square sum is sum(x^2) - n mean^2 where the mean is small beside the values (n mean^2 at
    most a quarter of sum(x^2): the subtraction then loses under half a bit), else the sum of
    (x - mean)^2, centred into a reused buffer (a mean far from zero would cancel the digits)."""
    import numpy as np

    count = block.size
    flat = block.reshape(-1)
    # +inf and -inf sum to NaN ("invalid value"), large values may overflow: the block is then
    # counted and redone from its finite values, so numpy's warning would only be noise.
    with np.errstate(invalid="ignore", over="ignore"):
        mean = _sum(flat) / count
        if not math.isfinite(mean):
            return None
        total = _square_sum(flat)
        offset = count * mean * mean
        if offset <= total / 4:
            m2 = total - offset
        else:
            squares = _buffer("squares", block.dtype, count)[:count]
            into = squares.reshape(block.shape)
            np.subtract(block, block.dtype.type(mean), out=into)
            np.square(into, out=into)
            m2 = _sum(squares)
    if not math.isfinite(m2):
        return None
    return mean, m2, float(block.min())


# Which half of a float32's bytes holds its sign, exponent and top 7 mantissa bits.
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


@functools.cache
def _prefix_bins() -> tuple[Any, Any, Any]:
    """(bin of every float32 whose top 16 bits are p, or HIST_BINS where an edge or a non-finite
    value splits those floats; the p that are split; a bool per p, split or not). The floats
    sharing their top 16 bits are one interval of values: it lies in one bin when both its ends
    do."""
    import numpy as np

    prefixes = np.arange(1 << 16, dtype=np.uint32) << 16
    with np.errstate(invalid="ignore"):  # NaN prefixes
        ends = [(prefixes | low).view(np.float32).astype(np.float64) for low in (0, 0xFFFF)]
    first, last = (np.searchsorted(hist_edges(), end, side="right") for end in ends)
    whole = (first == last) & np.isfinite(ends[0]) & np.isfinite(ends[1])
    return np.where(whole, first, HIST_BINS), np.flatnonzero(~whole), ~whole


def _count_finite_bins(per_prefix: Any, counts: Any, block: Any) -> None:
    """`_count_bins` of a finite float32 block, several times faster: values are counted per 16-bit
    prefix into `per_prefix` (one bincount; the caller sums those by bin once per tensor), and
    only values in a prefix that an edge splits (well under 1% of normal activations) are compared
    with the edges one by one, into `counts`."""
    import numpy as np

    _, split, is_split = _prefix_bins()
    flat = block.reshape(-1)
    high = flat.view(np.uint16)[_HIGH_HALF::2]
    here = np.bincount(high, minlength=1 << 16)
    per_prefix += here
    if here[split].any():
        _count_bins(counts, flat[is_split.take(high)])


def _count_bins(counts: Any, values: Any) -> None:
    """Add the bin counts of a numpy array (any shape) to `counts`; NaN lands in the top bin."""
    import numpy as np

    index = np.searchsorted(hist_edges(), values.reshape(-1), side="right")
    counts += np.bincount(index, minlength=HIST_BINS)
