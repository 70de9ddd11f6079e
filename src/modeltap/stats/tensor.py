"""The record every statistics path fills in (`TensorStats`), and what the paths share: the
running moments (`Moments`, `moments_into`), dtype names, the histogram bins, the dtype values are
reduced in, and which rows a row mask keeps."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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
    # with --formats: format -> rel_rmse, sqnr_db, underflow, clipped (stats/formats.py)
    formats: dict[str, dict[str, float | None]] | None = None

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
class Moments:
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


def moments_into(result: dict[str, Any], moments: Moments, lo: float, hi: float) -> None:
    if moments.n:
        n, mean, m2 = moments.n, moments.mean, moments.m2
        std = math.sqrt(m2 / (n - 1)) if n > 1 else 0.0
        # Both terms are >= 0: the norm needs no extra pass and loses nothing to cancellation.
        norm = math.sqrt(m2 + n * mean * mean)
        result.update(norm=norm, mean=mean, std=std, min=lo, max=hi)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's values are reduced in: float32 and float64 as they are, 32- and
    64-bit integers in float64 (exact), the rest in float32 (exact for 16- and 8-bit floats,
    bool and small integers)."""
    import torch

    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype in (torch.int32, torch.int64, torch.uint32, torch.uint64):
        return torch.float64
    return torch.float32


def rows_to_keep(x: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool per row of x.reshape(-1, units), or None when every row counts."""
    # Checked where the mask lives (a CPU mask costs a CUDA tensor no sync), then moved.
    if not _mask_fits(x, row_mask) or bool(row_mask.all()):  # type: ignore[union-attr]
        return None
    return _kept(x, row_mask)  # type: ignore[arg-type]


def rows_kept(x: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor | None:
    """`rows_to_keep` without looking at the mask's values (traceable): for a mask known to
    leave some rows out; None when it does not fit x."""
    return _kept(x, row_mask) if _mask_fits(x, row_mask) else None  # type: ignore[arg-type]


def _mask_fits(x: torch.Tensor, row_mask: torch.Tensor | None) -> bool:
    return row_mask is not None and x.dim() >= 3 and tuple(x.shape[:2]) == tuple(row_mask.shape)


def _kept(x: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    mask = row_mask.to(device=x.device, dtype=bool)
    middle = x.shape[2:-1]
    return mask.reshape(*mask.shape, *([1] * len(middle))).expand(*x.shape[:-1]).reshape(-1)


@functools.cache
def hist_edges() -> Any:
    import numpy as np

    return np.array(HIST_EDGES, dtype=np.float64)
