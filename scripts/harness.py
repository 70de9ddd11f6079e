"""The timing harness of issue #22: two sides of a workload (bare code, modeltap), paired runs.

One function, `measure(script, case, method, pairs)`, takes any figure any of these ways:

  fresh (`FRESH`, what bench_perf.py --fresh reports): every timed run is one call in its
      own new process, which is what a user pays for one `modeltap dump` (or one recorded
      step, or one generation). In that process the workload is built and the modules the call
      needs are imported (both untimed); then the previous run's output is removed and
      `os.sync()` called (untimed), and the call alone is timed: for a dump, from the forward
      to the file written and closed (for modeltap: renamed into place), nothing after. A pair
      is two such processes, both built before either is timed, so that their runs follow each
      other within seconds; pairs alternate bare-first and modeltap-first, after one warm-up
      pair that is not counted (it brings the libraries into the page cache).
  issue #22's own (`ISSUE`): the same, but each process calls its side once to warm up and then
      times 5 runs, alternating with the other side's process; a pair's ratio is that of the two
      processes' medians.
  in-process (`IN_PROCESS`, bench_perf.py --in-process, its only method before issue #22): one
      process builds the workload, calls each side once to warm up, then alternates bare,
      modeltap, bare, ...; each output is overwritten in place (the same path every run) and
      `os.sync()` is called before each timed call.

The figure is the median of the pairs' ratios (modeltap / the bare run of the same pair): this
2-core machine's speed drifts by 10-30% over seconds, which a ratio of two medians takes in. Each
run also records CPU seconds (user, system), page faults, context switches and the 1-minute load
average when it started, so that a difference between methods can be traced to its cause. The
involuntary context switches of a run say best how much other processes took from it: the load
average is a minute's mean, while on a busy 2-core machine a bert-base dump's ratio went (before
the statistics moved to numpy) from about 1.3 in pairs whose bare run was not preempted (~25
switches) to 0.6 in pairs where it was (~500-1500): the bare forward's two threads fill both
cores, and lose most when one is taken, while modeltap's own writer thread already makes three
(~800 switches even when quiet).

`Method`'s fields toggle the two methods' differences one at a time (bench_fresh_factors.py).
`script` defines `CASES: dict[str, Case]` and hands its `--harness-child` argument to
`child_main` (bench_perf.py does).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SIDES = ("bare", "ours")
# Intra-op threads of the measured processes (the issue measured with 2).
THREADS = int(os.environ.get("MODELTAP_BENCH_THREADS", "2"))


@dataclass(frozen=True)
class Case:
    """One figure: `setup()` builds the workload (untimed) and returns its state; `bare(state,
    path)` and `ours(state, path)` are the two timed calls, each writing (if anything) to `path`,
    a file or a folder of its own, and returning None or the seconds of some of its parts.
    `imports` are imported before anything is timed."""

    label: str
    setup: Callable[[], Any]
    bare: Callable[[Any, Path], dict[str, float] | None]
    ours: Callable[[Any, Path], dict[str, float] | None]
    target: float | None = None
    imports: tuple[str, ...] = ()
    unit: str = "s"


@dataclass(frozen=True)
class Method:
    """How a figure is taken; the defaults are issue #22's fresh-process method."""

    fresh: bool = True  # each timed run in a new process (else one process, sides alternating)
    # What the process runs before its timed call: "none" (the timed call is its first),
    # "threads" (one parallel matmul: the intra-op thread pool started), "bare" (one call of the
    # bare side: the model's first forward, allocator, thread pool), "call" (the same call).
    warm: str = "none"
    remove: bool = True  # the previous run's output removed first (else overwritten in place)
    sync: bool = True  # os.sync() right before each timed call (outside the timing)
    alternate: bool = True  # pairs alternate bare-first and modeltap-first (else bare first)
    # Timed runs in each fresh process (a pair's ratio is then that of the two processes'
    # medians); 1: the timed call is the process's only one, and its first unless `warm`.
    runs: int = 1
    # Environment of the measured processes, e.g. glibc's malloc tunables: (("NAME", "value"),)
    env: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        where = "one process"
        if self.fresh:
            where = "a fresh process per run" if self.runs == 1 else f"{self.runs} runs a process"
        return (
            f"{where}, warm-up {self.warm}, "
            f"output {'removed' if self.remove else 'overwritten'}, "
            f"{'sync before' if self.sync else 'no sync'}, "
            f"{'alternating order' if self.alternate else 'bare first'}"
            + "".join(f", {k}={v}" for k, v in self.env)
        )


