"""Per-tensor statistics: norms, moments, extremes, NaN/Inf counts and dead units.

Moments are accumulated in float64 from float32-or-wider pieces, so a bfloat16 tensor gets the
same trustworthy numbers as a float32 one. On the CPU a tensor is read once: a block of `BLOCK`
elements at a time (float32/float64 in place, narrower or integer types widened a block at a time
into a reused buffer), every statistic taken from the block while it is in cache, the blocks
combined in float64. The moments are within float32 rounding of a float64 reference (tested to
1e-7 relative for the mean and norm, 2e-7 for the standard deviation); extremes, counts, dead
units and histograms are exact. Small tensors (up to BATCH_ELEMENTS) take segmented float64
reductions instead, many at once in `batch_stats` and with the same bits one at a time. On other
devices everything runs as queued kernels, exact in float64, ending in one small vector: a CUDA
tensor costs one transfer of a few numbers (`begin_stats`, then `PendingStats.result`), never one
sync per statistic.

With `hist=True` each tensor also gets a small fixed-bin histogram (`HIST_EDGES`), counted from
the same values in the same loop as its moments.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Elements converted to a wider dtype (and reduced) at a time on a device (CPU: BLOCK).
CHUNK_ELEMENTS = 1 << 22

# Histogram bin edges: signed, log-spaced magnitudes, two bins a decade from 1e-6 to 1e4, so that
# one fixed set of bins serves every tensor of every model and two histograms can be laid side by
# side. Bin i holds edges[i-1] <= x < edges[i]: bin 0 everything below -1e4 (-inf included), the
# middle bin -1e-6 <= x < 1e-6 (zeros), the last 1e4 and above (+inf). NaN is counted in `nan` only.
_MAGNITUDES = tuple(10.0 ** (k / 2) for k in range(-12, 9))
HIST_EDGES: tuple[float, ...] = (*(-m for m in reversed(_MAGNITUDES)), *_MAGNITUDES)
HIST_BINS = len(HIST_EDGES) + 1


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor. Moments and extremes are over its finite values only."""

    shape: list[int]
    dtype: str
    numel: int
    norm: float | None = None
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    nan: int = 0
    inf: int = 0
    zeros: int | None = None
    units: int | None = None
    dead: int | None = None
    hist: list[int] | None = None  # counts per bin of HIST_EDGES, with --hist

    @property
    def absmax(self) -> float | None:
        if self.min is None or self.max is None:
            return None
        return max(abs(self.min), abs(self.max))

    @property
    def dead_fraction(self) -> float | None:
        if self.dead is None or not self.units:
            return None
        return self.dead / self.units

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: its deep copy was most of the cost of a header with many keys.
        return {k: v for k in _FIELDS if (v := getattr(self, k)) is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorStats:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})


_FIELDS = tuple(TensorStats.__dataclass_fields__)


@dataclass
class _Moments:
    """Running count, mean and sum of squared deviations (Chan et al.'s parallel combination)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, n: int, mean: float, m2: float) -> None:
        if n == 0:
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (cached: naming a dtype costs more than the rest of a small
    tensor's bookkeeping)."""
    return str(dtype).removeprefix("torch.")


def tensor_stats(
    tensor: torch.Tensor,
    *,
    dead_threshold: float = 0.0,
    row_mask: torch.Tensor | None = None,
    count_zeros: bool = False,
    hist: bool = False,
) -> TensorStats:
    """Statistics of `tensor`.

    Dead units: for a tensor with 2 or more dims a unit is one index of the last dim; it is dead
    when its value is <= `dead_threshold` at every position of the other dims. `row_mask` (bool,
    the shape of the tensor's first two dims, e.g. an attention mask) leaves padded positions out.
    `hist`: also count the values in the bins of HIST_EDGES (every position, masked or not).
    """
    return begin_stats(
        tensor,
        dead_threshold=dead_threshold,
        row_mask=row_mask,
        count_zeros=count_zeros,
        hist=hist,
    ).result()


