"""Performance figures of issue #19 (`modeltap generate`), against a bare `model.generate()`.

    .venv/bin/python scripts/bench_generate.py            # --reps 3
    .venv/bin/python scripts/bench_generate.py --reps 1
    .venv/bin/python scripts/bench_generate.py --rss-only

A GPT-2-sized GPT2LMHeadModel (GPT2Config(), seed 0, eval, float32, CPU) on a 16-token prompt,
64 new tokens, greedy (EOS off, so every run makes all 64). Figures and targets:

  time:  generate_model, statistics of every step (StepPlan('none')), every module hooked
         / bare generate(), medians of --reps runs taken in turn in one process        <= 1.3
  RSS:   peak resident memory while generating with every step's tensors (StepPlan('all'),
         streamed to the file) / that while running bare generate()                    <= 1.1
         (each in its own fresh process, VmHWM reset once the model is built: building it
         peaks higher than either run and would hide the difference)
The files go under $TMPDIR (point it at tmpfs, TMPDIR=/dev/shm, to leave the disk out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

NEW_TOKENS = 64


def setup():  # noqa: ANN201
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from modeltap.loading import Inputs

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    model.generation_config.eos_token_id = None  # all 64 tokens, every run
    model.generation_config.pad_token_id = 0
    ids = torch.randint(
        0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)
    )
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, Inputs((), kwargs, {"tensors": {"input_ids": [1, 16]}})


def bare(model, inputs) -> list[int]:  # noqa: ANN001
    import torch

    with torch.no_grad():
        out = model.generate(**inputs.kwargs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, 16:].tolist()


def tapped(model, inputs, out: Path, plan: str) -> list[int]:  # noqa: ANN001
    from modeltap.generate import Decoding, StepPlan, generate_model

    done = generate_model(
        model, inputs, out, decoding=Decoding(max_new_tokens=NEW_TOKENS), plan=StepPlan(plan)
    )
    return done.new_ids[0]


def _hwm_mb() -> float:
    """Peak resident memory since the last reset (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(kind: str) -> None:
    """One generation in this fresh process; print its peak RSS (MB) as JSON: the peak while
    generating, once the model is built (building it peaks higher, and would hide the run)."""
    model, inputs = setup()
    # writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)
    Path("/proc/self/clear_refs").write_text("5")
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "bare":
            bare(model, inputs)
        else:
            tapped(model, inputs, Path(tmp) / "g.safetensors", "all")
            size = (Path(tmp) / "g.safetensors").stat().st_size
    peak = _hwm_mb()
    print(
        json.dumps(
            {"kind": kind, "rss_mb": peak, **({"file_mb": size / 1e6} if kind != "bare" else {})}
        )
    )


def timing(reps: int) -> None:
    import torch

    model, inputs = setup()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "g.safetensors"
        assert tapped(model, inputs, out, "none") == bare(model, inputs)  # warm-up, and equal
        times: dict[str, list[float]] = {"bare": [], "stats": []}
        for _ in range(reps):
            start = time.perf_counter()
            bare(model, inputs)
            times["bare"].append(time.perf_counter() - start)
            start = time.perf_counter()
            tapped(model, inputs, out, "none")
            times["stats"].append(time.perf_counter() - start)
        size = out.stat().st_size
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    print(
        f"bare generate, {NEW_TOKENS} tokens: {med['bare']:.2f} s; statistics of every step: "
        f"{med['stats']:.2f} s ({size / 1e6:.1f} MB file); ratio {med['stats'] / med['bare']:.2f} "
        "(target <= 1.3)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", choices=["bare", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--rss-only", action="store_true", help="Only the memory figure.")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if not args.rss_only:
        timing(args.reps)
    peaks = {}
    for kind in ("bare", "full"):
        done = subprocess.run(
            [sys.executable, __file__, "--child", kind], capture_output=True, text=True, check=True
        )
        peaks[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = peaks["full"]["rss_mb"] / peaks["bare"]["rss_mb"]
    print(
        f"peak RSS while generating: bare generate {peaks['bare']['rss_mb']:.0f} MB; every "
        f"step's tensors {peaks['full']['rss_mb']:.0f} MB ({peaks['full']['file_mb']:.0f} MB "
        f"file); ratio {ratio:.2f} (target <= 1.1)"
    )


if __name__ == "__main__":
    main()
