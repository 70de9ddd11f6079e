"""The replayer: a reference module's call replayed inline, on the reference and on the candidate.

`compare_models` (replay.py) hooks the reference with `reference_hooks`; each selected module's
forward hook hands its call to a `Replayer`, which replays it on the reference (validation) and on
the candidate's counterpart (the local error), its recorded children standing in for themselves
where they can (see `shortcut`), and compares the outputs.

In the candidate's replay a child stands in with the reference child's output on the input the
replayed parent hands it (`Replayer.stand_in`): the error of the parent's own code before the
child reaches the parent's output through the child, as it would in the candidate, while the
child's own error stays out (its own replay measures it, from the reference's input).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from modeltap.capture import Recorder, flatten, make_key
from modeltap.compare.report import FULL, LEAF, REPLAYED, SHORT_CIRCUIT, ModuleResult
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
from modeltap.diff.pairs import _Buffers, compare
from modeltap.errors import first_line
from modeltap.selection import ROOT

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.compare.replay import Options


class Replayer:
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
        self.ref_default = (compute_dtype(reference), model_device(reference))
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
        self._compare_outputs(name, result, call, output, replayed)

    def _compare_outputs(
        self, name: str, result: ModuleResult, call: int, output: Any, replayed: Any
    ) -> None:
        """The candidate's replayed outputs against the reference's: the call's local pairs."""
        import torch

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
        reference = Shortcut(records, self.ref_modules.__getitem__, lambda r, a, k: r.output)
        with reference:
            again = module(*_cast(args, None, None), **_cast(kwargs, None, None))
        reference.check()
        masks = self.additive_masks
        candidate = Shortcut(
            records, lambda name: self.cand_modules[self.results[name].other or ""], self.stand_in
        )
        with candidate:
            replayed = cand(
                *_cast(args, dtype, device, masks), **_cast(kwargs, dtype, device, masks)
            )
        candidate.check()
        return again, replayed

    def stand_in(self, record: Record, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A selected child's output in its candidate parent's replay: the reference child's on
        the input the parent hands it, cast for the candidate. Where that input is the one the
        child's own replay starts from (the reference's, cast as every replay casts it), the
        parent's code changed nothing on the way in, and the output is the recorded one: the
        cast's effect is counted once, in the child's own replay, and the child is not run."""
        if self._as_replayed(record, args, kwargs):
            output = record.output
        else:
            module = self.ref_modules[record.child]
            dtype, device = _module_dtype_device(module) or self.ref_default
            output = module(*_cast(args, dtype, device), **_cast(kwargs, dtype, device))
        return self._to_candidate(record.child, output)

    def _as_replayed(self, record: Record, args: Any, kwargs: Any) -> bool:
        """Whether a stand-in's inputs are bit for bit those of the child's own replay."""
        if record.inputs is None or versions(record.inputs) != record.input_versions:
            return False  # changed in place since: what the reference gave is gone
        dtype, device = self._cand_placement(record.child)
        return _same_call(_cast(record.inputs, dtype, device, self.additive_masks), (args, kwargs))

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


def _same_call(a: Any, b: Any) -> bool:
    """`_identical`, and every leaf that is not a tensor equal too."""
    import torch

    try:
        if not _identical(a, b):
            return False
        for (_, x), (_, y) in zip(flatten(a), flatten(b), strict=True):
            if not isinstance(x, torch.Tensor) and (type(x) is not type(y) or not bool(x == y)):
                return False
    except (RuntimeError, TypeError, ValueError):  # tensors on two devices, an odd `==`
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
def reference_hooks(
    model: nn.Module,
    results: dict[str, ModuleResult],
    recorder: Recorder,
    replayer: Replayer,
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
        def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not replayer.active:
                # A caller that will be replayed keeps the call's inputs for its stand-in.
                kept = versions((args, kwargs)) if stack and stack[-1].wanted else None
                stack.append(Frame(name, replayer.wants(name), input_versions=kept))

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
                    kept = frame.input_versions
                    inputs = (args, kwargs) if versions((args, kwargs)) == kept else None
                    record = Record(name, output, before, results[name].valid, inputs, kept)
                    caller.records.append(record)
                else:
                    caller.inline.append(name)

        return hook

    try:
        model.train(train_mode)
        for name in results:
            module = by_name[name]
            handles.append(module.register_forward_pre_hook(make_pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(make(name), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            if module.training != training:
                module.training = training
