"""The device path: exact statistics as queued kernels ending in one float64 vector (no sync per
statistic), finished on the host by `PendingStats.result`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
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

# Elements converted to a wider dtype (and reduced) at a time on a device (CPU: BLOCK).
CHUNK_ELEMENTS = 1 << 22


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
    formats: Any = None  # with --formats: stats.formats.PendingFormats, its sums on the device
    format_numbers: list[float] | None = None  # its sums, where the caller copied them over

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
            if self.formats is not None:
                figures = self.formats.result(self.format_numbers)
                self.done = replace(self.done, formats=figures)
                self.formats = self.format_numbers = None
        return self.done

    def _finish(self, values: list[float]) -> TensorStats:
        result: dict[str, Any] = dict(self.base, nan=0, inf=0)
        width = _WIDTH + self.count_zeros
        moments = Moments()
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
        moments_into(result, moments, lo, hi)
        if self.count_zeros:
            result["zeros"] = self.base["numel"] - nonzero
        if self.units is not None:
            result.update(units=self.units, dead=int(values[-1]))
        return TensorStats(**result)


# Numbers per chunk of the device path: finite count, mean and m2 of the finite values, min, max,
# NaN count, Inf count (then the non-zero count when counting zeros); one dead-unit count closes
# the vector.
_WIDTH = 7


def _chunks(x: torch.Tensor, units: int | None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows converted to the working dtype) of x.reshape(-1, units), bounded size."""
    rows = x.reshape(-1, units or 1)
    work = work_dtype(x.dtype)
    step = max(1, CHUNK_ELEMENTS // (units or 1))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step]
        yield start, chunk if chunk.dtype == work else chunk.to(work)


def device_stats(
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
    keep = rows_to_keep(x, row_mask) if units else None
    pieces: list[torch.Tensor] = []
    unit_max: torch.Tensor | None = None
    bins: torch.Tensor | None = None
    edges = torch.tensor(hist_edges(), dtype=torch.float64, device=x.device) if hist else None
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
