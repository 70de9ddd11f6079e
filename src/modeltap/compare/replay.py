"""Run the candidate, then the reference with each selected module replayed inline.

1. The candidate runs with the selected modules hooked; their outputs stream to a dump on disk.
2. The reference runs with the same modules hooked. In each module's forward hook:
   - its outputs are compared with the candidate's (read back from disk one tensor at a time):
     the **cumulative** error, with diff's metrics and tolerances;
   - the candidate's corresponding module is called on the module's exact args and kwargs, cast
     to its dtype and moved to its device, with each of its selected children short-circuited:
     the child returns the reference child's output of that call (cast the same way) instead of
     running (see `shortcut`). Its output against the reference's is the **local** error: the
     error of the module's own code, from perfect inputs and perfect children's outputs. Every
     operation of the model so runs in one module's replay only: all replays together cost
     about one candidate forward, not one per nesting level;
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
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.capture import Recorder, flatten, hooks, make_key, run_model
from modeltap.compare.report import (
    FULL,
    LEAF,
    REPLAYED,
    SHORT_CIRCUIT,
    CompareReport,
    ModuleResult,
    attribute,
)
from modeltap.compare.shortcut import (
    Frame,
    Mismatch,
    Record,
    Shortcut,
    changed,
    check_castable,
    rebuild,
    versions,
)
from modeltap.compare.variants import attn_impl, compute_dtype, model_device
from modeltap.diff.dumps import DiffReport, _norm
from modeltap.diff.keymap import apply_map, parse_map
from modeltap.diff.pairs import Pair, _Buffers, compare
from modeltap.diff.tolerance import Tolerance
from modeltap.dump import DumpWriter, load_dump
from modeltap.dump.format import _read_header, _torch_dtype
from modeltap.errors import first_line
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
    cand_inputs = inputs.to(str(model_device(candidate)), compute_dtype(candidate))
    cand_modules = [r.other for r in results.values() if r.other is not None]
    cand_writer = DumpWriter(cand_path, row_mask=row_mask, reserve=4096 + 1536 * len(modules))
    with cand_writer, torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        with hooks(candidate, cand_modules, cand_writer, train_mode=options.train_mode) as rec:
            with torch.no_grad():
                run_model(candidate, cand_inputs.args, cand_inputs.kwargs)
        cand_writer.finish(_meta(candidate, inputs, rec, metadata[1], options))
    try:
        cand_dump = load_dump(cand_path)
        cumulative = _Cumulative(cand_dump, _TensorReader(cand_path), rules, options)
        replayer = _Replayer(reference, cand_names, results, options)
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
                    reserve=4096 + 1536 * len(modules),
                )
                sinks.insert(0, stack.enter_context(ref_writer))
            recorder = Recorder(_Tee(sinks))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(options.seed)
                with _reference_hooks(reference, results, recorder, replayer, options.train_mode):
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


class _Replayer:
    """Replays a reference module's call on the reference itself and on the candidate, its
    selected children short-circuited to their recorded outputs."""

    def __init__(
        self,
        reference: nn.Module,
        cand_modules: dict[str, nn.Module],
        results: dict[str, ModuleResult],
        options: Options,
    ) -> None:
        self.ref_modules = {(n or ROOT): m for n, m in reference.named_modules()}
        self.cand_modules = cand_modules
        self.results = results
        self.options = options
        self.active = False  # True during a replay: hooks fired by it are not the forward's
        self.buffers = _Buffers()
        # A module without weights (an activation, a dropout) computes in the candidate's dtype.
        root = cand_modules[ROOT]
        self.default = (compute_dtype(root), model_device(root))
        self.placement: dict[str, tuple[Any, Any]] = {}
        self.ref_norms: dict[str, float | None] = {}  # the cumulative sink's, shared
        # Attention masks are built by the model in its attention implementation's format
        # (sdpa: boolean, eager: additive). A candidate with another implementation gets the
        # reference's masks in the additive form, which every implementation reads.
        self.additive_masks = attn_impl(reference) != attn_impl(root)

    def within_depth(self, name: str) -> bool:
        depth = self.options.replay_depth
        return depth is None or _depth(name) <= depth

    def wants(self, name: str) -> bool:
        """Whether a call of `name` will be replayed, so its children's outputs are kept."""
        return self.results[name].status == REPLAYED and self.within_depth(name)

    def can_stand_in(self, name: str) -> bool:
        """Whether `name` can be short-circuited in its caller's replay: it has a counterpart in
        the candidate and is replayed itself (below the replay depth, the caller computes it)."""
        return self.results[name].other is not None and self.within_depth(name)

    def _cand_placement(self, name: str) -> tuple[Any, Any]:
        """dtype and device of the candidate's counterpart of reference module `name`."""
        found = self.placement.get(name)
        if found is None:
            cand = self.cand_modules[self.results[name].other or ""]
            found = self.placement[name] = _module_dtype_device(cand) or self.default
        return found

    def _to_candidate(self, name: str, output: Any) -> Any:
        dtype, device = self._cand_placement(name)

        def leaf(t: torch.Tensor) -> torch.Tensor:
            floating = dtype if t.is_floating_point() else None
            return t.detach().to(device=device, dtype=floating, copy=True)

        return rebuild(output, leaf)

    def __call__(
        self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any, frame: Frame
    ) -> None:
        import torch

        result = self.results[name]
        call = result.calls
        result.calls += 1
        if result.status != REPLAYED:
            return
        if not self.within_depth(name):
            result.status = "not_replayed"
            return
        why = _not_replayable(module, args, kwargs)
        if why:
            result.status = why
            return
        if any(not r.valid for r in frame.records):
            result.valid = False
            result.note = "a selected child does not reproduce its own output"
        cand = self.cand_modules[result.other or ""]
        dtype, device = self._cand_placement(name)
        masks = self.additive_masks
        records = frame.records
        fallback = _cannot_stand_in(records)
        self.active = True
        try:
            with torch.random.fork_rng(devices=_rng_devices(device)), torch.no_grad():
                replayed = None
                if records and fallback is None:
                    try:
                        again, replayed = self._short_circuited(
                            module, cand, args, kwargs, records, dtype, device
                        )
                    except Mismatch as exc:
                        fallback = str(exc)
                    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
                        # Maybe the stand-ins' doing: the full replay tells.
                        fallback = f"the short-circuited replay failed: {first_line(exc)}"
                    if fallback is None and changed(records) is not None:
                        result.valid = False
                        result.note = "its replay changed a child's output in place"
                if replayed is None:
                    again = module(*_cast(args, None, None), **_cast(kwargs, None, None))
                    try:
                        replayed = cand(
                            *_cast(args, dtype, device, masks),
                            **_cast(kwargs, dtype, device, masks),
                        )
                    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
                        result.status = "replay_error"
                        result.note = first_line(exc)
                        return
                if not _identical(again, output):
                    result.valid = False
                    result.note = "replaying the reference did not reproduce its output"
                del again
        finally:
            self.active = False
        self._mode(result, records, frame.inline, fallback)
        expected = dict(flatten(output))
        got = dict(flatten(replayed))
        for part, ref in expected.items():
            if not isinstance(ref, torch.Tensor) or not ref.is_floating_point():
                continue
            value = got.get(part)
            key = make_key(name, call, part)
            if not isinstance(value, torch.Tensor):
                result.status = "replay_error"
                result.note = f"the candidate's module returned no tensor for '{key}'"
                return
            tol = next(
                (t for glob, t in self.options.overrides if fnmatchcase(key, glob)),
                self.options.tolerance,
            )
            pair = compare(
                key,
                key,
                value.detach().to(ref.device),
                ref.detach(),
                tol,
                equal_nan=self.options.equal_nan,
                upcast=True,
                # the reference's norm, taken once for its cumulative pair
                norms=(None, self.ref_norms.get(key)),
                buffers=self.buffers,
            )
            result.local.append(pair)

    def _short_circuited(
        self,
        module: nn.Module,
        cand: nn.Module,
        args: Any,
        kwargs: Any,
        records: list[Record],
        dtype: Any,
        device: Any,
    ) -> tuple[Any, Any]:
        """The reference's and the candidate's replays, each child standing in with its
        recorded output (the candidate's cast to its counterpart's dtype and device)."""
        reference = Shortcut(records, self.ref_modules.__getitem__, lambda r: r.output)
        with reference:
            again = module(*_cast(args, None, None), **_cast(kwargs, None, None))
        reference.check()
        masks = self.additive_masks
        candidate = Shortcut(
            records,
            lambda name: self.cand_modules[self.results[name].other or ""],
            lambda r: self._to_candidate(r.child, r.output),
        )
        with candidate:
            replayed = cand(
                *_cast(args, dtype, device, masks), **_cast(kwargs, dtype, device, masks)
            )
        candidate.check()
        return again, replayed

    @staticmethod
    def _mode(
        result: ModuleResult, records: list[Record], inline: list[str], fallback: str | None
    ) -> None:
        """How this call was replayed; a module replayed in full once is reported in full."""
        if fallback is not None or inline:
            if result.replay != FULL:
                why = fallback or (
                    "computes in the replay its children "
                    + ", ".join(dict.fromkeys(inline))
                    + " (no counterpart, or below the replay depth)"
                )
                result.replay_note = why
            result.replay = FULL
        elif records and result.replay != FULL:
            result.replay = SHORT_CIRCUIT
        elif not result.replay:
            result.replay = LEAF


