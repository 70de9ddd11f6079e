"""Throughput of the statistics alone against this machine's memcpy, per block size.

    .venv/bin/python scripts/bench_stats_block.py [--reps 5] [--blocks 15,16,17,18,19] [--hist]
    .venv/bin/python scripts/bench_stats_block.py --final  # final_stats on two workers
    .venv/bin/python scripts/bench_stats_block.py --batch  # where batch_stats should stop batching

The tensors are shaped like bert-base's outputs on 8 x 128 (per layer ten [8,128,768] and two
[8,128,3072], twelve layers: 144 tensors, 679 MB of float32, seed 0), in float32 and in bfloat16.
It times, in this process with one torch thread (median of --reps): a memcpy of each tensor into
a buffer allocated beforehand (numpy `copyto`, the machine's single-core copy speed), and
`tensor_stats` of each tensor (what a dump's writer thread does) for each block of 2^k elements
(`modeltap.stats.blocks.BLOCK`), with --hist too. GB/s are bytes of the tensor read per second; a
memcpy also writes as many. The statistics' numbers differ between block sizes only in float32
rounding.

With --final it times instead `final_stats` of the float32 tensors on two workers at once (what
`dump --compile --stats-only` does with a finished graph's tensors), for each block of 2^k elements
(`modeltap.stats.measure.FINAL_BLOCK`).

With --batch it times instead, per tensor size, `batch_stats` of 100 tensors taken together (the
batched path) against each alone (the per-tensor path): `modeltap.stats.batched.BATCH_ELEMENTS` is
where the second becomes the faster.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", default="15,16,17,18,19", help="exponents k of 2^k elements")
    parser.add_argument("--hist", action="store_true", help="also time statistics with --hist")
    parser.add_argument("--batch", action="store_true", help="the batched path's crossover")
    parser.add_argument("--final", action="store_true", help="final_stats on two workers")
    args = parser.parse_args()

    import numpy as np
    import torch

    import modeltap.stats as stats

    if args.batch:
        batch_crossover(stats, args.reps)
        return

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tensors = []
    for _ in range(12):
        tensors += [torch.randn(8, 128, 768) for _ in range(10)]
        tensors += [torch.randn(8, 128, 3072) for _ in range(2)]
    gigabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e9

    def median_seconds(run) -> float:
        times = []
        for _ in range(args.reps + 1):  # the first is a warm-up
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    target = np.empty(max(t.numel() for t in tensors), dtype=np.float32)

    def memcpy() -> None:
        for t in tensors:
            np.copyto(target[: t.numel()], t.numpy().reshape(-1))

    copy = gigabytes / median_seconds(memcpy)
    print(f"{len(tensors)} tensors, {gigabytes * 1e3:.0f} MB float32, one torch thread")
    print(f"memcpy (numpy copyto into a buffer): {copy:.2f} GB/s")
    if args.final:
        final_blocks(stats, tensors, gigabytes, args.blocks, median_seconds)
        return
    print(f"{'block':>8} {'dtype':>9} {'stats GB/s':>11} {'of memcpy':>10} {'+hist GB/s':>11}")
    setting = stats.blocks.BLOCK
    try:
        for dtype in (torch.float32, torch.bfloat16):
            typed = [t.to(dtype) for t in tensors]
            size = sum(t.numel() * t.element_size() for t in typed) / 1e9
            for k in (int(k) for k in args.blocks.split(",")):
                stats.blocks.BLOCK = 1 << k
                plain = size / median_seconds(
                    lambda typed=typed: [stats.tensor_stats(t) for t in typed]
                )
                hist = (
                    size
                    / median_seconds(
                        lambda typed=typed: [stats.tensor_stats(t, hist=True) for t in typed[:12]]
                    )
                    * 12
                    / len(typed)
                    if args.hist
                    else math.nan
                )
                name = str(dtype).removeprefix("torch.")
                print(
                    f"{'2^' + str(k):>8} {name:>9} {plain:>11.2f} {plain / copy:>9.0%} "
                    f"{hist:>11.2f}"
                )
    finally:
        stats.blocks.BLOCK = setting


def final_blocks(stats, tensors, gigabytes: float, blocks: str, median_seconds) -> None:  # noqa: ANN001
    from concurrent.futures import ThreadPoolExecutor

    setting = stats.measure.FINAL_BLOCK
    print(f"{'block':>8} {'final_stats GB/s, two workers':>30}")
    try:
        with ThreadPoolExecutor(2) as pool:
            for k in (int(k) for k in blocks.split(",")):
                stats.measure.FINAL_BLOCK = 1 << k
                seconds = median_seconds(lambda: list(pool.map(stats.final_stats, tensors)))
                print(f"{'2^' + str(k):>8} {gigabytes / seconds:>30.2f}")
    finally:
        stats.measure.FINAL_BLOCK = setting


def batch_crossover(stats, reps: int) -> None:  # noqa: ANN001 - the module
    import torch

    torch.manual_seed(0)
    setting = stats.batched.BATCH_ELEMENTS
    print(f"{'elements':>9} {'batched us/tensor':>18} {'alone us/tensor':>16}")
    try:
        for k in range(8, 19, 2):
            tensors = [torch.randn((1 << k) // 64, 64) for _ in range(100)]
            row = []
            for limit in (1 << 18, 1):  # everything batched; nothing batched
                stats.batched.BATCH_ELEMENTS = limit
                times = []
                for _ in range(reps + 1):  # the first is a warm-up
                    start = time.perf_counter()
                    for s in stats.batch_stats(tensors):
                        s.result() if hasattr(s, "result") else s
                    times.append(time.perf_counter() - start)
                row.append(statistics.median(times[1:]) / len(tensors) * 1e6)
            print(f"{1 << k:>9} {row[0]:>18.1f} {row[1]:>16.1f}")
    finally:
        stats.batched.BATCH_ELEMENTS = setting


if __name__ == "__main__":
    main()
