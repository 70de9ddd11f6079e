"""Performance figures of issue #3 (`dump --grads`), as ratios taken in one process.

    .venv/bin/python scripts/bench_grads.py            # about 3 minutes on 2 cores
    .venv/bin/python scripts/bench_grads.py --quick    # fewer repetitions

Figures and targets, on a bert-base-sized BertModel (BertConfig(), seed 0) with batch 8 x 128:
  `dump --grads` over all modules (activations and gradients of every module written to disk)
      / bare forward + backward of the same loss (sum of last_hidden_state)    <= 1.3
  peak RSS of the same two, each in its own process                            <= 1.3
and, for where the time goes, the same run with --stats-only (hooks, one backward and the
statistics of every activation and gradient, but no tensor bytes written) / bare.
The file is written under $TMPDIR: point it at tmpfs (TMPDIR=/dev/shm) to leave the disk out.
Runs alternate between the two sides so drift hits both; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The same model, batch and peak-RSS measurement as scripts/bench.py.
from bench import bert_base, child_peak_rss, print_peak_rss, reset_peak_rss  # noqa: E402


def bare_step(model, batch) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).last_hidden_state.sum().backward()


def ours(model, batch, out: Path, *, stats_only: bool = False) -> Path:
    from modeltap.dumping import dump_model
    from modeltap.grads import GradSpec
    from modeltap.loading import Inputs

    return dump_model(model, Inputs((), batch, {}), out, grads=GradSpec(), stats_only=stats_only)


def speed(reps: int, folder: Path) -> dict[str, float]:
    model, batch = bert_base()
    out = folder / "grads.safetensors"

    def a() -> None:
        bare_step(model, batch)

    def b() -> None:
        ours(model, batch, out)

    def c() -> None:
        ours(model, batch, folder / "stats.safetensors", stats_only=True)

    a(), b(), c()
    ta, tb, tc = [], [], []
    for _ in range(reps):
        for f, times in ((a, ta), (b, tb), (c, tc)):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    bare, dump, stats = (statistics.median(t) for t in (ta, tb, tc))
    return {
        "bare_fwd_bwd_s": bare,
        "dump_grads_s": dump,
        "ratio": dump / bare,
        "stats_only_s": stats,
        "stats_only_ratio": stats / bare,
        "file_mb": out.stat().st_size / 1e6,
    }


def rss_child(mode: str, out: str) -> None:
    """In a fresh process: build bert-base, then one bare step or one dump --grads; peak RSS."""
    model, batch = bert_base()
    reset_peak_rss()
    if mode == "bare":
        bare_step(model, batch)
    else:
        ours(model, batch, Path(out))
    print_peak_rss()


def peak_rss(folder: Path) -> dict[str, float]:
    bare, dump = (child_peak_rss(__file__, m, folder / "rss.safetensors") for m in ("bare", "dump"))
    return {"bare_rss_mb": bare / 1e6, "dump_grads_rss_mb": dump / 1e6, "rss_ratio": dump / bare}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--rss-child", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = {**speed(2 if args.quick else 5, folder), **peak_rss(folder)}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    targets = {"ratio": 1.3, "rss_ratio": 1.3}
    for key, value in results.items():
        mark = ""
        if key in targets:
            mark = f"  (target <= {targets[key]}: {'met' if value <= targets[key] else 'MISSED'})"
        print(f"  {key:18} {value:10.3f}{mark}")


if __name__ == "__main__":
    main()