def _cannot_stand_in(records: list[Record]) -> str | None:
    """Why the recorded children can't stand in for themselves, known before any replay."""
    child = changed(records)
    if child is not None:
        return f"'{child}''s output was changed in place after it returned"
    try:
        check_castable(records)
    except Mismatch as exc:
        return str(exc)
    return None


def _l2(tensor: torch.Tensor) -> float | None:
    """The L2 norm diff's cosine takes (in float64), or None where it doesn't apply."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    return norm if math.isfinite(norm) else None


def _depth(name: str) -> int:
    return 0 if name == ROOT else name.count(".") + 1


def _rng_devices(device: Any) -> list[Any]:
    return [device] if getattr(device, "type", "cpu") == "cuda" else []


def _module_dtype_device(module: nn.Module) -> tuple[Any, Any] | None:
    """The dtype and device of a module's first floating parameter or buffer, if any."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype, tensor.device
    return None


def _cast(value: Any, dtype: Any, device: Any, additive_masks: bool = False) -> Any:
    """Tensors in args/kwargs, floating ones cast to `dtype`, all moved to `device`; always new
    tensors, so a module that changes its input in place can't touch the reference's.
    `additive_masks`: 4-d boolean masks become additive ones (0 to keep, dtype's min to drop)."""
    import torch

    if isinstance(value, torch.Tensor):
        if additive_masks and value.dtype == torch.bool and value.dim() == 4:
            work = dtype or torch.float32
            mask = torch.zeros(value.shape, dtype=work, device=device)
            return mask.masked_fill_(~value.to(device), torch.finfo(work).min)
        floating = dtype if value.is_floating_point() and dtype is not None else None
        return value.detach().to(device=device, dtype=floating, copy=True)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_cast(v, dtype, device, additive_masks) for v in value)
    if isinstance(value, list):
        return [_cast(v, dtype, device, additive_masks) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: _cast(v, dtype, device, additive_masks) for k, v in value.items()}
    return value


