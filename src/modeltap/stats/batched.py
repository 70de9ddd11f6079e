"""The batched path: many small CPU float tensors at once, from one float64 array and a handful
of segmented reductions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modeltap.stats.tensor import HIST_BINS, TensorStats, dtype_name, hist_edges, rows_to_keep

if TYPE_CHECKING:
    import torch

# Tensors up to this many elements are worth taking together in `batch_stats`. Past it, the
# per-tensor path's single pass is faster than the float64 copy and passes of the batched one
# (us per tensor, batched against alone, on this 2-core machine: 256 elements 10 vs 27, 1,024 18
# vs 28, 4,096 44 vs 31, 65,536 567 vs 98; scripts/bench_stats_block.py --batch). 2^18 made a
# recorded step of a MiniLM-sized model (8 x 64 x 384 outputs) spend 1.6 ms a tensor, not 0.2.
BATCH_ELEMENTS = 1 << 11


def batchable(x: torch.Tensor) -> bool:
    import torch

    return (
        x.device.type == "cpu"
        and 0 < x.numel() <= BATCH_ELEMENTS
        and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    )


def batched(
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
        if batchable(x):
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
            segment += np.searchsorted(hist_edges(), flat, side="right")
            hists = np.bincount(segment, minlength=len(arrays) * HIST_BINS)
            hists = hists.reshape(len(arrays), HIST_BINS).tolist()
        # The per-tensor numbers as moments_into has them, for all tensors at once.
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
                keep = rows_to_keep(x, row_mask)
                if keep is not None:
                    rows = rows[keep.numpy()]
                dead = units
                if rows.shape[0]:
                    unit_max = rows.max(axis=0)
                    dead = int(np.count_nonzero(unit_max <= unit_max.dtype.type(dead_threshold)))
                result.update(units=units, dead=dead)
            results[i] = TensorStats(**result)
    return results