@dataclass
class PendingStats:
    """Statistics whose numbers may still be on the tensor's device, as one float64 vector.

    `result()` brings them over (one transfer) and finishes on the host; a caller that already
    copied `numbers` to the host (non-blocking, behind a CUDA event) passes them in as a list.
    """

    base: dict[str, Any]
    numbers: torch.Tensor | None = None
    chunks: int = 0
    units: int | None = None
    count_zeros: bool = False
    done: TensorStats | None = None
    hist: torch.Tensor | None = None  # counts per bin, still on the device

    def result(self, numbers: list[float] | None = None) -> TensorStats:
        if self.done is None:
            if numbers is None:  # else the caller copied them and let go of `self.numbers`
                assert self.numbers is not None
                numbers = self.numbers.tolist()
            self.done = self._finish(numbers)
            self.numbers = None
            if self.hist is not None:
                self.done = replace(self.done, hist=self.hist.tolist())
                self.hist = None
        return self.done

    def _finish(self, values: list[float]) -> TensorStats:
        result: dict[str, Any] = dict(self.base, nan=0, inf=0)
        width = _WIDTH + self.count_zeros
        moments = _Moments()
        lo, hi = math.inf, -math.inf
        nonzero = 0
        for i in range(self.chunks):
            n, mean, m2, clo, chi, nan, inf = values[i * width : i * width + _WIDTH]
            result["nan"] += int(nan)
            result["inf"] += int(inf)
            if n:
                moments.add(int(n), mean, m2)
                lo, hi = min(lo, clo), max(hi, chi)
            if self.count_zeros:
                nonzero += int(values[i * width + _WIDTH])
        _moments_into(result, moments, lo, hi)
        if self.count_zeros:
            result["zeros"] = self.base["numel"] - nonzero
        if self.units is not None:
            result.update(units=self.units, dead=int(values[-1]))
        return TensorStats(**result)


def _moments_into(result: dict[str, Any], moments: _Moments, lo: float, hi: float) -> None:
    if moments.n:
        n, mean, m2 = moments.n, moments.mean, moments.m2
        std = math.sqrt(m2 / (n - 1)) if n > 1 else 0.0
        # Both terms are >= 0: the norm needs no extra pass and loses nothing to cancellation.
        norm = math.sqrt(m2 + n * mean * mean)
        result.update(norm=norm, mean=mean, std=std, min=lo, max=hi)


# Numbers per chunk of the device path: finite count, mean and m2 of the finite values, min, max,
# NaN count, Inf count (then the non-zero count when counting zeros); one dead-unit count closes
# the vector.
_WIDTH = 7


def begin_stats(
    tensor: torch.Tensor,
    *,
    dead_threshold: float = 0.0,
    row_mask: torch.Tensor | None = None,
    count_zeros: bool = False,
    hist: bool = False,
) -> PendingStats:
    """Start the statistics of `tensor`; `.result()` finishes them.

    A CPU tensor is done at once. On another device this only queues kernels, and the caller may
    bring `numbers` to the host however it likes (they are never needed twice).
    """
    import torch

    x = tensor.detach()
    base = {"shape": list(x.shape), "dtype": dtype_name(x.dtype), "numel": x.numel()}
    if x.numel() == 0:
        return PendingStats(base, done=TensorStats(**base))
    if x.is_complex():
        norm = float(torch.linalg.vector_norm(x.to(torch.complex128)))
        return PendingStats(base, done=TensorStats(**base, norm=norm))
    options = {
        "dead_threshold": dead_threshold,
        "row_mask": row_mask,
        "count_zeros": count_zeros,
        "hist": hist,
    }
    if x.device.type == "cpu":
        if _batchable(x):  # small: the same numbers as among others in batch_stats
            done = _batched([x], dead_threshold, row_mask, [count_zeros], hist)[0]
            if done is not None:
                return PendingStats(base, done=done)
        return PendingStats(base, done=_cpu_stats(x, base, **options))
    return _device_stats(x, base, **options)


# Tensors up to this many elements are worth taking together in `batch_stats`. Past it, the
# per-tensor path's single pass is faster than the float64 copy and passes of the batched one
# (us per tensor, batched against alone, on this 2-core machine: 256 elements 10 vs 27, 1,024 18
# vs 28, 4,096 44 vs 31, 65,536 567 vs 98; scripts/bench_stats_block.py --batch). 2^18 made a
# recorded step of a MiniLM-sized model (8 x 64 x 384 outputs) spend 1.6 ms a tensor, not 0.2.
BATCH_ELEMENTS = 1 << 11