def _identical(a: Any, b: Any) -> bool:
    """Bit for bit, NaNs in the same places equal."""
    import torch

    left, right = list(flatten(a)), list(flatten(b))
    if [p for p, _ in left] != [p for p, _ in right]:
        return False
    for (_, x), (_, y) in zip(left, right, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not torch.equal(x, y):
            if not x.is_floating_point():
                return False
            both_nan = torch.isnan(x) & torch.isnan(y)
            if not bool(((x == y) | both_nan).all()):
                return False
    return True


def _not_replayable(module: nn.Module, args: Any, kwargs: Any) -> str | None:
    """`nondeterministic` for active dropout in the module, `stateful` for a cache in the call."""
    from torch import nn

    if module.training and any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()
    ):
        return "nondeterministic"
    for _, leaf in flatten((args, kwargs)):
        if type(leaf).__name__.endswith("Cache") or hasattr(leaf, "get_seq_length"):
            return "stateful"
    return None


@contextmanager
def _reference_hooks(
    model: nn.Module,
    results: dict[str, ModuleResult],
    recorder: Recorder,
    replayer: _Replayer,
    train_mode: bool,
) -> Iterator[None]:
    """Hook the reference for the duration of the block; hooks and modes are restored after.

    A pre-hook pushes a frame for each selected module's call; its forward hook pops it, replays
    the module with the children recorded there, and records its own output in its caller's
    frame (the nearest selected module running), which holds it until that caller returns."""
    by_name = replayer.ref_modules
    handles = []
    modes = {m: m.training for m in by_name.values()}
    stack: list[Frame] = []

    def make_pre(name: str) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if not replayer.active:
                stack.append(Frame(name, replayer.wants(name)))

        return pre_hook

    def make(name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if replayer.active:
                return
            frame = stack.pop() if stack and stack[-1].name == name else Frame(name, False)
            before = versions(output)
            recorder.record(name, output)
            replayer(name, module, args, kwargs, output, frame)
            if stack and stack[-1].wanted:
                caller = stack[-1]
                if replayer.can_stand_in(name):
                    valid = results[name].valid
                    caller.records.append(Record(name, output, before, valid))
                else:
                    caller.inline.append(name)

        return hook

    try:
        model.train(train_mode)
        for name in results:
            module = by_name[name]
            handles.append(module.register_forward_pre_hook(make_pre(name)))
            handles.append(module.register_forward_hook(make(name), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            if module.training != training:
                module.training = training
