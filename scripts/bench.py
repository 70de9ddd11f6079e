"""Performance figures of issue #2, as ratios taken in one process (timings here are noisy).

    .venv/bin/python scripts/bench.py            # everything (about 2 minutes on 2 cores)
    .venv/bin/python scripts/bench.py --quick    # fewer repetitions

Figures and targets:
  capture of all modules in memory / bare forward            <= 1.05
  dump to disk (capture+stats+write) / (bare forward + safetensors save_file of the same tensors)
                                                              <= 1.2
  peak RSS of a dump / peak RSS of a bare forward (each in its own process)  <= 1.3
  `modeltap --help` wall time                                 <= 0.3 s
on a bert-base-sized BertModel (BertConfig(), seed 0) with batch 8 x 128, and on all-MiniLM-L6-v2
with "hello world". Runs alternate between the two sides so drift hits both; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MINILM = ROOT / "models" / "all-MiniLM-L6-v2"


def bert_base():
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig()).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0)
    )
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def minilm():
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(MINILM).eval()
    batch = dict(AutoTokenizer.from_pretrained(MINILM)(["hello world"], return_tensors="pt"))
    return model, batch


def paired(a, b, reps: int) -> tuple[float, float]:
    """Median seconds of a() and b(), alternating, after one warm-up each."""
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for f, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def speed(name: str, model, batch, reps: int, folder: Path) -> dict[str, float]:
    import torch
    from safetensors.torch import save_file

    from modeltap import capture
    from modeltap.capture import hooks
    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs
    from modeltap.selection import Selection, select_modules

    def bare():
        with torch.no_grad():
            model(**batch)

    def in_memory():
        capture(model, **batch)

    def hooks_only():
        with hooks(model, names, _NullSink()), torch.no_grad():
            model(**batch)

    names = select_modules(model, Selection())
    t_bare, t_capture = paired(bare, in_memory, reps)
    t_bare2, t_hooks = paired(bare, hooks_only, reps)

    captured = capture(model, **batch)
    # save_file refuses tensors that share memory; copies made here, outside the timed region.
    unique = {k: v.detach().clone().contiguous() for k, v in captured.tensors.items()}
    del captured
    inputs = Inputs((), batch, {"bench": name})

    def bare_and_save():
        bare()
        save_file(unique, folder / "baseline.safetensors")

    def full_dump():
        dump_model(model, inputs, folder / "dump.safetensors")

    t_base, t_dump = paired(bare_and_save, full_dump, reps)
    size = (folder / "dump.safetensors").stat().st_size
    return {
        "bare_forward_s": t_bare,
        "capture_s": t_capture,
        "capture_ratio": t_capture / t_bare,
        "hooks_only_ratio": t_hooks / t_bare2,
        "bare_plus_save_s": t_base,
        "dump_s": t_dump,
        "dump_ratio": t_dump / t_base,
        "dump_mb": size / 1e6,
    }


class _NullSink:
    """Hooks that name every tensor and keep none: the cost of the hooks themselves."""

    def tensor(self, key, tensor):
        pass

    def alias(self, key, target):
        pass


def rss_child(mode: str, out: str) -> None:
    """In a fresh process: build bert-base, then one bare forward or one dump; print peak RSS."""
    import torch

    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs

    model, batch = bert_base()
    reset_peak_rss()
    if mode == "bare":
        with torch.no_grad():
            model(**batch)
    else:
        dump_model(model, Inputs((), batch, {}), out)
    print_peak_rss()


def reset_peak_rss() -> None:
    """Random initialisation peaks far above a forward; count from here on (Linux: writing 5 to
    clear_refs resets VmHWM, the peak resident set)."""
    Path("/proc/self/clear_refs").write_text("5")


def print_peak_rss() -> None:
    status = Path("/proc/self/status").read_text().splitlines()
    print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")))


def child_peak_rss(script: str, mode: str, out: Path) -> int:
    """Peak RSS in bytes of `script --rss-child MODE OUT`, run in a fresh process."""
    cmd = [sys.executable, script, "--rss-child", mode, str(out)]
    return int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])


def peak_rss(folder: Path) -> dict[str, float]:
    bare, dump = (child_peak_rss(__file__, m, folder / "rss.safetensors") for m in ("bare", "dump"))
    return {"bare_rss_mb": bare / 1e6, "dump_rss_mb": dump / 1e6, "rss_ratio": dump / bare}


def help_time(reps: int = 7) -> float:
    exe = shutil.which("modeltap", path=str(Path(sys.executable).parent)) or "modeltap"
    subprocess.run([exe, "--help"], capture_output=True, check=True)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run([exe, "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results["bert-base 8x128"] = speed(
            "bert-base", *bert_base(), 3 if args.quick else 7, folder
        )
        if (MINILM / "model.safetensors").is_file():
            results["MiniLM 'hello world'"] = speed(
                "minilm", *minilm(), 20 if args.quick else 60, folder
            )
        results["bert-base peak RSS"] = peak_rss(folder)
    results["modeltap --help"] = {"help_s": help_time()}

    if args.json:
        print(json.dumps(results, indent=1))
        return
    targets = {"capture_ratio": 1.05, "dump_ratio": 1.2, "rss_ratio": 1.3, "help_s": 0.3}
    for section, figures in results.items():
        print(section)
        for key, value in figures.items():
            mark = ""
            if key in targets:
                mark = (
                    f"   target <= {targets[key]}: {'met' if value <= targets[key] else 'MISSED'}"
                )
            print(f"  {key:18} {value:10.3f}{mark}")


if __name__ == "__main__":
    main()
