"""Throughput and memory of `modeltap diff` on two ~1 GB dumps (issue #4's figure).

    .venv/bin/python scripts/bench_diff.py [--folder DIR]

Builds a bert-base-sized BertModel (BertConfig(), seed 0), dumps it on a 16 x 128 batch (about
1.2 GB), dumps it again with one weight of the last layer nudged, reads both files once so they sit
in the page cache, then times diff_dumps in this process. Throughput is the bytes of tensor data
compared (both files) per second; target >= 1 GB/s. Peak memory is the rise of this process's
anonymous resident memory during the diff (RssAnon, sampled; the memory-mapped page cache is not
the diff's own), which should stay near the largest pair rather than the dump size.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path


def rss_anon() -> int:
    """Anonymous resident memory: what the diff allocates, leaving out the page cache it maps."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


class PeakSampler(threading.Thread):
    """Samples RssAnon every 2 ms (Linux keeps no high-water mark for it)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss_anon()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, rss_anon())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", help="where to write the two dumps (default: a temp dir)")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    import torch
    from transformers import BertConfig, BertModel

    from modeltap.diff import diff_dumps
    from modeltap.dump import load_dump
    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs

    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        model = BertModel(BertConfig()).eval()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, 128), generator=gen)
        inputs = Inputs((), {"input_ids": ids}, {"bench": "diff"})
        a = dump_model(model, inputs, folder / "a.safetensors")
        with torch.no_grad():
            model.encoder.layer[11].output.dense.weight[0, 0] += 1e-3
        b = dump_model(model, inputs, folder / "b.safetensors")
        del model
        for path in (a, b):  # into the page cache
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
        data = sum(load_dump(p).stats[k].numel * 4 for p in (a, b) for k in load_dump(p).stored)
        largest = max(s.numel * 4 for s in load_dump(a).stats.values())

        before = rss_anon()
        sampler = PeakSampler()
        sampler.start()
        start = time.perf_counter()
        report = diff_dumps(a, b)
        seconds = time.perf_counter() - start
        sampler.done.set()
        sampler.join()
        rise = sampler.peak - before
        sizes = a.stat().st_size, b.stat().st_size

    print(f"dumps: {sizes[0] / 1e9:.2f} GB + {sizes[1] / 1e9:.2f} GB")
    print(
        f"compared {len(report.pairs)} pairs, {len(report.failed)} out of tolerance, first "
        f"divergence {report.first_divergence.key if report.first_divergence else None}"
    )
    print(
        f"time {seconds:.2f} s, throughput {data / seconds / 1e9:.2f} GB/s of compared data "
        f"(target >= 1)"
    )
    print(
        f"peak anonymous memory rise during diff {rise / 1e6:.0f} MB; "
        f"largest pair {2 * largest / 1e6:.0f} MB"
    )


if __name__ == "__main__":
    main()
