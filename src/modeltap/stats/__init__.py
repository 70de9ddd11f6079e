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

The paths, one module each: `blocks` (CPU, a cache-sized block at a time), `batched` (many small
CPU tensors at once), `device` (queued kernels, one transfer), `graph` (inside a compiled graph),
and `measure`, which picks among them (`tensor_stats`, `begin_stats`, `batch_stats`, and
`final_stats` after a compiled forward); `tensor` holds the record they fill in (`TensorStats`).
Importing this package imports no torch or numpy. The sizes each path works in (`blocks.BLOCK`,
`batched.BATCH_ELEMENTS`, `device.CHUNK_ELEMENTS`, `measure.FINAL_BLOCK`, `graph.GRAPH_ROWS`) live
in the module that reads them.
"""

from modeltap.stats.device import PendingStats
from modeltap.stats.graph import graph_stats, stats_from_graph
from modeltap.stats.measure import batch_stats, begin_stats, final_stats, tensor_stats
from modeltap.stats.tensor import HIST_BINS, HIST_EDGES, TensorStats, dtype_name, rows_kept

__all__ = [
    "HIST_BINS",
    "HIST_EDGES",
    "PendingStats",
    "TensorStats",
    "batch_stats",
    "begin_stats",
    "dtype_name",
    "final_stats",
    "graph_stats",
    "rows_kept",
    "stats_from_graph",
    "tensor_stats",
]
