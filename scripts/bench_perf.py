"""Issue #12: modeltap against what a user writes by hand with bare hooks, same model, same way.

    .venv/bin/python scripts/bench_perf.py            # about 8 minutes on 2 cores
    .venv/bin/python scripts/bench_perf.py --quick    # fewer repetitions
    .venv/bin/python scripts/bench_perf.py --startup  # only the commands' start-up

The baseline is written here, independent of modeltap's code: `register_forward_hook` on every
module keeping `out.detach()` of each tensor it returns; for a dump, `safetensors.torch.save_file`
of the distinct tensors; for gradients, `t.register_hook` on every output and one backward of the
sum of the main output, everything kept in memory. Against it (ratios, targets):

  capture in memory    modeltap.capture / bare hooks in memory                <= 1.05
  dump                 dump_model / (bare hooks + save_file)    bert-base <= 1.1, MiniLM <= 1.3
  statistics only      dump_model(stats_only=True), with a plain forward for scale
  acts + grads         dump_model(grads=...) to disk / bare hooks + backward in memory <= 1.5
  peak RSS             dump / a plain forward, each in a fresh process          <= 1.1
  start-up             `modeltap show` <= 0.5 s, `modeltap diff` of two small dumps <= 1.5 s

Workloads: all-MiniLM-L6-v2 on "hello world", and a bert-base-sized BertModel (BertConfig(),
seed 0) on 8 x 128 random ids. Every (workload, figure) runs in its own process with 2 threads;
inside it the two sides alternate (A, B, A, B, ...) after a warm-up. The ratio checked against
the target is the median of the rounds' ratios (each modeltap run against the bare run just before
it), which the machine's drift over seconds does not move; the ratio of the two medians follows in
brackets, with the medians themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The same models, batch and peak-RSS measurement as scripts/bench.py.
from bench import MINILM, bert_base, minilm, print_peak_rss, reset_peak_rss  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Intra-op threads of the measured processes (the issue measured with 2; --threads to change).
THREADS = int(os.environ.get("MODELTAP_BENCH_THREADS", "2"))
WORKLOADS = {"MiniLM 'hello world'": minilm, "bert-base 8x128": bert_base}
FIGURES = ("capture", "dump", "stats", "grads")
TARGETS = {
    ("MiniLM 'hello world'", "capture"): 1.05,
    ("bert-base 8x128", "capture"): 1.05,
    ("MiniLM 'hello world'", "dump"): 1.3,
    ("bert-base 8x128", "dump"): 1.1,
    ("bert-base 8x128", "grads"): 1.5,
}
LABELS = {
    "capture": "capture in memory",
    "dump": "dump to disk",
    "stats": "statistics only (vs a plain forward)",
    "grads": "activations + gradients (bare: in memory)",
}


# ---- the bare-hooks baseline (no modeltap code) -------------------------------------------


def _leaves(value, key, out):
    import torch

    if isinstance(value, torch.Tensor):
        out.append((key, value))
    elif isinstance(value, dict):  # also ModelOutput
        for name, item in value.items():
            _leaves(item, f"{key}:{name}", out)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _leaves(item, f"{key}:{i}", out)


def bare_hooks(model, acts, grads=None):
    """Forward hooks on every module; returns the handles."""

    def make(name):
        def hook(module, args, output):
            found = []
            _leaves(output, name, found)
            for key, t in found:
                acts[key] = t.detach()
                if grads is not None and t.requires_grad:
                    t.register_hook(lambda g, key=key: grads.__setitem__(key, g))

        return hook

    return [m.register_forward_hook(make(n or "root")) for n, m in model.named_modules()]


def bare_capture(model, batch):
    import torch

    acts = {}
    handles = bare_hooks(model, acts)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return acts


def bare_dump(model, batch, path):
    from safetensors.torch import save_file

    acts = bare_capture(model, batch)
    unique, seen, storages = {}, set(), set()
    for key, t in acts.items():
        ident = (t.data_ptr(), tuple(t.shape), t.stride())
        if ident in seen:  # the same tensor again (dropout in eval, wrapper modules)
            continue
        seen.add(ident)
        storage = t.untyped_storage().data_ptr()
        # save_file refuses tensors that share memory: copy a view of memory already kept.
        unique[key] = t.clone() if storage in storages else t.contiguous()
        storages.add(storage)
    save_file(unique, str(path))


def bare_grads(model, batch):
    acts, grads = {}, {}
    handles = bare_hooks(model, acts, grads)
    try:
        model.zero_grad(set_to_none=True)
        output = model(**batch)
        output[0].sum().backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return acts, grads


def plain_forward(model, batch):
    import torch

    with torch.no_grad():
        model(**batch)


# ---- modeltap -----------------------------------------------------------------------------


def ours(figure, model, batch, path):
    from modeltap import capture
    from modeltap.grads import GradSpec
    from modeltap.loading import Inputs
    from modeltap.run import dump_model

    inputs = Inputs((), batch, {"bench": True})
    if figure == "capture":
        capture(model, **batch)
    elif figure == "dump":
        dump_model(model, inputs, path)
    elif figure == "stats":
        dump_model(model, inputs, path, stats_only=True)
    else:
        dump_model(model, inputs, path, grads=GradSpec())


def baseline(figure, model, batch, path):
    if figure == "capture":
        bare_capture(model, batch)
    elif figure == "dump":
        bare_dump(model, batch, path)
    elif figure == "stats":
        plain_forward(model, batch)
    else:
        bare_grads(model, batch)


# ---- children -----------------------------------------------------------------------------


def time_child(workload, figure, reps):
    """Median seconds of baseline and modeltap, alternating, in this fresh process."""
    import torch

    torch.set_num_threads(THREADS)
    model, batch = WORKLOADS[workload]()
    if figure != "grads":
        model.requires_grad_(False)
    with tempfile.TemporaryDirectory() as tmp:
        a = Path(tmp) / "bare.safetensors"
        b = Path(tmp) / "ours.safetensors"
        baseline(figure, model, batch, a)
        ours(figure, model, batch, b)
        ta, tb = [], []
        for _ in range(reps):
            for f, path, out in ((baseline, a, ta), (ours, b, tb)):
                # Each run starts with no dirty pages: otherwise the writeback of the 614 MB the
                # other side just wrote lands in this run (the kernel throttles writers), and the
                # figure measures the disk's backlog, not the dump.
                os.sync()
                start = time.perf_counter()
                f(figure, model, batch, path)
                out.append(time.perf_counter() - start)
        size = b.stat().st_size if b.exists() else 0
    # Each round's ratio (ours against the bare run just before it), the median: this machine's
    # speed drifts by 10-30% over seconds, which a ratio of two medians takes in and this does not.
    by_round = statistics.median(b / a for a, b in zip(ta, tb, strict=True))
    print(
        json.dumps(
            {
                "bare": statistics.median(ta),
                "ours": statistics.median(tb),
                "by_round": by_round,
                "mb": size / 1e6,
            }
        )
    )


def rss_child(workload, side):
    import torch

    torch.set_num_threads(THREADS)
    model, batch = WORKLOADS[workload]()
    model.requires_grad_(False)
    with tempfile.TemporaryDirectory() as tmp:
        reset_peak_rss()
        if side == "forward":
            plain_forward(model, batch)
        else:
            ours("dump", model, batch, Path(tmp) / "rss.safetensors")
        print_peak_rss()


def child(*args) -> str:
    cmd = [sys.executable, __file__, "--child", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


# ---- start-up -----------------------------------------------------------------------------


def startup(reps=5) -> dict[str, float]:
    """Median wall seconds of whole `python -m modeltap ...` processes.

    modeltap's sources are byte-compiled first, as `pip install` leaves them: with
    PYTHONDONTWRITEBYTECODE set (it is on this machine) and a module edited since its last .pyc,
    every start-up compiles it again (`show` took 0.61 s so against 0.36 s).
    """
    import compileall
    import os

    compileall.compile_dir(str(ROOT / "src"), quiet=1)

    from modeltap.loading import Inputs
    from modeltap.run import dump_model

    with tempfile.TemporaryDirectory() as tmp:
        # ls's tree cache: emptied before each first ls, which the second then reads
        cache = Path(tmp) / "cache"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MODELTAP_CACHE": str(cache)}
        model, batch = minilm()
        a, b = Path(tmp) / "a.safetensors", Path(tmp) / "b.safetensors"
        for path in (a, b):
            dump_model(model, Inputs((), batch, {"bench": True}), path)
        commands = {
            "--help": ["--help"],
            "show (MiniLM dump)": ["show", str(a)],
            "diff (two MiniLM dumps)": ["diff", str(a), str(b)],
            "ls (local MiniLM folder, first)": ["ls", str(MINILM)],
            "ls (local MiniLM folder, second: cached tree)": ["ls", str(MINILM)],
        }
        times = {name: [] for name in commands}
        for _ in range(reps):
            for name, args in commands.items():
                if name.startswith("ls") and "first" in name:
                    shutil.rmtree(cache, ignore_errors=True)
                start = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "modeltap", *args], env=env, capture_output=True
                )
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--startup", action="store_true", help="only the start-up figures")
    parser.add_argument("--workload", choices=["minilm", "bert-base"], help="only this workload")
    parser.add_argument("--figure", choices=[*FIGURES, "rss"], help="only this figure")
    parser.add_argument("--reps", type=int, help="rounds per figure (default 300 MiniLM, 7 bert)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "time":
            time_child(rest[0], rest[1], int(rest[2]))
        else:
            rss_child(rest[0], rest[1])
        return

    print("| workload | what | bare hooks | modeltap | ratio by round (of medians) | target |")
    print("|---|---|---|---|---|---|")
    if not args.startup:
        for workload in WORKLOADS:
            small = workload.startswith("MiniLM")
            if args.workload and args.workload != ("minilm" if small else "bert-base"):
                continue
            reps = args.reps or ((10 if args.quick else 300) if small else (3 if args.quick else 7))
            scale, unit = (1e3, "ms") if small else (1.0, "s")
            for figure in FIGURES:
                if args.figure and args.figure != figure:
                    continue
                r = json.loads(child("time", workload, figure, reps))
                ratio = r["by_round"]
                target = TARGETS.get((workload, figure))
                mark = (
                    ""
                    if target is None
                    else f"<= {target}: {'met' if ratio <= target else 'MISSED'}"
                )
                size = f" ({r['mb']:.0f} MB)" if r["mb"] > 1 else ""
                print(
                    f"| {workload} | {LABELS[figure]}{size} | {r['bare'] * scale:.3g} {unit} "
                    f"| {r['ours'] * scale:.3g} {unit} | {ratio:.2f} "
                    f"({r['ours'] / r['bare']:.2f}) | {mark} |",
                    flush=True,
                )
            if args.figure and args.figure != "rss":
                continue
            rss = {side: int(child("rss", workload, side)) for side in ("forward", "dump")}
            ratio = rss["dump"] / rss["forward"]
            print(
                f"| {workload} | peak RSS, dump vs plain forward | {rss['forward'] / 1e6:.0f} MB "
                f"| {rss['dump'] / 1e6:.0f} MB | {ratio:.2f} | <= 1.1: "
                f"{'met' if ratio <= 1.1 else 'MISSED'} |",
                flush=True,
            )
    if args.workload or args.figure:
        return
    for name, seconds in startup(3 if args.quick else 5).items():
        target = {
            "show (MiniLM dump)": 0.5,
            "diff (two MiniLM dumps)": 1.5,
            "ls (local MiniLM folder, second: cached tree)": 1.0,
        }.get(name)
        mark = (
            "" if target is None else f"<= {target} s: {'met' if seconds <= target else 'MISSED'}"
        )
        print(f"| start-up | `modeltap {name}` | | {seconds:.2f} s | | {mark} |")


if __name__ == "__main__":
    main()
