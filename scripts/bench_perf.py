"""Issues #12 and #22: modeltap against what a user writes by hand with bare hooks, two ways.

    .venv/bin/python scripts/bench_perf.py             # both tables, start-up
    .venv/bin/python scripts/bench_perf.py --quick     # fewer repetitions
    .venv/bin/python scripts/bench_perf.py --fresh     # fresh processes only
    .venv/bin/python scripts/bench_perf.py --in-process
    .venv/bin/python scripts/bench_perf.py --case bert-base/dump --pairs 5
    .venv/bin/python scripts/bench_perf.py --startup   # only the start-up
    .venv/bin/python scripts/bench_perf.py --device cuda  # 1B bf16 on a GPU

The baseline is written here, independent of modeltap's code: `register_forward_hook` on every
module keeping `out.detach()` of each tensor it returns; for a dump, `safetensors.torch.save_file`
of the distinct tensors; for gradients, `t.register_hook` on every output and one backward of the
sum of the main output, everything kept in memory. Against it (ratios, targets):

  capture in memory    modeltap.capture / bare hooks in memory                <= 1.05
  dump                 dump_model / (bare hooks + save_file)    bert-base <= 1.1, MiniLM <= 1.3
  statistics only      dump_model(stats_only=True), with a plain forward for scale
  acts + grads         dump_model(grads=...) to disk / bare hooks + backward in memory <= 1.5
  record               a training step in record(every=1), stats only / a plain step   <= 1.3
  generate             generate_model, statistics of every step / bare generate()      <= 1.3
  peak RSS             dump / a plain forward, each in a fresh process          <= 1.1
  start-up             `modeltap --help` <= 0.3 s, `modeltap show` <= 0.5 s, `modeltap diff` of two
                       small dumps <= 1.5 s

Workloads: all-MiniLM-L6-v2 on "hello world", and a bert-base-sized BertModel (BertConfig(),
seed 0) on 8 x 128 random ids; record: bench_record.py's BertForMaskedLM step; generate:
bench_generate.py's GPT-2-sized model, 64 new tokens. 2 intra-op threads. Two methods
(scripts/harness.py, one function for every figure):

  in one process (the issue #12 table; capture, dump, stats, grads): each (workload, figure) in
      a process of its own, where the two sides alternate (bare, modeltap, bare, ...) after a
      warm-up call of each; outputs overwritten in place, os.sync() before each run.
  fresh (issue #22; dump, grads, record, generate): what a user pays for one dump (one recorded
      step, one generation) in a new process. Each timed run is a process of its own, in which
      the workload is built (model and inputs) and the modules both sides use are imported,
      untimed; the previous run's output is removed and os.sync() called, untimed; then the one
      call is timed and nothing else: for a dump, the forward with its hooks, statistics and
      writing up to the file closed (modeltap: renamed into place; bare: save_file returned).
      Nothing runs before it in that process, so first-call costs (thread pool, new memory's page
      faults, lazy imports inside the call) are in it, on both sides. Pairs of processes
      alternate bare-first and modeltap-first, after a warm-up pair that is not counted.

Each figure is the median of the pairs' ratios (each modeltap run against its pair's bare run),
which the machine's drift over seconds does not move; [the range of the pairs' ratios] and (the
ratio of the two medians) follow, then the medians, the 1-minute load average over the runs,
CPU seconds, minor page faults and involuntary context switches of a run. Outputs go under
$MODELTAP_BENCH_DIR (default $TMPDIR): the bert-base runs write 614 MB a run.
scripts/bench_fresh_factors.py takes the dump figure by both methods and by issue #22's own
harness, toggling one difference at a time.
"""

from __future__ import annotations

import argparse
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
from harness import (  # noqa: E402
    FRESH,
    HEADER,
    IN_PROCESS,
    THREADS,
    Case,
    Result,
    child_main,
    measure,
    row,
    save_runs,
)

ROOT = Path(__file__).resolve().parent.parent
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
    start = time.perf_counter()
    save_file(unique, str(path))
    return {"save_file": time.perf_counter() - start}  # the part of the run spent writing


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
    from modeltap.dumping import dump_model
    from modeltap.grads import GradSpec
    from modeltap.loading import Inputs

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
        return bare_dump(model, batch, path)
    elif figure == "stats":
        plain_forward(model, batch)
    else:
        bare_grads(model, batch)