def batch_stats(
    tensors: list[torch.Tensor],
    *,
    dead_threshold: float = 0.0,
    row_mask: torch.Tensor | None = None,
    count_zeros: list[bool] | None = None,
    hist: bool = False,
) -> list[TensorStats]:
    """`tensor_stats` of many small CPU tensors at once.

    Per tensor, a few reductions cost less than the calls that start them: a model of a hundred
    modules on a short input spent as long on its statistics as on its forward. Here the moments,
    extremes and zero counts of every small float tensor come from one float64 array and a handful
    of segmented reductions (exact extremes and counts; moments accumulated in float64, two-pass),
    and only the dead units are taken tensor by tensor. Tensors with NaN/Inf, and any other kind
    (integers, large or non-CPU tensors), go through `tensor_stats`.
    """
    zeros_wanted = count_zeros or [False] * len(tensors)
    results = _batched(tensors, dead_threshold, row_mask, zeros_wanted, hist)
    return [
        done
        if done is not None
        else tensor_stats(
            tensors[i],
            dead_threshold=dead_threshold,
            row_mask=row_mask,
            count_zeros=zeros_wanted[i],
            hist=hist,
        )
        for i, done in enumerate(results)
    ]


def _batchable(x: torch.Tensor) -> bool:
    import torch

    return (
        x.device.type == "cpu"
        and 0 < x.numel() <= BATCH_ELEMENTS
        and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    )


