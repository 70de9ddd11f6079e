"""Where a dump's statistics and writes run: a timeline of each tensor (issue #22, "Overlap").

    .venv/bin/python scripts/timeline.py                   # bert-base 8x128, full dump
    .venv/bin/python scripts/timeline.py --stats-only --runs 3
    .venv/bin/python scripts/timeline.py --log t.jsonl     # keep the per-tensor log

Runs a bert-base-sized BertModel (BertConfig(), seed 0) on 8 x 128 random ids (the model of
scripts/bench.py) through `dump_model` with `MODELTAP_TIMELINE` on, after one warm-up dump, and
prints per run: the forward's wall time (the writer entered to the last module's hook), the total
time of the copies, waits for room in the writer's buffer, statistics and writes, how much of each
ran before the last hook (overlapping the forward) and the tail after it (what the dump adds to
the critical path), and each thread's busy fraction over the whole dump; beside it, a plain
forward run just before (no hooks), for how much the forward slowed down. `main` is modeltap's
own work in the caller's thread, between the model's kernels; `deferred` the small tensors done
together; `writer` the writer thread. The files go under $TMPDIR.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from bench import bert_base, minilm  # noqa: E402


def show(figures: dict, label: str, plain: float) -> None:
    print(
        f"{label}: {figures['tensors']} tensors, {figures['bytes'] / 1e6:.0f} MB; forward "
        f"{figures['forward_s']:.3f} s (a plain forward just before: {plain:.3f} s), tail after "
        f"the last hook {figures['tail_s']:.3f} s, header and rename {figures['finish_s']:.3f} s, "
        f"total {figures['total_s']:.3f} s"
    )
    for what in ("copy", "wait", "stats", "write"):
        total = figures[f"{what}_s"]
        before = figures[f"{what}_before_last_hook_s"]
        share = f"{before / total:4.0%}" if total else "   -"
        print(
            f"  {what:6s} {total:7.3f} s   during the forward {before:7.3f} s ({share})   "
            f"after it {total - before:7.3f} s"
        )
    busy = ", ".join(f"{t} {f:.0%}" for t, f in figures["busy"].items())
    print(f"  busy (share of the total): {busy}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--stats-only", action="store_true")
    parser.add_argument("--model", choices=["bert-base", "minilm"], default="bert-base")
    parser.add_argument("--max-inflight", type=int, help="MiB (default: the writer's own)")
    parser.add_argument("--log", type=Path, help="keep the JSON-lines log here")
    args = parser.parse_args()

    import torch

    from modeltap.dump import DEFAULT_MAX_INFLIGHT, timeline
    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs

    model, batch = bert_base() if args.model == "bert-base" else minilm()
    model.requires_grad_(False)
    inputs = Inputs((), batch, {"bench": True})
    inflight = DEFAULT_MAX_INFLIGHT if args.max_inflight is None else args.max_inflight << 20
    options = {"stats_only": args.stats_only, "max_inflight": inflight}
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or Path(tmp) / "timeline.jsonl"
        log.unlink(missing_ok=True)
        dump_model(model, inputs, Path(tmp) / "warm.safetensors", **options)
        plain = []
        os.environ[timeline.ENV] = str(log)
        try:
            for run in range(args.runs):
                os.sync()
                start = time.perf_counter()
                with torch.no_grad():
                    model(**batch)
                plain.append(time.perf_counter() - start)
                path = Path(tmp) / f"run{run}.safetensors"
                os.sync()  # the last run's writeback is not this run's
                dump_model(model, inputs, path, **options)
                path.unlink()
        finally:
            del os.environ[timeline.ENV]
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        kind = "stats-only dump" if args.stats_only else "dump"
        print(f"{args.model} {kind}, torch {torch.get_num_threads()} threads, load {load}")
        for run, lines in enumerate(timeline.read(log)):
            show(timeline.summary(lines), f"run {run + 1}", plain[run])


if __name__ == "__main__":
    main()
