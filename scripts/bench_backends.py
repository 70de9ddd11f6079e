"""Performance figures of issue #8 (transformed models), as ratios taken in one process.

    .venv/bin/python scripts/bench_backends.py            # bert-base 8 x 128 (cold inductor
                                                          # compiles: several minutes on 2 cores)
    .venv/bin/python scripts/bench_backends.py --layers 2 --reps 3   # a quick check of the script

Figures and targets, on a bert-base-sized BertModel (BertConfig(), seed 0), batch 8 x 128:
  compiled stats-only dump (what `dump --compile --stats-only` times: the compiled forward
  with statistics computed in the graph, naming, the header written) / compiled forward without
  hooks, both after warm-up                                               <= 1.1, graphs = 1
  after_forward_ratio: the same dump the way it was taken before (every logged tensor a graph
  output, statistics read from them after the forward), still the path of a dump with --hist
  or tensor data, and of a stats-only dump the graph can't take (capture/compile_stats.py).
  export-backend capture (.pt2 through the Interpreter, in memory) / eager capture (in memory)
                                                                          <= 1.2
  cold compile time of each compiled model (first call), reported apart from run time.
  hooked_forward_ratio: that path's hooked compiled forward alone (no naming, no statistics).
  *_by_round: each ratio taken round by round (against the plain run just before), the median.
Three model instances with the same weights are compiled (hooked both ways, and plain) with
dynamo's hook guards on, so none reuses another's code; the runs alternate and medians are
reported.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bert_base(layers: int | None):
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig() if layers is None else BertConfig(num_hidden_layers=layers)
    model = BertModel(config).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0)
    )
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def paired(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of a() and b(), alternating, after one warm-up each."""
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for f, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def interleaved(fs: list[Callable[[], object]], reps: int) -> list[list[float]]:
    """Seconds of each f per round, run in turn (f0, f1, ..., f0, f1, ...) after one warm-up
    each."""
    for f in fs:
        f()
    times: list[list[float]] = [[] for _ in fs]
    for _ in range(reps):
        for f, out in zip(fs, times, strict=True):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    return times


def timed(f: Callable[[], object]) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def compile_figures(model, batch, reps: int, backend: str, folder: Path) -> dict[str, float]:
    import torch

    from modeltap.capture.compile_log import CompiledCapture, record_run
    from modeltap.capture.compile_stats import (
        StatsCapture,
        aliased_modules,
        hand_over,
        learn_layout,
    )
    from modeltap.dump import DumpWriter
    from modeltap.selection import Selection, select_modules

    torch._dynamo.config.skip_nnmodule_hook_guards = False
    plain_model, after_model = copy.deepcopy(model), copy.deepcopy(model)
    names = select_modules(model, Selection())
    mask = batch["attention_mask"].bool()
    eager, layout = learn_layout(model, names, (), batch, inputs=False, train_mode=False, seed=0)
    with (
        StatsCapture(model, names, backend=backend, aliased=aliased_modules(eager)) as cap,
        CompiledCapture(after_model, names, backend=backend) as after,
    ):
        plain = torch.compile(plain_model, backend=backend)
        cold_hooked = timed(lambda: cap.run((), batch))
        with torch.no_grad():
            cold_plain = timed(lambda: plain(**batch))

        def bare() -> None:
            with torch.no_grad():
                plain(**batch)

        def dump_stats_only() -> None:  # as `dump --compile --stats-only` does after compiling
            cap.run((), batch)
            with DumpWriter(folder / "c.safetensors", stats_only=True, row_mask=mask) as writer:
                hand_over(cap.log, eager, layout, writer)
                writer.finish({"order": json.dumps(eager.order)})

        def dump_after_forward() -> None:
            after.run((), batch)
            with DumpWriter(folder / "c.safetensors", stats_only=True, row_mask=mask) as writer:
                recorder = record_run(after, writer)
                writer.finish({"order": json.dumps(recorder.order)})

        def hooked_only() -> None:
            after.run((), batch)

        times = interleaved([bare, dump_stats_only, dump_after_forward, hooked_only], reps)
        t_bare, t_dump, t_after, t_hooked = (statistics.median(t) for t in times)
        # the same ratios round by round (each against the plain run just before it), medians:
        # less sensitive to a machine whose load changes between rounds
        by_round = [
            statistics.median(t / b for t, b in zip(times[i], times[0], strict=True))
            for i in (1, 2, 3)
        ]
        graphs = len(cap.graphs)
    return {
        "compiled_forward_s": t_bare,
        "compiled_dump_stats_only_s": t_dump,
        "compile_ratio": t_dump / t_bare,
        "after_forward_ratio": t_after / t_bare,
        "hooked_forward_ratio": t_hooked / t_bare,
        "compile_ratio_by_round": by_round[0],
        "after_forward_ratio_by_round": by_round[1],
        "hooked_forward_ratio_by_round": by_round[2],
        "graphs": graphs,
        "cold_first_call_hooked_s": cold_hooked,
        "cold_first_call_plain_s": cold_plain,
    }


def export_figures(model, batch, reps: int, folder: Path) -> dict[str, float]:
    import torch

    from modeltap.capture import MemorySink, capture
    from modeltap.capture.backend import RunRequest
    from modeltap.capture.export import ExportBackend, export_program, module_names, skeleton
    from modeltap.loading.archive import load_pt2

    start = time.perf_counter()
    torch.export.save(export_program(model, (), batch), folder / "m.pt2")
    export_s = time.perf_counter() - start
    program = load_pt2(folder / "m.pt2")
    tree = skeleton(module_names(program))
    names = [n or "__root__" for n, _ in tree.named_modules()]
    backend = ExportBackend(program)

    def eager() -> None:
        capture(model, **batch)

    def exported() -> None:
        backend.run(RunRequest(tree, names, MemorySink(), (), batch))

    t_eager, t_export = paired(eager, exported, reps)
    return {
        "export_and_save_s": export_s,
        "eager_capture_s": t_eager,
        "export_capture_s": t_export,
        "export_ratio": t_export / t_eager,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layers", type=int, help="fewer layers than bert-base's 12")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-export", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    model, batch = bert_base(args.layers)
    size = f"bert-base{'' if args.layers is None else f' ({args.layers} layers)'} 8x128"
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if not args.skip_export:
            results[f"export, {size}"] = export_figures(model, batch, args.reps, folder)
        if not args.skip_compile:
            results[f"compile ({args.backend}), {size}"] = compile_figures(
                model, batch, args.reps, args.backend, folder
            )
    print(json.dumps({"torch": torch.__version__, **results}, indent=2))


if __name__ == "__main__":
    main()