IN_PROCESS = Method(fresh=False, warm="call", remove=False, sync=True, alternate=False)
# What a user pays: each timed run one call in a new process (bench_perf.py --fresh).
FRESH = Method()
# Issue #22's harness as it describes itself: each side in a process of its own, a warm-up call
# and 5 timed runs, output removed and os.sync() first, pairs of processes alternating.
ISSUE = Method(warm="call", runs=5)


@dataclass
class Run:
    side: str
    wall: float
    user: float
    sys: float
    minflt: int
    majflt: int
    nivcsw: int  # involuntary context switches: other processes taking this one's cores
    load: float  # 1-minute load average when the run started
    size: int = 0  # bytes of output
    parts: dict[str, float] = field(default_factory=dict)  # seconds of parts, if the call says


@dataclass
class Result:
    case: str
    method: Method
    bare: list[Run] = field(default_factory=list)
    ours: list[Run] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """Each pair's ratio of wall seconds."""
        return self.pair_ratios(lambda r: r.wall)

    def pair_ratios(self, of: Callable[[Run], float]) -> list[float]:
        """Each pair's ratio: of two runs, or of two processes' medians (`Method.runs`)."""
        n = self.method.runs if self.method.fresh else 1
        med = statistics.median
        return [
            med(map(of, self.ours[i : i + n])) / med(map(of, self.bare[i : i + n]))
            for i in range(0, len(self.bare), n)
        ]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def median(self, side: str, attr: str = "wall") -> float:
        return statistics.median(getattr(r, attr) for r in getattr(self, side))

    @property
    def load(self) -> tuple[float, float]:
        loads = [r.load for r in self.bare + self.ours]
        return min(loads), max(loads)


# ---- inside a measured process -------------------------------------------------------------


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _timed(case: Case, side: str, state: Any, path: Path, method: Method) -> Run:
    if method.remove:
        _remove(path)
    if method.sync:
        # No dirty pages when the run starts: otherwise the kernel's writeback of what the
        # previous run wrote lands in this one, which then measures the disk's backlog.
        os.sync()
    load = os.getloadavg()[0]
    call = case.bare if side == "bare" else case.ours
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    parts = call(state, path)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return Run(
        side,
        wall,
        after.ru_utime - before.ru_utime,
        after.ru_stime - before.ru_stime,
        after.ru_minflt - before.ru_minflt,
        after.ru_majflt - before.ru_majflt,
        after.ru_nivcsw - before.ru_nivcsw,
        load,
        _size(path),
        parts or {},
    )


def _say(message: dict[str, Any]) -> None:
    print(_TAG + json.dumps(message), flush=True)


_TAG = "HARNESS "  # the lines of the protocol on a child's stdout, among whatever else is there


def child_main(cases: dict[str, Case], spec: str) -> None:
    """Entry point of a measured process: build the case, import, warm up as told, say it is
    ready; then time one run of the side named on each line of stdin, until it closes."""
    import torch

    args = json.loads(spec)
    method = Method(**{**args["method"], "env": tuple(map(tuple, args["method"]["env"]))})
    case = cases[args["case"]]
    folder = Path(args["folder"])
    torch.set_num_threads(THREADS)
    state = case.setup()
    for name in case.imports:
        importlib.import_module(name)
    paths = {side: folder / f"{side}.out" for side in SIDES}
    if method.warm == "threads":
        a = torch.ones(512, 512)
        for _ in range(3):
            a @ a
    elif method.warm in ("bare", "call"):
        for side in args["sides"]:  # to the side's own path, which the timed run then finds
            warm = case.bare if method.warm == "bare" or side == "bare" else case.ours
            _remove(paths[side])  # a folder where `warm` writes a file, or the other way
            warm(state, paths[side])
    _say({"ready": True})
    for line in sys.stdin:
        side = line.strip()
        _say(asdict(_timed(case, side, state, paths[side], method)))


# ---- the parent ----------------------------------------------------------------------------


class _Process:
    """A measured process holding `sides` of `case`, built and warmed up, waiting for runs."""

    def __init__(
        self, script: str, case: str, method: Method, sides: list[str], folder: Path
    ) -> None:
        spec = {"case": case, "method": asdict(method), "sides": sides, "folder": str(folder)}
        self.spec = spec
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, script, "--harness-child", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env={**os.environ, **dict(method.env)},
        )
        self._read()

    def run(self, side: str) -> Run:
        assert self.proc.stdin is not None
        self.proc.stdin.write(side + "\n")
        self.proc.stdin.flush()
        return Run(**self._read())

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_TAG):
                return json.loads(line[len(_TAG) :])
        self.proc.wait()
        self.err.seek(0)
        raise SystemExit(f"child {self.spec} failed:\n{self.err.read()[-3000:]}")

    def __enter__(self) -> _Process:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        if any(exc):
            self.proc.kill()
        self.proc.wait()
        self.err.close()