# ---- the figures as harness cases (scripts/harness.py) -----------------------------------

# Imported in every measured process before anything is timed (a command imports them at start-up).
IMPORTS = (
    "safetensors.torch",
    "modeltap.capture",
    "modeltap.grads",
    "modeltap.loading",
    "modeltap.dumping",
    "modeltap.stats",
    "modeltap.dump.writer",
)


def _case(workload: str, figure: str) -> Case:
    def setup():
        model, batch = WORKLOADS[workload]()
        if figure != "grads":
            model.requires_grad_(False)
        return model, batch

    return Case(
        f"{workload}, {LABELS[figure]}",
        setup,
        lambda state, path: baseline(figure, *state, path),
        lambda state, path: ours(figure, *state, path),
        TARGETS.get((workload, figure)),
        IMPORTS,
        "ms" if workload.startswith("MiniLM") else "s",
    )


def _record_case() -> Case:
    """bench_record.py's training step (bert-base BertForMaskedLM, 8 x 128, AdamW): plain, and
    inside `record(every=1)` (stats only, tripwire on): the with block, entered, one step and
    `rec.step()` (the step file finished and renamed into place), left."""
    import bench_record

    def recorded(state, path: Path) -> None:
        import modeltap

        with modeltap.record(state[0], path, every=1, overwrite=True) as rec:
            bench_record.train_step(*state)
            rec.step()

    return Case(
        "bert-base MLM train step, record(every=1) stats only / plain step",
        bench_record.setup,
        lambda state, path: bench_record.train_step(*state),
        recorded,
        1.3,
        (*IMPORTS, "modeltap.record.recording"),
    )


def _generate_case() -> Case:
    """bench_generate.py's workload (GPT-2-sized, 16-token prompt, 64 new tokens, greedy):
    bare `generate()`, and `generate_model` with statistics of every step (StepPlan('none'))."""
    import bench_generate

    return Case(
        f"GPT-2-sized generate, {bench_generate.NEW_TOKENS} tokens, stats only / bare generate()",
        bench_generate.setup,
        lambda state, path: bench_generate.bare(*state),
        lambda state, path: bench_generate.tapped(*state, path, "none"),
        1.3,
        (*IMPORTS, "modeltap.generate.decode"),
    )