def _batched(
    tensors: list[torch.Tensor],
    dead_threshold: float,
    row_mask: torch.Tensor | None,
    zeros_wanted: list[bool],
    hist: bool = False,
) -> list[TensorStats | None]:
    """`batch_stats` of the small float tensors without NaN/Inf; None for the others. A tensor's
    numbers do not depend on the others in the batch (each segment is reduced on its own), so a
    batch of one gives the same bits."""
    import numpy as np
    import torch

    results: list[TensorStats | None] = [None] * len(tensors)
    batched: list[int] = []
    arrays: list[Any] = []
    for i, tensor in enumerate(tensors):
        x = tensor.detach()
        if _batchable(x):
            batched.append(i)
            # Narrower floats are widened as the per-tensor path widens them (exactly).
            arrays.append((x if x.dtype in (torch.float32, torch.float64) else x.float()).numpy())
    if batched:
        counts = np.array([a.size for a in arrays], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
        flat = np.concatenate([a.reshape(-1) for a in arrays], dtype=np.float64)
        with np.errstate(all="ignore"):  # NaN/Inf segments are redone one by one below
            means = np.add.reduceat(flat, offsets) / counts
            deviations = flat - np.repeat(means, counts)
            m2 = np.add.reduceat(np.square(deviations, out=deviations), offsets)
            lows = np.minimum.reduceat(flat, offsets)
            highs = np.maximum.reduceat(flat, offsets)
        nonzero = None
        if any(zeros_wanted[i] for i in batched):
            nonzero = np.add.reduceat(flat != 0, offsets, dtype=np.int64)
        finite = (np.isfinite(means) & np.isfinite(m2)).tolist()
        hists = None
        if hist:  # one pass over all segments: bin index offset by the segment's
            segment = np.repeat(np.arange(len(arrays)) * HIST_BINS, counts)
            segment += np.searchsorted(_hist_edges(), flat, side="right")
            hists = np.bincount(segment, minlength=len(arrays) * HIST_BINS)
            hists = hists.reshape(len(arrays), HIST_BINS).tolist()
        # The per-tensor numbers as _moments_into has them, for all tensors at once.
        stds = np.sqrt(m2 / np.maximum(counts - 1, 1))
        norms = np.sqrt(m2 + counts * means * means)
        numbers = (means, stds, norms, lows, highs)
        columns = zip(*(a.tolist() for a in numbers), strict=True)
        for j, (i, (mean, std, norm, lo, hi)) in enumerate(zip(batched, columns, strict=True)):
            if not finite[j]:
                continue
            x = tensors[i]
            shape = list(x.shape)
            result: dict[str, Any] = {
                "shape": shape,
                "dtype": dtype_name(x.dtype),
                "numel": int(counts[j]),
                "norm": norm,
                "mean": mean,
                "std": std,
                "min": lo,
                "max": hi,
            }
            if zeros_wanted[i] and nonzero is not None:
                result["zeros"] = int(counts[j] - nonzero[j])
            if hists is not None:
                result["hist"] = hists[j]
            if len(shape) >= 2:
                units = shape[-1]
                rows = arrays[j].reshape(-1, units)
                keep = _rows_to_keep(x, row_mask)
                if keep is not None:
                    rows = rows[keep.numpy()]
                dead = units
                if rows.shape[0]:
                    unit_max = rows.max(axis=0)
                    dead = int(np.count_nonzero(unit_max <= unit_max.dtype.type(dead_threshold)))
                result.update(units=units, dead=dead)
            results[i] = TensorStats(**result)
    return results


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's values are reduced in: float32 and float64 as they are, 32- and
    64-bit integers in float64 (exact), the rest in float32 (exact for 16- and 8-bit floats,
    bool and small integers)."""
    import torch

    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype in (torch.int32, torch.int64, torch.uint32, torch.uint64):
        return torch.float64
    return torch.float32


def _chunks(x: torch.Tensor, units: int | None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows converted to the working dtype) of x.reshape(-1, units), bounded size."""
    rows = x.reshape(-1, units or 1)
    work = _work_dtype(x.dtype)
    step = max(1, CHUNK_ELEMENTS // (units or 1))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step]
        yield start, chunk if chunk.dtype == work else chunk.to(work)


def _cpu_stats(
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

    moments = _Moments()
    lo, hi = math.inf, -math.inf
    nan = inf = nonzero = 0
    unit_max: Any = None
    counts = np.zeros(HIST_BINS, dtype=np.int64) if hist else None
    per_prefix: Any = None  # histogram counts per float32 16-bit prefix (_count_finite_bins)
    units = base["shape"][-1] if x.dim() >= 2 else None
    keep_rows = _rows_to_keep(x, row_mask)
    keep = None if keep_rows is None else keep_rows.numpy()
    for block, rows, columns in _blocks(x, units, block_elements or BLOCK):
        count = block.size
        passed = _block_pass(block)
        if passed is not None:
            mean, m2, block_lo = passed
            moments.add(count, mean, m2)
            lo = min(lo, block_lo)
            values = block
        else:
            # NaN/Inf present (or float32 overflowed): count them; moments of the finite values.
            finite = np.isfinite(block)
            is_nan = np.isnan(block)
            block_nan = int(np.count_nonzero(is_nan))
            nan += block_nan
            inf += count - block_nan - int(np.count_nonzero(finite))
            kept = block[finite].astype(np.float64)
            if kept.size:
                kmean = float(kept.mean())
                moments.add(kept.size, kmean, float(np.square(kept - kmean).sum()))
                lo, hi = min(lo, float(kept.min())), max(hi, float(kept.max()))
            # NaN never makes a unit alive; +inf does, -inf doesn't.
            values = np.where(is_nan, block.dtype.type(-math.inf), block)
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
            if passed is not None and block.dtype == np.float32:
                if per_prefix is None:
                    per_prefix = np.zeros(1 << 16, dtype=np.int64)
                _count_finite_bins(per_prefix, counts, block)
            else:
                _count_bins(counts, block)

    result: dict[str, Any] = dict(base, nan=nan, inf=inf)
    _moments_into(result, moments, lo, hi)
    if count_zeros:
        result["zeros"] = base["numel"] - nonzero
    if counts is not None:
        if per_prefix is not None:
            by_bin = np.bincount(_prefix_bins()[0], weights=per_prefix, minlength=HIST_BINS + 1)
            counts += by_bin[:HIST_BINS].astype(np.int64)
        counts[-1] -= nan  # NaN sorts last: the top bin took them
        result["hist"] = counts.tolist()
    if units is not None:
        # Compared in the working dtype (float32 for narrower ones), as torch compares a tensor
        # with a Python float.
        dead = units
        if unit_max is not None:
            dead = int(np.count_nonzero(unit_max <= unit_max.dtype.type(dead_threshold)))
        result.update(units=units, dead=dead)
    return TensorStats(**result)


# Elements of a block: what one core's share of this machine's cache holds twice over (the block
# and its centred copy). scripts/bench_stats_block.py times each size; 2^17 (512 KB of float32)
# was the fastest here, 2^16 and 2^18 within 10%, 2^20 half as fast.
BLOCK = 1 << 17


def _blocks(x: torch.Tensor, units: int | None, size: int) -> Iterator[tuple[Any, slice, slice]]:
    """(block, its rows, its columns) of x as a [rows, units] numpy array, in row order: whole
    rows when a block holds at least one, else pieces of a row (a 1-D tensor is one row). The
    block is a view where x is float32/float64, else a copy widened exactly (`_work_dtype`) into
    a reused buffer."""
    import numpy as np
    import torch

    width = units or max(1, x.numel())
    work_dtype = _work_dtype(x.dtype)
    work = None if work_dtype == x.dtype else np.dtype(str(work_dtype).removeprefix("torch."))
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


def _device_stats(
    x: torch.Tensor,
    base: dict[str, Any],
    *,
    dead_threshold: float,
    row_mask: torch.Tensor | None,
    count_zeros: bool,
    hist: bool = False,
) -> PendingStats:
    """Exact statistics as queued kernels ending in one float64 vector: masked for NaN/Inf,
    centred, float64; no host sync."""
    import torch

    units = base["shape"][-1] if x.dim() >= 2 else None
    keep = _rows_to_keep(x, row_mask) if units else None
    pieces: list[torch.Tensor] = []
    unit_max: torch.Tensor | None = None
    bins: torch.Tensor | None = None
    edges = torch.tensor(_hist_edges(), dtype=torch.float64, device=x.device) if hist else None
    chunks = 0
    for start, chunk in _chunks(x, units):
        chunks += 1
        values = chunk.to(torch.float64)
        finite = torch.isfinite(values)
        if edges is not None:  # NaN goes to one more bin, dropped at the end
            index = torch.bucketize(values, edges, right=True)
            index.masked_fill_(values.isnan(), HIST_BINS)
            counted = torch.bincount(index.reshape(-1), minlength=HIST_BINS + 1)
            bins = counted if bins is None else bins + counted
        n = finite.sum()
        nan = torch.isnan(values).sum()
        mean = torch.where(finite, values, 0.0).sum() / n.clamp(min=1)
        deviations = torch.where(finite, values - mean, 0.0)
        pieces += [
            n,
            mean,
            deviations.square_().sum(),
            torch.where(finite, values, math.inf).min(),
            torch.where(finite, values, -math.inf).max(),
            nan,
            chunk.numel() - n - nan,
        ]
        if count_zeros:
            pieces.append(torch.count_nonzero(chunk))
        if units:
            # NaN never makes a unit alive; +inf does, -inf doesn't. Left-out rows become -inf
            # rather than being indexed away, which would sync to learn how many remain.
            dropped = torch.isnan(chunk)
            if keep is not None:
                dropped |= ~keep[start : start + chunk.shape[0], None]
            alive = chunk.masked_fill(dropped, -math.inf).amax(dim=0)
            unit_max = alive if unit_max is None else torch.maximum(unit_max, alive)
    if unit_max is not None:
        pieces.append((unit_max <= dead_threshold).sum())
    numbers = torch.stack([p.to(torch.float64) for p in pieces])
    pending = PendingStats(base, numbers, chunks, units, count_zeros)
    pending.hist = None if bins is None else bins[:HIST_BINS]
    return pending


def _rows_to_keep(x: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool per row of x.reshape(-1, units), or None when every row counts."""
    # Checked where the mask lives (a CPU mask costs a CUDA tensor no sync), then moved.
    if not _mask_fits(x, row_mask) or bool(row_mask.all()):  # type: ignore[union-attr]
        return None
    return _kept(x, row_mask)  # type: ignore[arg-type]


def rows_kept(x: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor | None:
    """`_rows_to_keep` without looking at the mask's values (traceable): for a mask known to
    leave some rows out; None when it does not fit x."""
    return _kept(x, row_mask) if _mask_fits(x, row_mask) else None  # type: ignore[arg-type]


def _mask_fits(x: torch.Tensor, row_mask: torch.Tensor | None) -> bool:
    return row_mask is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(row_mask.shape)


def _kept(x: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    mask = row_mask.to(device=x.device, dtype=bool)
    middle = x.shape[2:-1]
    return mask.reshape(*mask.shape, *([1] * len(middle))).expand(*x.shape[:-1]).reshape(-1)


# Elements of a block for `final_stats`, whose tensors are read by two workers at once after a
# compiled forward: each numpy call holds the GIL a moment, and the fewer the calls the better the
# two overlap (`scripts/bench_stats_block.py --final`: 2^17 3.2-4.2 GB/s, 2^19 4.9-5.1), though
# one worker alone is fastest with blocks that stay in its core's cache.
FINAL_BLOCK = 1 << 19


def final_stats(
    tensor: torch.Tensor,
    *,
    dead_threshold: float = 0.0,
    row_mask: torch.Tensor | None = None,
    count_zeros: bool = False,
    hist: bool = False,
) -> TensorStats:
    """`tensor_stats` of a tensor nothing will change any more (a finished compiled forward),
    read where it is, in blocks of FINAL_BLOCK elements: the same fields, equal within float32
    rounding (the blocks' sums are added in another grouping), not to the bit. Other dtypes and
    devices, and small tensors, go through `tensor_stats`."""
    options = {
        "dead_threshold": dead_threshold,
        "row_mask": row_mask,
        "count_zeros": count_zeros,
        "hist": hist,
    }
    import torch

    x = tensor.detach()
    floats = x.dtype in (torch.float32, torch.float64)
    if x.device.type != "cpu" or not floats or not x.numel() or _batchable(x):
        return tensor_stats(x, **options)
    base = {"shape": list(x.shape), "dtype": dtype_name(x.dtype), "numel": x.numel()}
    return _cpu_stats(x, base, block_elements=FINAL_BLOCK, **options)


@functools.cache
def _hist_edges() -> Any:
    import numpy as np

    return np.array(HIST_EDGES, dtype=np.float64)


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
    first, last = (np.searchsorted(_hist_edges(), end, side="right") for end in ends)
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

    index = np.searchsorted(_hist_edges(), values.reshape(-1), side="right")
    counts += np.bincount(index, minlength=HIST_BINS)


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
    rows at a time in the CPU path's working dtype (`_work_dtype`: float32, or float64 for
    float64 and 32- and 64-bit integers), and the rest in float64, the units combined exactly
    (Chan et al.): within float32 rounding of a float64 reference (tested to 1e-7 relative for
    the mean, 2e-7 for the standard deviation and the norm). Extremes and the dead count (in the
    working dtype, as the CPU path compares) are exact."""
    import torch

    if x.numel() == 0:
        return x.new_zeros(0, dtype=torch.float64)
    units = x.shape[-1] if x.dim() >= 2 else 1
    # the dtype the CPU path reduces in (`_work_dtype`); extremes of a float from its own values
    # (the same numbers), of an integer from the widened ones (no min/max for every int dtype)
    work = _work_dtype(x.dtype)
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
    import torch

    base = {"shape": list(shape), "dtype": dtype_name(dtype), "numel": math.prod(shape)}
    if base["numel"] == 0:
        return tensor_stats(torch.empty(shape, dtype=dtype))
    if len(numbers) != 4 + (len(shape) >= 2):
        raise ValueError(f"{len(numbers)} numbers for a tensor of shape {list(shape)}")
    if not all(math.isfinite(v) for v in numbers):
        return None
    mean, m2, lo, hi = numbers[:4]
    n = base["numel"]
    m2 = max(m2, 0.0)  # rounding of an all-equal unit
    result: dict[str, Any] = dict(base, nan=0, inf=0)
    _moments_into(result, _Moments(n, mean, m2), lo, hi)
    if len(shape) >= 2:
        result.update(units=shape[-1], dead=int(numbers[4]))
    return TensorStats(**result)
