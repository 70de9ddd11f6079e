"""Wall time and peak memory of `modeltap compare --stats-only` (issue #9's figure).

    .venv/bin/python scripts/bench_compare.py [--batch 8] [--seq 128] [--against bf16 attn:eager]

On a bert-base-sized BertModel (BertConfig(), seed 0) with batch 8 x 128 and every module
selected, in fresh processes (bare, then one compare per variant, then bare), each building the
model and then resetting its peak RSS:
  wall of compare (candidate built, both runs, every replay) / a bare float32 forward timed
  in the same process (the mean of one before and one after the compare: a shared machine's
  load changes from minute to minute)                target <= nesting levels of the selection + 2
  peak RSS of compare / peak RSS of a bare float32 forward                       target <= 1.5
The candidate's bare forward is timed too (after the compare, in its process): compare runs the
reference twice (its forward, and the validation replays, which together cost about one forward)
and the candidate twice (its forward for the cumulative error, and the replays for the local
one), so wall / (bare float32 + bare candidate forward) is the figure to hold near 2 plus the
comparisons' cost. On a CPU without bfloat16 units a bf16 forward costs many float32 ones, which
no replay scheme can avoid: `attn:eager` (a float32 candidate) is the figure for the target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import print_peak_rss, reset_peak_rss  # noqa: E402


def bert_base(batch: int, seq: int):
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig()).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
    )
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def child(mode: str, batch: int, seq: int) -> None:
    """In a fresh process: one bare forward (`bare`), or one compare against the variant `mode`;
    print seconds then peak RSS (then the candidate's bare forward)."""
    import torch

    from modeltap.compare import (
        DEFAULT_PRESET,
        Options,
        compare_models,
        make_candidate,
        parse_against,
    )
    from modeltap.config import tolerance_preset
    from modeltap.diff import Tolerance
    from modeltap.loading import Inputs
    from modeltap.selection import Selection, select_modules

    model, inputs = bert_base(batch, seq)
    with torch.no_grad():  # warm-up, out of the peak: allocator pools and lazy inits
        model(**inputs)
    bare_before = _timed(model, inputs) if mode != "bare" else 0.0
    reset_peak_rss()
    extra: dict[str, float] = {}
    start = time.perf_counter()
    if mode == "bare":
        with torch.no_grad():
            model(**inputs)
    else:
        modules = select_modules(model, Selection())
        variant = parse_against(mode)
        candidate = make_candidate(model, variant, shared=True)
        preset = DEFAULT_PRESET[variant.kind]
        options = Options(tolerance=Tolerance(**tolerance_preset(preset)))
        with tempfile.TemporaryDirectory() as tmp:
            report = compare_models(
                model,
                candidate,
                Inputs((), inputs, {}),
                modules,
                tmp,
                options=options,
                stats_only=True,
            )
        depths = {0 if m.name == "__root__" else m.name.count(".") + 1 for m in report.modules}
        extra = {
            "levels": len(depths),
            "passed": float(report.passed),
            "full_replays": len(report.full_replays),
        }
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, **extra}))
    print_peak_rss()
    if mode != "bare":
        bare_after = _timed(model, inputs)
        figures = {
            "candidate_forward_s": _timed(candidate, inputs),
            "bare_here_s": (bare_before + bare_after) / 2,
        }
        print(json.dumps(figures))


def _timed(model, inputs) -> float:
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        model(**inputs)
        return time.perf_counter() - start


def run_child(mode: str, batch: int, seq: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", mode, "--batch", str(batch), "--seq", str(seq)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    lines = [line for line in out if line.strip()]
    figures = json.loads(lines[-2] if mode == "bare" else lines[-3])
    figures["peak_rss"] = int(lines[-1] if mode == "bare" else lines[-2])
    if mode != "bare":
        figures.update(json.loads(lines[-1]))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--against", nargs="+", default=["bf16", "attn:eager"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch, args.seq)
        return

    bare = [run_child("bare", args.batch, args.seq)]
    runs = {against: run_child(against, args.batch, args.seq) for against in args.against}
    bare.append(run_child("bare", args.batch, args.seq))
    bare_s = statistics.median(b["seconds"] for b in bare)
    bare_rss = statistics.median(b["peak_rss"] for b in bare)
    levels = int(next(iter(runs.values()))["levels"])
    print(f"bert-base {args.batch}x{args.seq}, every module: {levels} nesting levels")
    print(f"  bare float32 forward   {bare_s:8.2f} s   peak RSS {bare_rss / 1e6:7.0f} MB")
    for against, comp in runs.items():
        ratio = comp["seconds"] / comp["bare_here_s"]
        rss_ratio = comp["peak_rss"] / bare_rss
        print(f"  --against {against}")
        print(f"    bare float32 forward   {comp['bare_here_s']:8.2f} s   (in its process)")
        print(f"    bare candidate forward {comp['candidate_forward_s']:8.2f} s")
        print(
            f"    compare                {comp['seconds']:8.2f} s   peak RSS "
            f"{comp['peak_rss'] / 1e6:7.0f} MB   (passed: {bool(comp['passed'])}, "
            f"{int(comp['full_replays'])} full replays)"
        )
        verdict = "met" if ratio <= levels + 2 else "MISSED"
        print(f"    wall / bare forward    {ratio:8.2f}     target <= {levels + 2}: {verdict}")
        per_pair = comp["seconds"] / (comp["candidate_forward_s"] + comp["bare_here_s"])
        print(f"    wall / (bare float32 + bare candidate forward) {per_pair:.2f}")
        verdict = "met" if rss_ratio <= 1.5 else "MISSED"
        print(f"    peak RSS / bare        {rss_ratio:8.2f}     target <= 1.5: {verdict}")


if __name__ == "__main__":
    main()