def llama_1b():
    """A Llama of about 1.1B parameters (TinyLlama's shape) in bf16 on the GPU, seed 0, built
    from a config (no download), on 4 x 256 random ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        ids = torch.randint(0, config.vocab_size, (4, 256))
    model.requires_grad_(False)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _cuda_case(figure: str) -> Case:
    """On the GPU: modeltap's dump (statistics on the device, pinned buffers, non-blocking copies)
    or stats-only run, against a bare forward, or (`bare-dump`) the dump against bare hooks +
    save_file (which copies each tensor to the host). Each call ends with the GPU synchronized."""

    def synced(f):
        def call(state, path: Path) -> None:
            import torch

            f(state, path)
            torch.cuda.synchronize()

        return call

    bare = {
        "dump": lambda state, path: plain_forward(*state),
        "stats": lambda state, path: plain_forward(*state),
        "bare-dump": lambda state, path: bare_dump(*state, path),
    }[figure]
    mine = "stats" if figure == "stats" else "dump"
    label = {
        "dump": "dump / bare forward",
        "stats": "statistics only / bare forward",
        "bare-dump": "dump / bare hooks + save_file",
    }[figure]
    return Case(
        f"Llama 1.1B bf16 CUDA 4x256, {label}",
        llama_1b,
        synced(bare),
        synced(lambda state, path: ours(mine, *state, path)),
        None,
        IMPORTS,
    )


SHORT = {"minilm": "MiniLM 'hello world'", "bert-base": "bert-base 8x128"}
CASES: dict[str, Case] = {
    **{f"{short}/{figure}": _case(w, figure) for short, w in SHORT.items() for figure in FIGURES},
    "bert-base/record": _record_case(),
    "gpt2/generate": _generate_case(),
    **{f"llama-1b/{figure}": _cuda_case(figure) for figure in ("dump", "stats", "bare-dump")},
}
# The fresh-process figures of issue #22, with pairs (default, --quick).
FRESH_CASES = {
    "bert-base/dump": (5, 2),
    "minilm/dump": (11, 3),
    "bert-base/grads": (5, 2),
    "bert-base/record": (5, 2),
    "gpt2/generate": (5, 2),
}
CUDA = {"llama-1b/dump": (5, 2), "llama-1b/stats": (5, 2), "llama-1b/bare-dump": (5, 2)}


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

    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs

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


def in_process_table(args, results: list[Result]) -> None:
    print(f"\nIn one process, sides alternating ({IN_PROCESS.describe()}):\n")
    print(HEADER)
    for short, workload in SHORT.items():
        if args.workload and args.workload != short:
            continue
        small = short == "minilm"
        reps = args.reps or ((10 if args.quick else 300) if small else (3 if args.quick else 7))
        for figure in FIGURES:
            if args.figure and args.figure != figure:
                continue
            case = CASES[f"{short}/{figure}"]
            result = measure(__file__, f"{short}/{figure}", IN_PROCESS, reps)
            results.append(result)
            print(row(case.label, result, case.unit, case.target), flush=True)
        if args.figure and args.figure != "rss":
            continue
        rss = {side: int(child(workload, side)) for side in ("forward", "dump")}
        ratio = rss["dump"] / rss["forward"]
        print(
            f"| {workload}, peak RSS, dump vs plain forward (fresh processes) "
            f"| {rss['forward'] / 1e6:.0f} MB | {rss['dump'] / 1e6:.0f} MB | {ratio:.2f} "
            f"| <= 1.1: {'met' if ratio <= 1.1 else 'MISSED'} | {os.getloadavg()[0]:.2f} | | | |",
            flush=True,
        )


def fresh_table(cases: dict[str, tuple[int, int]], args, results: list[Result]) -> None:
    print(f"\nEach run in a fresh process ({FRESH.describe()}):\n")
    print(HEADER)
    for name, (pairs, quick) in cases.items():
        case = CASES[name]
        result = measure(
            __file__, name, FRESH, args.pairs or (quick if args.quick else pairs), progress=True
        )
        results.append(result)
        print(row(case.label, result, case.unit, case.target), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--startup", action="store_true", help="only the start-up figures")
    only.add_argument("--fresh", action="store_true", help="only the fresh-process figures")
    only.add_argument("--in-process", action="store_true", help="only the one-process figures")
    parser.add_argument(
        "--case", action="append", choices=sorted(FRESH_CASES), help="only this fresh figure"
    )
    parser.add_argument("--pairs", type=int, help="pairs of fresh processes per figure")
    parser.add_argument("--workload", choices=list(SHORT), help="only this workload")
    parser.add_argument("--figure", choices=[*FIGURES, "rss"], help="only this figure")
    parser.add_argument("--reps", type=int, help="rounds per figure (default 300 MiniLM, 7 bert)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the 1B bf16 GPU figures"
    )
    parser.add_argument("--runs-json", metavar="PATH", help="also write every run here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--harness-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    in_process_only = [f"--{k}" for k in ("workload", "figure") if getattr(args, k)]
    if args.case and (in_process_only or args.in_process or args.startup):
        other = in_process_only or ["--in-process or --startup"]
        parser.error(f"--case picks fresh-process figures; drop {other[0]}")
    if (args.fresh or args.startup) and in_process_only:
        parser.error(f"{in_process_only[0]} picks one-process figures; drop it or use --in-process")
    if args.device == "cuda" and (args.case or args.startup or args.in_process or in_process_only):
        parser.error("--device cuda runs its own fresh-process figures; drop the other choices")
    if args.harness_child:
        child_main(CASES, args.harness_child)
        return
    if args.child:
        rss_child(*args.child)
        return

    results: list[Result] = []
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                f"bench_perf --device cuda: skipped, no CUDA device on this machine "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False)"
            )
            return
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        fresh_table(CUDA, args, results)
        save_runs(args.runs_json, results)
        return
    if not args.startup:
        fresh_only = args.fresh or bool(args.case)
        if not fresh_only:
            in_process_table(args, results)
        if not (args.in_process or args.workload or args.figure):
            cases = {k: v for k, v in FRESH_CASES.items() if not args.case or k in args.case}
            fresh_table(cases, args, results)
        save_runs(args.runs_json, results)
    if args.workload or args.figure or args.fresh or args.case or args.in_process:
        return
    print("\nStart-up, median of fresh processes:\n")
    print("| figure | command | | seconds | | target |\n|---|---|---|---|---|---|")
    for name, seconds in startup(3 if args.quick else 5).items():
        target = {
            "--help": 0.3,
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
