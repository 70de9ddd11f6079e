"""Run the candidate, then the reference with each selected module replayed inline.

1. The candidate runs with the selected modules hooked; their outputs stream to a dump on disk.
2. The reference runs with the same modules hooked. In each module's forward hook:
   - its outputs are compared with the candidate's (read back from disk one tensor at a time):
     the **cumulative** error, with diff's metrics and tolerances;
   - the candidate's corresponding module is called on the module's exact args and kwargs, cast
     to its dtype and moved to its device, with each of its selected children short-circuited:
     the child returns what the reference child computes on the input the replay hands it,
     cast the same way, instead of running (see `Replayer.stand_in`). Its output against the
     reference's is the **local** error: the error of the module's own code, from perfect
     inputs, carried through its children as the reference computes them (an error made before
     a child reaches the output; the child's own does not). A child hands back its recorded
     output where its input is bit for bit that of its own replay, so it runs again only where
     its parent's code computed its input: all replays together cost about one candidate
     forward, not one per nesting level;
   - the reference module is replayed the same way and must reproduce its output bit for bit
     (**validation**: a module with hidden state, randomness or an input it changes in place
     can't be replayed faithfully, and is flagged rather than blamed).
   A module whose children can't stand in faithfully (an output changed in place after it
   returned, calls in another order, an output that can't be cast) is replayed in full, with
   its children computed again, and the report says so.
   Nothing is stored but each running module's children's outputs, freed as it returns.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.capture import Recorder, hooks, run_model
from modeltap.compare.replayer import Replayer, reference_hooks
from modeltap.compare.report import REPLAYED, CompareReport, ModuleResult, attribute
from modeltap.compare.variants import compute_dtype, model_device
from modeltap.diff.dumps import DiffReport, _norm
from modeltap.diff.keymap import apply_map, parse_map
from modeltap.diff.pairs import Pair, _Buffers, compare
from modeltap.diff.tolerance import Tolerance
from modeltap.dump import DumpWriter, load_dump
from modeltap.dump.format import _read_header, _torch_dtype
from modeltap.loading import Inputs
from modeltap.selection import ROOT

if TYPE_CHECKING:
    import torch
    from torch import nn

CANDIDATE_FILE = "candidate.safetensors"
REFERENCE_FILE = "reference.safetensors"


@dataclass
class Options:
    """How to compare; the defaults are diff's."""

    # A module's own code's error (local) is judged with `tolerance` (or an override's).
    tolerance: Tolerance = field(default_factory=Tolerance)
    overrides: Sequence[tuple[str, Tolerance]] = ()
    # A cumulative error holds the rounding of every module before it, each within `tolerance`:
    # it is judged with `tolerance` widened to at least this scaled_atol (see `accumulated`).
    accumulated_scaled_atol: float = 0.0
    rename: Sequence[str] = ()
    equal_nan: bool = False
    train_mode: bool = False
    seed: int = 0
    # Replay only modules with at most this many dotted name parts (None: every selected one).
    replay_depth: int | None = None

    def accumulated(self, tol: Tolerance) -> Tolerance:
        """`tol` as it judges a cumulative error: rounding passed on from module to module grows
        with the magnitudes the tensors hold, which only a scale-relative term accepts."""
        return replace(tol, scaled_atol=max(tol.scaled_atol, self.accumulated_scaled_atol))


