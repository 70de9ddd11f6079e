"""Throughput of the statistics passes for each block size (`modeltap.stats._BLOCK`).

    .venv/bin/python scripts/bench_stats_block.py [--reps 5] [--blocks 16,17,18,19,20]
    .venv/bin/python scripts/bench_stats_block.py --batch  # where batch_stats should stop batching

The tensors are shaped like bert-base's outputs on 8 x 128 (per layer ten [8,128,768] and two
[8,128,3072], twelve layers: 144 tensors, 680 MB of float32, seed 0). For each block of 2^k
elements it times, in this process (median of --reps), `final_stats` of all of them on two
workers, as `dump --compile --stats-only` runs it, and `tensor_stats` of all of them in one thread,
as a dump's writer does. `tensor_stats` gives the same bits whatever the block (checked here);
`final_stats` sums each block in float32 and adds the blocks in float64, so its last bits depend on
the block.

With --batch it times instead, per tensor size, `batch_stats` of 100 tensors taken together (the
batched path) against each alone (the per-tensor path): `modeltap.stats.BATCH_ELEMENTS` is where
the second becomes the faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", default="16,17,18,19,20", help="exponents k of 2^k elements")
    parser.add_argument("--batch", action="store_true", help="the batched path's crossover")
    args = parser.parse_args()

    import torch

    import modeltap.stats as stats

    if args.batch:
        batch_crossover(stats, args.reps)
        return

    torch.manual_seed(0)
    tensors = []
    for _ in range(12):
        tensors += [torch.randn(8, 128, 768) for _ in range(10)]
        tensors += [torch.randn(8, 128, 3072) for _ in range(2)]
    gigabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e9

    def final_on_two_workers() -> None:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(stats.final_stats, tensors))

    def tensor_stats_in_one_thread() -> None:
        for t in tensors:
            stats.tensor_stats(t)

    def median_seconds(run) -> float:
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    print(
        f"{len(tensors)} tensors, {gigabytes * 1e3:.0f} MB, torch threads {torch.get_num_threads()}"
    )
    print(f"{'block':>8} {'final_stats x2 GB/s':>20} {'tensor_stats GB/s':>18}")
    reference = None
    for k in (int(k) for k in args.blocks.split(",")):
        stats._BLOCK = 1 << k
        final = median_seconds(final_on_two_workers)
        plain = median_seconds(tensor_stats_in_one_thread)
        numbers = [stats.tensor_stats(t) for t in tensors[:12]]
        reference = reference or numbers
        same = "" if numbers == reference else "  (tensor_stats bits differ!)"
        print(f"{'2^' + str(k):>8} {gigabytes / final:>20.2f} {gigabytes / plain:>18.2f}{same}")


def batch_crossover(stats, reps: int) -> None:  # noqa: ANN001 - the module
    import torch

    torch.manual_seed(0)
    setting = stats.BATCH_ELEMENTS
    print(f"{'elements':>9} {'batched us/tensor':>18} {'alone us/tensor':>16}")
    try:
        for k in range(8, 19, 2):
            tensors = [torch.randn((1 << k) // 64, 64) for _ in range(100)]
            row = []
            for limit in (1 << 18, 1):  # everything batched; nothing batched
                stats.BATCH_ELEMENTS = limit
                times = []
                for _ in range(reps + 1):  # the first is a warm-up
                    start = time.perf_counter()
                    for s in stats.batch_stats(tensors):
                        s.result() if hasattr(s, "result") else s
                    times.append(time.perf_counter() - start)
                row.append(statistics.median(times[1:]) / len(tensors) * 1e6)
            print(f"{1 << k:>9} {row[0]:>18.1f} {row[1]:>16.1f}")
    finally:
        stats.BATCH_ELEMENTS = setting


if __name__ == "__main__":
    main()
