"""Issue #22: why the fresh-process figures differ from bench_perf's in-process ones.

    PYTHONPATH=src .venv/bin/python scripts/bench_fresh_factors.py             # about 27 minutes
    PYTHONPATH=src .venv/bin/python scripts/bench_fresh_factors.py --pairs 1   # about 6 minutes
    PYTHONPATH=src .venv/bin/python scripts/bench_fresh_factors.py --variant fresh --variant \\
        fresh+warm-bare                                                        # some of them
    PYTHONPATH=src .venv/bin/python scripts/bench_fresh_factors.py --files     # the file alone

One figure (default bert-base 8x128 dump / bare hooks + save_file, any of bench_perf's cases with
--case) taken by three methods (scripts/harness.py), each then with one factor toggled:

  in-process   bench_perf before issue #22: one process, a warm-up call per side, then
               bare, modeltap, bare, ...; outputs overwritten in place; os.sync() before each
  issue        issue #22's harness: each side in a process of its own (a warm-up call, 5 timed
               runs alternating with the other's), outputs removed and os.sync() first
  fresh        what a user pays: each timed run a new process whose first (only) call it is

The variants take turns, one pair each per pass (--pairs passes). Each row prints the ratio
(median of pairs) with the range of the pairs, the medians, the load average, CPU seconds (user +
system, system apart), minor page faults and involuntary context switches of a run, and the bare
side's save_file seconds: a factor that moves the ratio shows there, and the columns beside it say
through which cost. --files times the file factor alone (FILE_MODES), without a model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_perf  # noqa: E402
from harness import (  # noqa: E402
    FRESH,
    HEADER,
    IN_PROCESS,
    ISSUE,
    Method,
    Result,
    measure,
    row,
    save_runs,
)

# glibc malloc: allocations from 64 KiB up mmapped, and unmapped when freed, whatever came before
# (else the threshold rises with the sizes freed, and freed memory is reused, already mapped).
MMAP = (("MALLOC_MMAP_THRESHOLD_", "65536"),)
VARIANTS: dict[str, tuple[str, Method]] = {
    "in-process": ("in one process (bench_perf before #22)", IN_PROCESS),
    "in-process+remove": ("  + outputs removed, not overwritten", replace(IN_PROCESS, remove=True)),
    "in-process-sync": ("  - no os.sync() before a run", replace(IN_PROCESS, sync=False)),
    "in-process+alternate": ("  + order alternating", replace(IN_PROCESS, alternate=True)),
    "in-process+separate": (
        "  + each side in its own process (warm-up, 5 runs)",
        Method(warm="call", runs=5, remove=False, alternate=False),
    ),
    "in-process+mmap": (
        "  + every large allocation new memory (malloc mmap threshold fixed)",
        replace(IN_PROCESS, env=MMAP),
    ),
    "issue": ("issue #22's harness (own processes, removed, alternating)", ISSUE),
    "issue-remove": ("  - outputs overwritten, not removed", replace(ISSUE, remove=False)),
    "issue-warm": (
        "  - no warm-up: the first of 5 runs is the process's first",
        replace(ISSUE, warm="none"),
    ),
    "issue+mmap": (
        "  + every large allocation new memory (malloc mmap threshold fixed)",
        replace(ISSUE, env=MMAP),
    ),
    "fresh": ("a fresh process per run, its first call (what a user pays)", FRESH),
    "fresh+warm-threads": (
        "  + warm-up: intra-op thread pool started",
        replace(FRESH, warm="threads"),
    ),
    "fresh+warm-bare": ("  + warm-up: one bare call (first forward)", replace(FRESH, warm="bare")),
    "fresh+warm-call": ("  + warm-up: the same call", replace(FRESH, warm="call")),
    "fresh-remove": ("  - outputs overwritten, not removed", replace(FRESH, remove=False)),
    "fresh-sync": ("  - no os.sync() before a run", replace(FRESH, sync=False)),
}

FILE_MODES = {
    "new": "a new file, the old one removed first (fresh method)",
    "truncate": "the old file opened with O_TRUNC and rewritten (save_file, overwriting)",
    "rename": "a new file renamed over the old one (modeltap's writer, overwriting)",
}


def file_factors(mb: int, rounds: int) -> None:
    """The file factor alone: `mb` MB written three ways (FILE_MODES) over a file of the same
    size that is on disk (written and synced), os.sync() before each, modes in turn; the time
    from open to close (and rename), median of `rounds`."""
    chunk = os.urandom(1_000_000)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in FILE_MODES}
    with tempfile.TemporaryDirectory(dir=os.environ.get("MODELTAP_BENCH_DIR")) as tmp:
        path, temp = Path(tmp) / "out.bin", Path(tmp) / ".out.bin.tmp"

        def write(target: Path) -> None:
            with open(target, "wb") as f:
                for _ in range(mb):
                    f.write(chunk)

        for i in range(rounds):
            for mode in list(FILE_MODES)[i % 3 :] + list(FILE_MODES)[: i % 3]:
                write(path)  # the old file, on disk
                os.sync()
                if mode == "new":
                    path.unlink()
                    os.sync()
                before = os.times()
                start = time.perf_counter()
                if mode == "rename":
                    write(temp)
                    os.replace(temp, path)
                else:
                    write(path)
                wall = time.perf_counter() - start
                times[mode].append((wall, os.times().system - before.system))
    print(f"\n{mb} MB written, median of {rounds} (load {os.getloadavg()[0]:.2f}):\n")
    print("| how | seconds | system CPU s |\n|---|---|---|")
    for mode, label in FILE_MODES.items():
        wall = statistics.median(t[0] for t in times[mode])
        cpu = statistics.median(t[1] for t in times[mode])
        print(f"| {label} | {wall:.2f} | {cpu:.2f} |")


# Left out unless asked for (--variant): each adds a sixteenth to a full run's time.
OPTIONAL = ("issue-warm", "fresh-sync")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--case", default="bert-base/dump", choices=sorted(bench_perf.CASES))
    parser.add_argument(
        "--variant",
        action="append",
        choices=list(VARIANTS),
        help=f"repeatable (default: all but {', '.join(OPTIONAL)})",
    )
    parser.add_argument("--pairs", type=int, default=5, help="pairs per variant")
    parser.add_argument("--runs-json", metavar="PATH", help="also write every run here")
    parser.add_argument(
        "--files", action="store_true", help="only the file factor, without a model (FILE_MODES)"
    )
    args = parser.parse_args()
    if args.files:
        file_factors(614, 2 * args.pairs + 1)
        return
    case = bench_perf.CASES[args.case]
    names = args.variant or [name for name in VARIANTS if name not in OPTIONAL]
    results = {name: Result(args.case, VARIANTS[name][1]) for name in names}
    with tempfile.TemporaryDirectory(dir=os.environ.get("MODELTAP_BENCH_DIR")) as tmp:
        folders = {name: Path(tmp) / name.replace("+", "_") for name in names}
        for folder in folders.values():
            folder.mkdir()
        # Variants in turn, one pair each, `pairs` times: the machine's load, which moves over
        # minutes, then falls on every variant alike (one variant after another, it did not).
        for n in range(args.pairs):
            for name in names:
                method = VARIANTS[name][1]
                print(f"pass {n + 1}/{args.pairs}: {name}", file=sys.stderr, flush=True)
                measure(
                    bench_perf.__file__,
                    args.case,
                    method,
                    1 if method.fresh else 2,  # in one process: two pairs a pass
                    progress=True,
                    folder=folders[name],
                    # the first pair of a variant that overwrites finds the files it overwrites
                    warmup=n == 0 and method.fresh and not method.remove,
                    into=results[name],
                )
            save_runs(args.runs_json, list(results.values()))
    print(f"{case.label}, {args.pairs} passes over the variants\n")
    head, rule = HEADER.splitlines()
    print(f"{head} bare: save_file |\n{rule}---|")
    for name, result in results.items():
        saves = [r.parts["save_file"] for r in result.bare if "save_file" in r.parts]
        save = f"{statistics.median(saves):.2f} s" if saves else ""
        label = f"{name}: {VARIANTS[name][0]}"
        print(row(label, result, case.unit, case.target), save, "|", flush=True)


if __name__ == "__main__":
    main()