def compare_models(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    modules: list[str],
    work_dir: str | os.PathLike[str],
    *,
    options: Options | None = None,
    keep: bool = False,
    stats_only: bool = False,
    metadata: tuple[dict[str, str], dict[str, str]] = ({}, {}),
) -> CompareReport:
    """Compare `candidate` with `reference` on `inputs`, module by module (display names).

    The candidate's dump is written to `work_dir` (it holds the tensors the cumulative comparison
    reads back). With `keep`, `work_dir` keeps candidate.safetensors and the reference's
    reference.safetensors, so `modeltap diff` and `show` can look again later; with `stats_only`
    too, both keep statistics only (the candidate's tensors go to a temporary file, removed).
    """
    import torch

    options = options or Options()
    work = Path(work_dir)
    rules = parse_map(options.rename)
    cand_names = {(n or ROOT): m for n, m in candidate.named_modules()}
    counterpart: dict[str, str] = {}
    for cname in cand_names:
        counterpart.setdefault(apply_map(cname, rules), cname)
    results = {name: ModuleResult(name, other=counterpart.get(name)) for name in modules}
    for result in results.values():
        if result.other is None:
            result.status = "unmapped"

    mask = inputs.attention_mask
    row_mask = None if mask is None else mask.bool()
    cand_path = work / (f".{CANDIDATE_FILE}.tensors" if stats_only and keep else CANDIDATE_FILE)
    cand_modules = [r.other for r in results.values() if r.other is not None]
    reserve = 4096 + 1536 * len(modules)  # header room, as the reference's dump below
    _run_candidate(
        candidate, inputs, cand_modules, (cand_path, reserve), row_mask, metadata[1], options
    )
    try:
        cand_dump = load_dump(cand_path)
        cumulative = _Cumulative(cand_dump, _TensorReader(cand_path), rules, options)
        replayer = Replayer(reference, cand_names, results, options)
        replayer.buffers = cumulative.buffers  # one set of work buffers: they are the largest
        replayer.ref_norms = cumulative.ref_norms
        with ExitStack() as stack:
            sinks: list[Any] = [cumulative]
            ref_writer = None
            if keep:
                ref_writer = DumpWriter(
                    work / REFERENCE_FILE,
                    stats_only=stats_only,
                    row_mask=row_mask,
                    reserve=reserve,
                )
                sinks.insert(0, stack.enter_context(ref_writer))
            recorder = Recorder(_Tee(sinks))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(options.seed)
                with reference_hooks(reference, results, recorder, replayer, options.train_mode):
                    with torch.no_grad():
                        run_model(reference, inputs.args, inputs.kwargs)
            if ref_writer is not None:
                ref_writer.finish(_meta(reference, inputs, recorder, metadata[0], options))
        if stats_only and keep:
            _stats_only_copy(cand_dump, work / CANDIDATE_FILE)
    finally:
        if stats_only and keep:
            cand_path.unlink(missing_ok=True)
    report = cumulative.report(work / CANDIDATE_FILE, work / REFERENCE_FILE)
    return _report(report, cumulative, results, options)


def _run_candidate(
    candidate: nn.Module,
    inputs: Inputs,
    modules: list[str],
    dump: tuple[Path, int],
    row_mask: Any,
    extra: dict[str, str],
    options: Options,
) -> None:
    """Run the candidate with its `modules` hooked, their outputs dumped to `dump` (its path and
    the header room it reserves)."""
    import torch

    cand_inputs = inputs.to(str(model_device(candidate)), compute_dtype(candidate))
    path, reserve = dump
    writer = DumpWriter(path, row_mask=row_mask, reserve=reserve)
    with writer, torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        with hooks(candidate, modules, writer, train_mode=options.train_mode) as rec:
            with torch.no_grad():
                run_model(candidate, cand_inputs.args, cand_inputs.kwargs)
        writer.finish(_meta(candidate, inputs, rec, extra, options))


def _report(
    report: DiffReport,
    cumulative: _Cumulative,
    results: dict[str, ModuleResult],
    options: Options,
) -> CompareReport:
    """The compare report: each module's cumulative pairs given to it, the blame attributed."""
    for key, pair in cumulative.by_key.items():  # aliases too: a module's own keys
        module = results.get(_module(key))
        if module is not None and all(p is not pair for p in module.cumulative):
            module.cumulative.append(pair)
    for result in results.values():
        if result.status == REPLAYED and result.calls == 0:
            result.status = "not_called"
    ordered = list(results.values())
    attribute(ordered)
    return CompareReport(
        reference={},
        candidate={},
        cumulative=report,
        modules=ordered,
        tolerance=options.tolerance,
        replay_depth=options.replay_depth,
    )


def _module(key: str) -> str:
    from modeltap.capture import split_key

    return split_key(key)[0]


def _meta(
    model: nn.Module, inputs: Inputs, rec: Recorder, extra: dict[str, str], options: Options
) -> dict[str, str]:
    from modeltap.dumping import environment

    return {
        "kind": "activations",
        **environment(),
        "model_class": type(model).__name__,
        "seed": str(options.seed),
        "train_mode": str(options.train_mode).lower(),
        **extra,
        "inputs": json.dumps(inputs.description),
        "order": json.dumps(rec.order),
        "skipped": json.dumps(rec.skipped),
        "skipped_none": str(rec.skipped_none),
    }