def _order(method: Method, done: int) -> tuple[str, ...]:
    """The sides' order in the next round, `done` rounds done."""
    return SIDES[::-1] if method.alternate and done % 2 else SIDES


def measure(
    script: str,
    case: str,
    method: Method,
    pairs: int,
    *,
    progress: bool = False,
    folder: Path | None = None,
    warmup: bool = True,
    into: Result | None = None,
) -> Result:
    """`pairs` paired runs of `case` (defined by the module `script`) taken by `method`.

    `folder`: where the outputs go (default: a temporary folder, removed after); `warmup`: the
    uncounted warm-up pair of fresh processes first; `into`: a result to add the pairs to (the
    order of a fresh pair alternates with the pairs already there)."""
    result = into or Result(case, method)
    if folder is None:
        tmp = os.environ.get("MODELTAP_BENCH_DIR")  # default $TMPDIR
        with tempfile.TemporaryDirectory(dir=tmp) as name:
            return measure(
                script,
                case,
                method,
                pairs,
                progress=progress,
                folder=Path(name),
                warmup=warmup,
                into=result,
            )
    if not method.fresh:
        with _Process(script, case, method, list(SIDES), folder) as both:
            for _ in range(pairs):
                for side in _order(method, len(result.bare)):
                    getattr(result, side).append(both.run(side))
        return result
    if warmup:
        for side in SIDES:
            with _Process(script, case, method, [side], folder) as one:
                one.run(side)
    for _ in range(pairs):
        # Both processes built and waiting before either is timed: the runs of a pair then
        # follow each other within seconds, as they do in one process.
        with (
            _Process(script, case, method, ["bare"], folder) as bare,
            _Process(script, case, method, ["ours"], folder) as ours,
        ):
            procs = {"bare": bare, "ours": ours}
            for _ in range(method.runs):
                for side in _order(method, len(result.bare)):
                    getattr(result, side).append(procs[side].run(side))
        if progress:
            print(
                f"  {case} pair {len(result.bare) // method.runs}: bare "
                f"{result.bare[-1].wall:.3f} s, modeltap {result.ours[-1].wall:.3f} s, "
                f"load {result.bare[-1].load:.2f}",
                file=sys.stderr,
                flush=True,
            )
    return result


def row(name: str, result: Result, unit: str = "s", target: float | None = None) -> str:
    """A markdown row: name | bare | modeltap | ratio [range] | target | load | CPU | faults."""
    scale = 1e3 if unit == "ms" else 1.0
    ratios = result.ratios
    mark = ""
    if target is not None:
        mark = f"<= {target}: {'met' if result.ratio <= target else 'MISSED'}"
    cpu = {s: result.median(s, "user") + result.median(s, "sys") for s in SIDES}
    cpu_ratio = statistics.median(result.pair_ratios(lambda r: r.user + r.sys))
    sys_s = {s: result.median(s, "sys") for s in SIDES}
    faults = {s: result.median(s, "minflt") / 1e3 for s in SIDES}
    switches = {s: result.median(s, "nivcsw") for s in SIDES}
    lo, hi = result.load
    size = result.median("ours", "size") / 1e6
    if size > 1:
        name += f" ({size:.0f} MB)"
    return (
        f"| {name} | {result.median('bare') * scale:.3g} {unit} "
        f"| {result.median('ours') * scale:.3g} {unit} "
        f"| {result.ratio:.2f} [{min(ratios):.2f}-{max(ratios):.2f}] "
        f"({result.median('ours') / result.median('bare'):.2f}) | {mark} | {lo:.2f}-{hi:.2f} "
        f"| {cpu['bare'] * scale:.3g} / {cpu['ours'] * scale:.3g} = {cpu_ratio:.2f} "
        f"(sys {sys_s['bare'] * scale:.2g} / {sys_s['ours'] * scale:.2g}) "
        f"| {faults['bare']:.0f}k / {faults['ours']:.0f}k "
        f"| {switches['bare']:.0f} / {switches['ours']:.0f} |"
    )


HEADER = (
    "| figure | bare | modeltap | ratio: median of pairs [range] (of medians) | target "
    "| load avg | CPU s bare / modeltap = ratio | minor faults | involuntary switches |"
    "\n|---|---|---|---|---|---|---|---|---|"
)


def save_runs(path: str | None, results: list[Result]) -> None:
    """Every run of every figure, as JSON, for a closer look."""
    if path:
        data = [
            {
                "case": r.case,
                "method": asdict(r.method),
                "bare": [asdict(x) for x in r.bare],
                "ours": [asdict(x) for x in r.ours],
            }
            for r in results
        ]
        Path(path).write_text(json.dumps(data, indent=1))
