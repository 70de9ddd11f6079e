"""The statistics of a tensor, by the path that suits it: `tensor_stats` / `begin_stats` (one
tensor: batched when small, CPU blocks, or queued device kernels), `batch_stats` (many small ones),
`final_stats` (after a compiled forward, larger blocks for two workers)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from modeltap.stats.batched import batchable, batched
from modeltap.stats.blocks import cpu_stats
from modeltap.stats.device import PendingStats, device_stats
from modeltap.stats.tensor import TensorStats, dtype_name

if TYPE_CHECKING:
    import torch


def tensor_stats(
    tensor: torch.Tensor,
    *,
    dead_threshold: float = 0.0,
    row_mask: torch.Tensor | None = None,
    count_zeros: bool = False,
    hist: bool = False,
    formats: tuple[str, ...] = (),
) -> TensorStats:
    """Statistics of `tensor`.

    Dead units: for a tensor with 2 or more dims a unit is one index of the last dim; it is dead
    when its value is <= `dead_threshold` at every position of the other dims. `row_mask` (bool,
    the shape of the tensor's first two dims, e.g. an attention mask) leaves padded positions out.
    `hist`: also count the values in the bins of HIST_EDGES (every position, masked or not).
    `formats`: also what quantizing a float tensor in each would cost (`stats.formats`, every
    position).
    """
    return begin_stats(
        tensor,
        dead_threshold=dead_threshold,
        row_mask=row_mask,
        count_zeros=count_zeros,
        hist=hist,
        formats=formats,
    ).result()


def begin_stats(
    tensor: torch.Tensor,
    *,
    dead_threshold: float = 0.0,
    row_mask: torch.Tensor | None = None,
    count_zeros: bool = False,
    hist: bool = False,
    formats: tuple[str, ...] = (),
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
        done = None
        if batchable(x):  # small: the same numbers as among others in batch_stats
            done = batched([x], dead_threshold, row_mask, [count_zeros], hist)[0]
        if done is None:
            done = cpu_stats(x, base, **options)
        return PendingStats(base, done=with_formats(done, x, formats))
    pending = device_stats(x, base, **options)
    if formats and x.is_floating_point():  # queued on the device: no wait, one transfer
        from modeltap.stats.formats import begin_format_errors

        pending.formats = begin_format_errors(x, formats)
    return pending


def batch_stats(
    tensors: list[torch.Tensor],
    *,
    dead_threshold: float = 0.0,
    row_mask: torch.Tensor | None = None,
    count_zeros: list[bool] | None = None,
    hist: bool = False,
    formats: tuple[str, ...] = (),
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
    results = batched(tensors, dead_threshold, row_mask, zeros_wanted, hist)
    return [
        with_formats(done, tensors[i], formats)
        if done is not None
        else tensor_stats(
            tensors[i],
            dead_threshold=dead_threshold,
            row_mask=row_mask,
            count_zeros=zeros_wanted[i],
            hist=hist,
            formats=formats,
        )
        for i, done in enumerate(results)
    ]


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
    formats: tuple[str, ...] = (),
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
    if x.device.type != "cpu" or not floats or not x.numel() or batchable(x):
        return tensor_stats(x, **options, formats=formats)
    base = {"shape": list(x.shape), "dtype": dtype_name(x.dtype), "numel": x.numel()}
    return with_formats(cpu_stats(x, base, block_elements=FINAL_BLOCK, **options), x, formats)


def format_figures(
    x: torch.Tensor, formats: tuple[str, ...], *, finite: bool | None = None
) -> dict[str, Any]:
    from modeltap.stats.formats import format_errors  # imports torch: only when asked for

    return format_errors(x, formats, finite=finite)


def with_formats(stats: TensorStats, x: torch.Tensor, formats: tuple[str, ...]) -> TensorStats:
    """`stats` with the what-if figures of `formats` (stats/formats.py), for a float tensor."""
    if not formats or not x.is_floating_point() or not x.numel():
        return stats
    finite = not (stats.nan or stats.inf)  # counted already: no pass to look for them again
    return replace(stats, formats=format_figures(x, formats, finite=finite))