def _stats_only_copy(dump: Any, path: Path) -> None:
    """The candidate's dump without its tensors: statistics, order and aliases only."""
    writer = DumpWriter(path, stats_only=True)
    with writer:
        writer.stats = dict(dump.stats)
        writer.aliases = dict(dump.aliases)
        meta = {k: v for k, v in dump.metadata.items() if k not in ("stats", "aliases")}
        for key in ("format", "format_version", "stats_only", "dead_threshold"):
            meta.pop(key, None)
        writer.finish(meta)


class _TensorReader:
    """Reads one tensor of a dump at a time with plain file reads: no memory map, so what was
    read is freed with the tensor instead of staying resident in this process."""

    def __init__(self, path: Path) -> None:
        header = _read_header(path)
        assert header is not None  # written by DumpWriter just now
        self.start, self.entries = header
        self.file = open(path, "rb")  # noqa: SIM115 - closed in __del__ with the reader

    def __del__(self) -> None:
        self.file.close()

    def read(self, key: str) -> torch.Tensor:
        import torch

        info = self.entries[key]
        begin, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=_torch_dtype(info["dtype"]))
        if end > begin:
            self.file.seek(self.start + begin)
            self.file.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
        return out


class _Tee:
    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = sinks

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        for sink in self.sinks:
            sink.tensor(key, tensor)

    def alias(self, key: str, target: str) -> None:
        for sink in self.sinks:
            sink.alias(key, target)


class _Cumulative:
    """A capture sink for the reference run: each output against the candidate's, as diff would
    (A = candidate, B = reference), as soon as the reference produces it."""

    def __init__(self, cand: Any, reader: _TensorReader, rules: Any, options: Options) -> None:
        self.cand = cand
        self.reader = reader
        self.options = options
        self.by_ref = {}
        for key in cand.keys():
            self.by_ref.setdefault(apply_map(key, rules), key)
        self.pairs: list[Pair] = []
        self.done: dict[str, Pair] = {}  # candidate's stored key -> its pair
        self.by_key: dict[str, Pair] = {}  # reference key -> its pair
        self.only_ref: list[str] = []
        self.matched: set[str] = set()
        self.buffers = _Buffers()
        self.ref_norms: dict[str, float | None] = {}  # reference key -> its L2 norm

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        other = self.by_ref.get(key)
        if other is None:
            self.only_ref.append(key)
            return
        self.matched.add(other)
        stored = self.cand.resolve(other)
        if stored in self.done:  # the candidate holds one tensor where the reference has two
            self.done[stored].aliases.append(other)
            return
        tol = next(
            (t for glob, t in self.options.overrides if fnmatchcase(other, glob)),
            self.options.tolerance,
        )
        tol = self.options.accumulated(tol)
        ref = tensor.detach()
        norm = self.ref_norms[key] = _l2(ref)
        pair = compare(
            other,
            key,
            self.reader.read(stored),
            ref,
            tol,
            equal_nan=self.options.equal_nan,
            upcast=True,
            norms=(_norm(self.cand, stored), norm),  # the candidate's from its dump's statistics
            buffers=self.buffers,
        )
        self.done[stored] = pair
        self.by_key[key] = pair
        self.pairs.append(pair)

    def alias(self, key: str, target: str) -> None:
        other = self.by_ref.get(key)
        if other is None:
            self.only_ref.append(key)
            return
        self.matched.add(other)
        pair = self.by_key.get(target)
        if pair is not None:
            pair.aliases.append(other)
            self.by_key[key] = pair
            self.ref_norms[key] = self.ref_norms.get(target)

    def report(self, cand_path: Path, ref_path: Path) -> DiffReport:
        only_cand = [
            k for k in self.cand.keys() if k not in self.matched and not k.startswith("grad/")
        ]
        return DiffReport(
            cand_path,
            ref_path,
            self.options.accumulated(self.options.tolerance),
            self.pairs,
            only_cand,
            self.only_ref,
            [],
            ordered=True,
        )


def _l2(tensor: torch.Tensor) -> float | None:
    """The L2 norm diff's cosine takes (in float64), or None where it doesn't apply."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    return norm if math.isfinite(norm) else None
