"""`record`: statistics (now and then full tensors) of a model inside the user's training loop.

The hooks stay on for the whole `with` block; on a step that is not recorded and with the tripwire
off they do one attribute check each. A recorded step streams the statistics of every selected
module's output, of the gradients w.r.t. those outputs (tensor hooks, so the user's own backward
computes them) and of the parameter gradients (read when an optimizer over the model's parameters
is about to step, or when the closure of `optimizer.step(closure)` returns, else at `step()`)
into `step{N:06d}.rank{R}.safetensors`, the dump format.

A step holds the training forward and backward only: a forward under `torch.no_grad()` /
`inference_mode()` or with the model in eval mode is an evaluation, left out, or with `eval=True`
written to its own `eval{N:06d}.rank{R}.safetensors` (N: the last training step that ran).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.capture import Recorder, split_key
from modeltap.dump import GRAD_PREFIX, DumpWriter
from modeltap.errors import InputError
from modeltap.record import dist
from modeltap.record.index import (
    IndexWriter,
    eval_file_name,
    run_files,
    step_file_name,
    summary,
    write_error,
)
from modeltap.record.rules import (
    ACTIVATION,
    GRADIENT,
    PARAM_GRAD,
    UPDATE,
    ExplodingGradient,
    Observation,
    RuleHit,
    VanishingGradient,
    apply_rules,
    default_rules,
)
from modeltap.record.sentinel import Sentinel, grad_leaves
from modeltap.record.tripwire import BACKWARD, FORWARD, NonFiniteError, Trip, Watch
from modeltap.selection import ROOT, Selection, select_modules

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.record.tripwire import Call, Shape

logger = logging.getLogger("modeltap.record")

ON_NONFINITE = ("raise", "dump", "warn", "dump-warn", "off")
# What `resume` takes: continue a run, and "truncate": continue it from a step before its last,
# the later steps moved aside.
RESUME = (False, True, "truncate")
# Header bytes reserved per recorded key (statistics and entry).
_RESERVE_PER_KEY = 768

RuleFn = Callable[[Observation], "tuple[float, str] | None"]


def _writes(method: Callable[..., Any]) -> Callable[..., Any]:
    """A Recording method that writes the run's files: a failed write ends the step's file
    (`Recording._write_failed`)."""

    @functools.wraps(method)
    def wrapper(self: Recording, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise self._write_failed(exc) from None

    return wrapper


class Recording:
    """What `record(...)` returns; use it as a context manager and call `step()` once per step."""

    def __init__(
        self,
        model: nn.Module,
        out_dir: str | os.PathLike[str],
        *,
        every: int = 100,
        grads: bool = True,
        params: bool = True,
        stats_only: bool = True,
        full_every: int | None = None,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        depth: int | None = None,
        on_nonfinite: str = "raise",
        rules: Sequence[RuleFn] | None = None,
        gather: bool = False,
        dead_threshold: float = 0.0,
        start_step: int | None = None,
        hist: bool = False,
        eval: bool = False,
        eval_batches: int | None = 1,
        scaler: Any = None,
        resume: bool | str = False,
        overwrite: bool = False,
        keep_last: int = 8,
        flight: bool = False,
        eager_tripwire: bool = False,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise InputError(f"every must be a whole number of steps >= 1, got {every!r}")
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise InputError(f"full_every must be None or a number of steps >= 1, not {full_every}")
        if on_nonfinite not in ON_NONFINITE:
            raise InputError(
                f"on_nonfinite must be one of {', '.join(ON_NONFINITE)}, got {on_nonfinite!r}"
            )
        if eval_batches is not None and (not isinstance(eval_batches, int) or eval_batches < 1):
            raise InputError(f"eval_batches must be None or >= 1, got {eval_batches!r}")
        if resume not in RESUME:
            raise InputError(f"resume must be True, False or 'truncate', got {resume!r}")
        if resume and overwrite:
            raise InputError("resume and overwrite=True exclude each other; pick one")
        if start_step is not None and (not isinstance(start_step, int) or start_step < 0):
            raise InputError(f"start_step must be None or a step number >= 0, got {start_step!r}")
        if not isinstance(keep_last, int) or keep_last < 0:
            raise InputError(f"keep_last must be a number of steps >= 0, got {keep_last!r}")
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise InputError(f"'{self.out_dir}' is a file; give record() a folder for the run")
        self.model = dist.unwrap(model)
        self.every = every
        self.grads = grads
        self.params = params
        self.stats_only = stats_only
        self.full_every = full_every
        self.selection = Selection(depth, tuple(include), tuple(exclude))
        self.on_nonfinite = on_nonfinite
        if flight and on_nonfinite == "off":
            raise InputError("flight=True needs the tripwire; drop on_nonfinite='off'")
        # The flight recorder: a forward trip's file lets `modeltap replay` re-run its module.
        self.flight = flight or on_nonfinite.startswith("dump")
        # Steps that are not recorded check where non-finite values end up and run again under
        # the full tripwire only when one does (record.sentinel); the flight recorder and "dump"
        # take what they keep from that run, which starts from the step's own RNG states.
        self.eager_tripwire = eager_tripwire
        self.rules: list[RuleFn] = list(default_rules() if rules is None else rules)
        self.gather = gather
        self.dead_threshold = dead_threshold
        self.hist = hist
        self.hits: list[RuleHit] = []
        self.trips: list[Trip] = []
        # Given, it is the training's own step number (a framework's global_step): a resumed
        # run keeps it. Left out, a new run starts at 0 and a resumed one after its last step.
        self._start_given = start_step is not None
        self.step_index = start_step or 0
        self.eval = eval
        self.eval_batches = eval_batches
        self.scaler = scaler
        self.resume = resume
        self.overwrite = overwrite
        self.skipped: list[int] = []  # steps a GradScaler skipped (inf/NaN gradients)
        # The last recorded steps' summaries, carried by a trip's file as the trend before it.
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep_last)
        self.rank = dist.RankInfo()
        self._modules: list[str] = select_modules(self.model, self.selection)
        self._by_name = {(n or ROOT): m for n, m in self.model.named_modules()}
        self._handles: list[Any] = []
        self._index: IndexWriter | None = None
        self._watch: Watch | None = None
        self._sentinel: Sentinel | None = None
        self._lazy = False  # this step checks through the sentinel, not the full watch
        self._dumped: set[str] = set()
        self._lock = threading.Lock()
        self._optimizers: dict[int, bool] = {}
        self._param_ids: set[int] = set()
        self._named_params: list[tuple[str, Any]] = []
        self._ran: set[str] = set()
        self._structural: set[str] = set()  # parameters whose gradient is zero by construction
        self._eval_writer: DumpWriter | None = None
        self._eval_recorder: Recorder | None = None
        self._eval_forwards = 0
        self._eval_at = 0  # the step the open evaluation file belongs to
        self._eval_files: set[str] = set()
        self._reset_step_state()

    # -- the with block ---------------------------------------------------------------------
    def __enter__(self) -> Recording:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.rank = dist.rank_info()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(exc, self.out_dir) from None
        if not os.access(self.out_dir, os.W_OK):
            raise InputError(f"'{self.out_dir}' is not writable; give record() another folder")
        resumed = self._claim_folder()
        self._named_params = [(n, p) for n, p in self.model.named_parameters()]
        self._param_ids = {id(p) for _, p in self._named_params}
        try:
            if self.on_nonfinite != "off":
                self._watch = Watch(
                    hold_grads=self.on_nonfinite.startswith("dump"),
                    on_backward_end=self._after_backward,
                )
                # a re-run on one rank would wait in collectives the others never join
                if not self.eager_tripwire and self.rank.world_size == 1:
                    self._sentinel = Sentinel(on_backward_end=self._after_lazy_backward)
            root = self.model
            self._handles.append(
                root.register_forward_pre_hook(self._before_forward, with_kwargs=True)
            )
            for name in self._modules:
                hook = self._forward_hook(name)
                module = self._by_name[name]
                if self.flight:
                    self._handles.append(module.register_forward_pre_hook(self._rng_hook(name)))
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
            # Registered last, so that it runs after the root's own capture hook.
            self._handles.append(root.register_forward_hook(self._after_forward))
            self._handles.append(register_optimizer_step_pre_hook(self._before_optimizer))
            self._handles.append(register_optimizer_step_post_hook(self._after_optimizer))
            if not (self.gather and self.rank.rank != 0):  # gathering ranks write no index
                self._index = IndexWriter(self.out_dir, self.rank.rank)
                self._index.write(
                    "resume" if resumed else "start",
                    rank=self.rank.rank,
                    world_size=self.rank.world_size,
                    backend=self.rank.backend,
                    **self._settings(),
                    modules=len(self._modules),
                    model_class=type(self.model).__name__,
                    start_step=self.step_index,
                )
            self._begin_step()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self._check_pending()
                self._note_skipped()
                if self._recording and self._step_ran:  # the last step, left without step()
                    self._record_params()
                    if self._writer is not None:
                        self._finish_step()
        finally:
            self._close()

    def _close(self) -> None:
        """Everything off: hooks, the open step file (removed unless finished), the index."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._finish_eval()
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        if self._watch is not None:
            self._watch.reset()
        self._snapshot = {}
        if self._index is not None:
            self._index.close()
            self._index = None

    # -- steps ------------------------------------------------------------------------------
    def step(self) -> list[RuleHit]:
        """End the current step: write what it recorded, if anything; return its rule hits."""
        self._check_pending()
        self._finish_eval()
        self._note_skipped()
        hits: list[RuleHit] = []
        if self._recording and self._step_ran:
            self._record_params()
            if self._writer is not None:
                hits = self._finish_step()
        if self._writer is not None:
            self._writer.abort()  # a step in which the model never ran writes nothing
        if self._watch is not None:
            self._watch.reset()
        if self._sentinel is not None:
            self._sentinel.reset()
        self.step_index += 1
        self._begin_step()
        return hits

    @property
    def recording(self) -> bool:
        """Whether the current step is recorded."""
        return self._recording

    def _reset_step_state(self) -> None:
        self._recording = False
        self._step_ran = False  # the same on every rank, unlike what each rank writes
        self._writer: DumpWriter | None = None
        self._recorder: Recorder | None = None
        self._grad_keys: dict[str, None] = {}  # in the order they fired (looked up per gradient)
        self._grad_hooked: list[str] = []
        self._grad_aliases: dict[str, str] = {}
        self._param_keys: list[str] = []
        self._params_done = False
        self._placements: dict[str, Any] = {}
        self._snapshot: dict[str, torch.Tensor] = {}
        self._updates: dict[str, float] = {}
        self._trained = False  # a training forward ran in this step
        self._root_ran = False  # the model's own forward ran for training in this step
        self._optimizer_stepped = False
        self._step_skipped = False
        # A non-finite backward found, tripped when an optimizer step is about to apply its
        # gradients (`_gradients_final`): the trip, and what "dump" writes of it (or None).
        self._pending: tuple[Trip, Callable[[DumpWriter, Recorder], None] | None] | None = None
        self._grad_scale: float | None = None
        # RNG states at each hooked call of this step, for the flight record ("dump" only).
        self._rng: dict[tuple[str, int], dict[str, Any]] = {}

    @_writes
    def _begin_step(self) -> None:
        self._reset_step_state()
        self._recording = self.step_index % self.every == 0
        sentinel = self._sentinel
        self._lazy = bool(sentinel and sentinel.sources is not None and not self._recording)
        if not self._recording or (self.gather and self.rank.rank != 0):
            return  # gathering ranks other than 0 take part in the collectives only
        full = not self.stats_only or bool(
            self.full_every and self.step_index % self.full_every == 0
        )
        keys = len(self._modules) * (1 + self.grads) + len(self._named_params) * self.params
        writer = DumpWriter(
            self.out_dir / step_file_name(self.step_index, self.rank.rank),
            stats_only=not full,
            dead_threshold=self.dead_threshold,
            reserve=8192 + (_RESERVE_PER_KEY + 384 * self.hist) * keys,  # 43 counts a key
            hist=self.hist,
        )
        writer.__enter__()
        self._writer = writer
        self._recorder = Recorder(_StepSink(self))

    @_writes
    def _finish_step(self) -> list[RuleHit]:
        writer, recorder = self._writer, self._recorder
        assert writer is not None and recorder is not None
        self._writer = None
        writer.settle()  # every statistic in, before the rules read them
        hits = apply_rules(
            self.rules, self._observations(writer), step=self.step_index, rank=self.rank.rank
        )
        hits = self._structural_once(hits, writer)
        meta = self._metadata(writer, recorder, hits)
        path = writer.finish(meta)
        for hit in hits:
            logger.warning("%s", hit)
        self.hits += hits
        assert self._index is not None
        keys = {k: summary(s, gradient=k.startswith(GRAD_PREFIX)) for k, s in writer.stats.items()}
        self._recent.append({"step": self.step_index, "keys": keys})
        try:
            self._index.write(
                "step",
                step=self.step_index,
                rank=self.rank.rank,
                file=path.name,
                full=not writer.stats_only,
                keys=keys,
                aliases=writer.aliases,
                updates=self._updates,
                hits=[h.to_json() for h in hits],
                **({"skipped": True} if self._step_skipped else {}),
            )
        except BaseException:
            path.unlink(missing_ok=True)  # the index lists whole steps only, and only those
            raise
        return hits

    def _structural_once(self, hits: list[RuleHit], writer: DumpWriter) -> list[RuleHit]:
        """A parameter gradient that is zero by construction (the loss does not depend on the
        parameter: attention key biases, whose shift softmax cancels) is reported once, as
        structural, instead of as a vanishing gradient at every recorded step. It is told from a
        gradient that vanished by the gradient reaching its module: that one is not small, so
        the parameter's share of it cancels out. A parameter whose module's output gradient was
        not recorded, or vanished too, is reported as vanishing at every step."""
        rule = next((r for r in self.rules if isinstance(r, VanishingGradient)), None)
        out = []
        for hit in hits:
            if rule is None or hit.rule != rule.name or hit.key[len(GRAD_PREFIX) :] not in (
                self._param_keys
            ):
                out.append(hit)
                continue
            if hit.key in self._structural:
                continue
            module = hit.key[len(GRAD_PREFIX) :].rpartition(".")[0] or ROOT
            reaching = _output_grad_norm(writer, module)
            if reaching is None or reaching < rule.threshold:
                out.append(hit)
                continue
            self._structural.add(hit.key)
            out.append(
                dataclasses.replace(
                    hit,
                    rule="structural_zero_gradient",
                    message=(
                        f"{hit.message} while the gradient reaching '{module}' has norm "
                        f"{reaching:.3g}: the loss does not depend on this parameter "
                        "(reported once)"
                    ),
                )
            )
        return out

    def _note_skipped(self) -> None:
        """A step that trained and whose gradients no optimizer step took: one a GradScaler
        skipped (inf/NaN in the scaled gradients), known from `scaler`, or else one whose
        gradients were non-finite: a GradScaler not handed to `record` skips those too, and in
        a loop that steps no optimizer over the model's parameters they reached no weight."""
        pending, self._pending = self._pending, None
        if not self._trained or self._optimizer_stepped or self.step_index in self.skipped:
            return
        if self.scaler is not None and _scaler_enabled(self.scaler):
            logger.info("step %d: the GradScaler skipped the optimizer step", self.step_index)
        elif pending is not None:
            logger.warning(
                "step %d: non-finite gradients that no optimizer step took (a GradScaler skips "
                "such a step; hand it to record() as scaler= to have gradients recorded "
                "unscaled): the step is reported as skipped, not as a trip. %s",
                self.step_index,
                pending[0].message(),
            )
        else:
            return
        self._step_skipped = True
        self.skipped.append(self.step_index)
        if self._index is not None:
            self._index.write("skipped", step=self.step_index, rank=self.rank.rank)

    # -- the run folder ---------------------------------------------------------------------
    def _claim_folder(self) -> bool:
        """Refuse a folder that holds another run unless resuming or overwriting it; True when
        this recording continues one.

        A step number is the training's own: a run resumed at a step the folder already went
        past (a checkpoint before its last step) is refused, or with resume="truncate" the
        folder's steps from there on are moved aside, never renumbered."""
        from modeltap.record.index import read_rank

        # Each rank looks at its own files only: under torchrun the others are writing theirs.
        mine = run_files(self.out_dir, self.rank.rank)
        if not mine and not (self.resume and self.gather and self.rank.rank != 0):
            if self.resume:
                raise InputError(
                    f"resume={self.resume!r} but '{self.out_dir}' holds no run to resume; "
                    "drop resume"
                )
            return False
        if self.overwrite:
            for path in mine:
                path.unlink(missing_ok=True)
            return False
        if not self.resume:
            raise InputError(
                f"'{self.out_dir}' already holds a recorded run; pass resume=True to continue it "
                "after its last recorded step, overwrite=True to replace it, or another folder"
            )
        owner = 0 if self.gather else self.rank.rank  # rank 0 keeps a gathered run's index
        index = read_rank(self.out_dir, owner)
        if index is None:
            raise InputError(f"'{self.out_dir}' holds no index for rank {owner} to resume")
        start = index.start
        if start.get("model_class", type(self.model).__name__) != type(self.model).__name__ or (
            start.get("modules", len(self._modules)) != len(self._modules)
        ):
            raise InputError(
                f"'{self.out_dir}' records a {start.get('model_class')} with "
                f"{start.get('modules')} modules, not this {type(self.model).__name__} with "
                f"{len(self._modules)}; give another folder"
            )
        changed = [k for k, v in self._settings().items() if k in start and start[k] != v]
        if changed:
            k = changed[0]
            raise InputError(
                f"resume=True with {k}={self._settings()[k]!r} but the run used {start[k]!r}; "
                "resume with the same options, or record into another folder"
            )
        last = index.last_step()
        if last is not None and not self._start_given:
            self.step_index = max(self.step_index, last + 1)  # after the run's last step
        elif last is not None and self.step_index <= last:
            if self.resume != "truncate":
                raise InputError(
                    f"'{self.out_dir}' holds steps up to {last} and this run resumes at step "
                    f"{self.step_index} (a checkpoint before the folder's last step); pass "
                    f"resume='truncate' to move steps {self.step_index}-{last} aside into a "
                    "subfolder, or record into another folder"
                )
            if owner == self.rank.rank:  # a gathering rank other than 0 has nothing to move
                self._truncate(self.step_index)
        # a later evaluation after the same step takes the next free name, as within one run
        self._eval_files = {p.name for p in run_files(self.out_dir, self.rank.rank)}
        return True

    def _write_failed(self, exc: OSError) -> Exception:
        """A write of the run failed: the step's file goes (its temporary file with it; the
        index lists only whole files), and a full or read-only disk is one line naming the fix."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        if self._eval_writer is not None:
            self._eval_writer.abort()
            self._eval_writer = self._eval_recorder = None
        return write_error(exc, self.out_dir, step=self.step_index)

    def _truncate(self, first: int) -> None:
        """Move this rank's files of steps >= `first` into a new subfolder and say so in the
        index (a `truncate` event: readers drop those steps' events from then on)."""
        from modeltap.record.index import file_step

        aside = self.out_dir / f"truncated-step{first:06d}"
        k = 1
        while aside.exists():
            k += 1
            aside = self.out_dir / f"truncated-step{first:06d}-{k}"
        later = [
            p
            for p in run_files(self.out_dir, self.rank.rank)
            if (step := file_step(p.name)) is not None and step >= first
        ]
        try:
            index = IndexWriter(self.out_dir, self.rank.rank)
            try:
                index.write(
                    "truncate",
                    rank=self.rank.rank,
                    from_step=first,
                    folder=aside.name,
                    files=[p.name for p in later],
                )
            finally:
                index.close()
            if later:
                aside.mkdir()
            for path in later:
                os.replace(path, aside / path.name)
        except OSError as exc:
            raise write_error(exc, self.out_dir) from None
        logger.info(
            "%s: steps from %d on moved aside into %s (resume='truncate')",
            self.out_dir,
            first,
            aside.name,
        )

    # -- hooks ------------------------------------------------------------------------------
    def _forward_hook(self, name: str) -> Callable[..., None]:
        import torch

        grad_enabled = torch.is_grad_enabled
        model = self.model

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not (model.training and grad_enabled()):  # an evaluation forward
                if self.eval:
                    self._record_eval(name, output)
                return
            self._trained = True
            if self._eval_writer is not None:
                self._finish_eval()
            if self._recording:
                self._step_ran = True
                self._ran.add(name)
                if self._recorder is not None:
                    self._recorder.record(name, output)
            if self._lazy:
                if name in self._sentinel.sources:  # type: ignore[union-attr]
                    self._sentinel.source_output(name, output)  # type: ignore[union-attr]
            elif self._watch is not None:
                self._watch.forward(name, module, args, kwargs, output)

        return hook

    # -- evaluation forwards ----------------------------------------------------------------
    @_writes
    def _record_eval(self, name: str, output: Any) -> None:
        if self.gather and self.rank.rank != 0:
            return
        if name == ROOT:
            self._eval_forwards += 1  # the root returns last: this forward is complete
            if self.eval_batches is not None and self._eval_forwards > self.eval_batches:
                return
        elif self.eval_batches is not None and self._eval_forwards >= self.eval_batches:
            return
        if self._eval_writer is None:
            self._eval_at = self._eval_step()
            self._eval_writer = DumpWriter(
                self.out_dir / self._eval_name(),
                stats_only=self.stats_only,
                dead_threshold=self.dead_threshold,
                reserve=8192
                + (_RESERVE_PER_KEY + 384 * self.hist)
                * len(self._modules)
                * (self.eval_batches or 4),
                hist=self.hist,
            )
            self._eval_writer.__enter__()
            self._eval_recorder = Recorder(self._eval_writer)
        assert self._eval_recorder is not None
        self._eval_recorder.record(name, output)

    def _eval_step(self) -> int:
        """The step an evaluation belongs to: the current one once it has trained, else the one
        before (an evaluation after `step()`, as frameworks run it, follows the step it ends)."""
        return self.step_index if self._trained else max(self.step_index - 1, 0)

    def _eval_name(self) -> str:
        base = eval_file_name(self._eval_at, self.rank.rank)
        name, k = base, 1
        while name in self._eval_files:  # a second evaluation after the same step
            name = base.replace(".rank", f"-{k}.rank")
            k += 1
        self._eval_files.add(name)
        return name

    @_writes
    def _finish_eval(self) -> None:
        writer, recorder = self._eval_writer, self._eval_recorder
        self._eval_writer = self._eval_recorder = None
        self._eval_forwards = 0
        if writer is None or recorder is None:
            return
        try:
            meta = {
                "kind": "activations",
                **self._common_meta(),
                "step": str(self._eval_at),
                "phase": "eval",
                "train_mode": "false",
                "order": json.dumps(recorder.order),
                "skipped": json.dumps(recorder.skipped),
                "skipped_none": str(recorder.skipped_none),
                "record": json.dumps(self._settings()),
            }
            path = writer.finish(meta)
        except BaseException:
            writer.abort()
            raise
        if self._index is not None:
            self._index.write(
                "eval",
                step=self._eval_at,
                rank=self.rank.rank,
                file=path.name,
                keys={k: summary(s) for k, s in writer.stats.items()},
                aliases=writer.aliases,
            )

    def _rng_hook(self, name: str) -> Callable[..., None]:
        """A forward pre-hook keeping the RNG states a training call starts from."""
        import torch

        from modeltap.record.flight import rng_states

        grad_enabled = torch.is_grad_enabled
        model = self.model

        def hook(module: nn.Module, args: Any) -> None:
            watch = self._watch
            if self._lazy:
                return  # a lazily checked step keeps its RNG states once, for a re-run
            if watch is not None and model.training and grad_enabled():
                self._rng[(name, watch.counts.get(name, 0))] = rng_states(module)

        return hook

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if module.training and _grad_enabled():
            self._root_ran = True
            if self._lazy:
                from modeltap.record.flight import rng_states

                self._sentinel.begin(args, kwargs, rng_states(module))  # type: ignore[union-attr]
        watch = self._watch
        if watch is not None and watch.calls and watch.forward_checked and not watch.grad_flags:
            # A forward whose tensors were kept for a backward that never came (no_grad, eval).
            watch.let_go()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._lazy:
            self._check_forward()
        elif module.training and _grad_enabled():
            if self._sentinel.root_output(output):  # type: ignore[union-attr]
                self._rerun(FORWARD, "the model's output")

    def _after_lazy_backward(self) -> None:
        """The end of a backward on a step the sentinel checks (record.sentinel)."""
        sentinel = self._sentinel
        assert sentinel is not None
        source = sentinel.bad_source()
        if source is None or self._pending is not None:  # (the step's first one is named)
            sentinel.backward_done()
        elif self.scaler is not None and _scaler_enabled(self.scaler):
            sentinel.backward_done()  # what a GradScaler looks for: see _check_backward
        elif any(t.step == self.step_index and t.phase == FORWARD for t in self.trips[-1:]):
            sentinel.backward_done()  # (warn) the NaN of a forward that tripped, named already
        else:
            self._rerun(BACKWARD, f"the gradient of '{source}'s output")

    def _rerun(self, phase: str, seen: str) -> None:
        """The step's forwards (and for a backward trip, its backward) again, from the same
        inputs and RNG states, under the full tripwire, which trips as a recorded step would;
        when it doesn't, the trip says the step could not be made again."""
        import torch

        from modeltap.record.flight import rng_states, set_rng_states

        sentinel, watch = self._sentinel, self._watch
        assert sentinel is not None and watch is not None
        forwards, sentinel.forwards = sentinel.forwards, []
        starts = sentinel.backward_starts_of(forwards) if phase == BACKWARD else None
        trips = len(self.trips)
        saved = rng_states(self.model)
        self._lazy = False
        watch.reset()
        try:
            with torch.enable_grad():
                outputs = []
                for forward in forwards:
                    set_rng_states(forward.rng)
                    with contextlib.ExitStack() as regions:
                        for device, dtype in forward.autocast:
                            regions.enter_context(torch.autocast(device, dtype=dtype))
                        outputs.append(self.model(*forward.args, **forward.kwargs))
                if starts is not None:
                    tensors = [grad_leaves(outputs[f])[i] for f, i, _ in starts]
                    params = [p for _, p in self._named_params if p.requires_grad]
                    # the watch checks this backward as it ends, as it would the step's
                    torch.autograd.grad(
                        tensors, params, [g for _, _, g in starts], allow_unused=True
                    )
        finally:
            set_rng_states(saved)
            watch.reset()
            sentinel.reset()
            if phase == FORWARD:  # their backward is still to come (warn goes on)
                sentinel.forwards = forwards
            self._lazy = True
        if len(self.trips) == trips and (phase == FORWARD or self._pending is None):
            trip = self._unreproduced(phase, seen, backward_kept=starts is not None)
            if phase == FORWARD:
                self._trip(trip)
            else:
                self._pending = (trip, None)  # tripped if an optimizer step takes them

    def _after_backward(self) -> None:
        self._check_backward()

    def _check_pending(self) -> None:
        if self._watch is None:
            return
        if not self._watch.forward_checked:
            self._check_forward()
        if self._watch.grad_flags:
            self._check_backward()

    def _check_forward(self) -> None:
        watch = self._watch
        if watch is None or watch.forward_checked:
            return
        found = watch.find_forward()
        if found is None:
            if self._sentinel is not None and self._sentinel.sources is None and watch.calls:
                if self._root_ran:  # what the sentinel watches on the steps not recorded
                    self._sentinel.sources = {s.name for s in watch.shapes if not s.in_slots}
                else:  # the loop calls submodules (Lightning's training_step calling
                    # self.net): no forward of the model to run again, so the full check stays
                    self._sentinel = None
            self._rng = {}
            if not self.on_nonfinite.startswith("dump"):
                watch.let_go()
            return
        self._trip(self._forward_trip(*found))

    def _check_backward(self) -> None:
        watch = self._watch
        if watch is None:
            return
        if not watch.forward_checked:  # a loop that never calls the model's own forward
            self._check_forward()  # (its root hook checks it): its forward came first
        try:
            found = watch.find_backward()
            scaled = self.scaler is not None and _scaler_enabled(self.scaler)
            if found is not None and not scaled and self._pending is None:
                # Tripped when an optimizer step is about to apply them (`_gradients_final`);
                # a step that none takes is reported as skipped (`_note_skipped`). Inf/NaN
                # gradients are what a GradScaler looks for: with one known, it skips the step.
                self._pending = (self._backward_trip(*found), self._held_backward())
        finally:
            if self.on_nonfinite.startswith("dump"):
                watch.let_go()
            watch.reset_backward()

    def _is_ours(self, optimizer: Any) -> bool:
        known = self._optimizers.get(id(optimizer))
        if known is None:
            known = any(
                id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]
            )
            self._optimizers[id(optimizer)] = known
        return known

    def _before_optimizer(
        self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """An optimizer over the model's parameters is about to step. Without a closure its
        gradients are the ones it applies; with one (`optimizer.step(closure)`, as Lightning
        steps), they exist only once the closure has run its backward: the closure is handed
        on wrapped, and they are read when it returns."""
        if not self._is_ours(optimizer):
            return None
        if self._recording and self.params and not self._snapshot:
            # the weights before the step (a closure may not be called first: SAM moves them)
            self._snapshot = {
                n: dist.local_view(p).detach().clone()
                for n, p in self._named_params
                if p.requires_grad
            }
        if self._recording or self._watch is not None:
            wrapped = _wrap_closure(args, kwargs, self._reading_after)
            if wrapped is not None:
                return wrapped
        self._gradients_final()
        return None

    def _reading_after(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        def evaluated(*args: Any, **kwargs: Any) -> Any:
            loss = closure(*args, **kwargs)
            self._gradients_final()
            return loss

        return evaluated

    def _gradients_final(self) -> None:
        """The gradients an optimizer step is about to apply are all there: non-finite ones
        trip now (before they reach the weights), and a recorded step reads the parameter
        gradients. An optimizer that evaluates its closure several times (LBFGS) gets here after
        each evaluation: every one is checked, the first one's gradients (at the weights the
        step starts from, where its first direction comes from) are the step's."""
        self._check_pending()
        pending, self._pending = self._pending, None
        if pending is not None:
            trip, fill = pending
            if fill is not None:
                trip.file = self._trip_dump(trip, fill)
            self._trip(trip)
        self._record_params()

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._is_ours(optimizer):
            return
        self._optimizer_stepped = True
        # An optimizer that never called the closure it was given: the gradients it stepped
        # with were there all along (read now, late rather than never).
        self._gradients_final()
        if not self._snapshot:
            return
        self._updates = self._update_ratios()
        self._snapshot = {}

    # -- parameters -------------------------------------------------------------------------
    @_writes
    def _record_params(self) -> None:
        """Parameter gradients, once per recorded step, before the optimizer or zero_grad."""
        if not self._recording or not self.params or self._params_done:
            return
        self._params_done = True
        writer = self._writer
        for name, p in self._named_params:
            g = p.grad
            if g is None:
                continue
            key = GRAD_PREFIX + name
            if dist.is_sharded(g):
                if self.gather:
                    g = dist.full_view(g)  # every rank takes part; rank 0 writes
                else:
                    self._placements[key] = dist.placement(g)
                    g = dist.local_view(g)
            if writer is not None:
                writer.tensor(key, g.detach(), count_zeros=True)
                self._param_keys.append(name)

    def _scale(self) -> float | None:
        """The GradScaler's scale of this step's backward (read once per step), or None."""
        if self.scaler is None or not _scaler_enabled(self.scaler):
            return None
        if self._grad_scale is None:
            self._grad_scale = float(self.scaler.get_scale())
        return self._grad_scale

    def _update_ratios(self) -> dict[str, float]:
        """||w_after - w_before|| / ||w_before|| per parameter (0-norm parameters left out)."""
        import torch

        names, squares = [], []
        for name, p in self._named_params:
            before = self._snapshot.get(name)
            if before is None or p.grad is None:  # a parameter the step did not train
                continue
            after = dist.local_view(p).detach()
            names.append(name)
            squares.append(
                torch.stack(
                    [torch.linalg.vector_norm(after - before), torch.linalg.vector_norm(before)]
                ).square()
            )
        if not squares:
            return {}
        sums = torch.stack(squares)
        if self.gather and any(dist.is_sharded(p) for _, p in self._named_params):
            import torch.distributed as tdist

            tdist.all_reduce(sums)  # the shards' squares add up to the whole parameter's
        out = {}
        for name, (delta, weight) in zip(names, sums.tolist(), strict=True):
            if weight > 0 and math.isfinite(delta):
                out[name] = math.sqrt(delta / weight)
        return out

    # -- rules and metadata -----------------------------------------------------------------
    def _observations(self, writer: DumpWriter) -> list[Observation]:
        params = set(self._param_keys)
        out = []
        for key, stats in writer.stats.items():
            if key.startswith(GRAD_PREFIX):
                inner = key[len(GRAD_PREFIX) :]
                kind = PARAM_GRAD if inner in params else GRADIENT
                out.append(Observation(key, kind, stats))
            else:
                module = self._by_name.get(split_key(key)[0])
                cls = type(module).__name__ if module is not None else None
                out.append(Observation(key, ACTIVATION, stats, module_class=cls))
        dims = {n: p.dim() for n, p in self._named_params}
        out += [Observation(n, UPDATE, value=r, dims=dims[n]) for n, r in self._updates.items()]
        return out

    def _settings(self) -> dict[str, Any]:
        return {
            "every": self.every,
            "full_every": self.full_every,
            "grads": self.grads,
            "params": self.params,
            "gather": self.gather,
            "on_nonfinite": self.on_nonfinite,
            "flight": self.flight,
        }

    def _common_meta(self) -> dict[str, str]:
        import torch

        from modeltap._version import __version__

        meta = {"modeltap_version": __version__, "torch": torch.__version__}
        if "transformers" in sys.modules:
            meta["transformers"] = str(sys.modules["transformers"].__version__)
        first = next(iter(self.model.parameters()), None)
        if first is not None:
            meta.update(dtype=str(first.dtype).removeprefix("torch."), device=str(first.device))
        return {
            **meta,
            "model": type(self.model).__name__,
            "model_class": type(self.model).__name__,
            "train_mode": str(self.model.training).lower(),
            "selection": json.dumps({**self.selection.as_dict(), "inputs": False}),
            "step": str(self.step_index),
            "rank": str(self.rank.rank),
            "world_size": str(self.rank.world_size),
            "dist_backend": self.rank.backend,
        }

    def _metadata(
        self, writer: DumpWriter, recorder: Recorder, hits: list[RuleHit]
    ) -> dict[str, str]:
        fired = set(self._grad_keys)
        grads = [k for k in self._grad_hooked if k in fired]
        aliased = [k for k, t in self._grad_aliases.items() if t in fired]
        order = list(recorder.order)
        order += [GRAD_PREFIX + k for k in self._grad_keys]
        order += [GRAD_PREFIX + k for k in aliased]
        order += [GRAD_PREFIX + k for k in self._param_keys]
        for key in aliased:
            writer.alias(GRAD_PREFIX + key, GRAD_PREFIX + self._grad_aliases[key])
        with_grads = bool(self._grad_keys or self._param_keys)
        record = {**self._settings(), "not_run": [m for m in self._modules if m not in self._ran]}
        meta = {
            "kind": "activations+gradients" if with_grads else "activations",
            **self._common_meta(),
            "order": json.dumps(order),
            "skipped": json.dumps(recorder.skipped),
            "skipped_none": str(recorder.skipped_none),
            "record": json.dumps(record),
        }
        if with_grads:
            meta["grad"] = json.dumps(self._grad_meta([*grads, *aliased]))
        if self._placements:
            meta["placements"] = json.dumps(self._placements)
        if self._updates:
            meta["updates"] = json.dumps(self._updates)
        if hits:
            meta["rules"] = json.dumps([h.to_json() for h in hits])
        if self._step_skipped:
            meta["skipped_step"] = (
                "GradScaler found inf/NaN gradients and skipped the optimizer"
                if self.scaler is not None and _scaler_enabled(self.scaler)
                else "inf/NaN gradients that no optimizer step took (a GradScaler skipped it)"
            )
        return meta

    def _grad_meta(self, keys: list[str]) -> dict[str, Any]:
        vanishing = next((r for r in self.rules if isinstance(r, VanishingGradient)), None)
        exploding = next((r for r in self.rules if isinstance(r, ExplodingGradient)), None)
        fired = set(self._grad_keys)
        return {
            "target": "loss (the training step's backward)",
            "loss": "user",
            "grad_output": "scalar",
            "keys": [*keys, *self._param_keys],
            "params": list(self._param_keys),
            "no_path": {k: "no path" for k in self._grad_hooked if k not in fired},
            "vanishing": vanishing.threshold if vanishing else VanishingGradient().threshold,
            "exploding": exploding.threshold if exploding else ExplodingGradient().threshold,
        }

    # -- the tripwire -----------------------------------------------------------------------
    def _forward_trip(self, call: Call, path: str, propagated: bool) -> Trip:
        from modeltap.stats import tensor_stats

        tensor = dict(call.outputs)[path]
        inputs = {
            call.key(p): tensor_stats(t, dead_threshold=self.dead_threshold).to_json()
            for p, t in call.inputs()
        }
        trip = Trip(
            step=self.step_index,
            rank=self.rank.rank,
            phase=FORWARD,
            module=call.name,
            module_class=type(call.module).__name__,
            key=call.key(path),
            stats=tensor_stats(tensor).to_json(),
            inputs=inputs,
            params=_nonfinite_params(call.module),
            propagated=propagated,
        )
        def fill(writer: DumpWriter, recorder: Recorder) -> None:
            from modeltap.record import flight

            if self.on_nonfinite.startswith("dump"):
                self._dump_forward(recorder, call)
            else:  # the flight recorder alone: the culprit's output, for replay to compare with
                recorder.record(call.name, call.output)
            rng = self._rng.get((call.name, call.call))
            self._flight = flight.write(writer, call, rng, trip.key)

        trip.file = self._trip_dump(trip, fill)
        return trip

    def _backward_trip(self, shape: Shape, slot: int, propagated: bool) -> Trip:
        from modeltap.stats import tensor_stats

        watch = self._watch
        assert watch is not None
        grad = watch.grads.get(slot)
        stats = (
            tensor_stats(grad).to_json()
            if grad is not None
            else {"sum": float(watch.grad_flags[slot][1])}
        )
        inputs = {}
        for s, total in watch.incoming(shape).items():
            held = watch.grads.get(s)
            key = GRAD_PREFIX + watch.slot_keys[s]
            inputs[key] = tensor_stats(held).to_json() if held is not None else {"sum": total}
        trip = Trip(
            step=self.step_index,
            rank=self.rank.rank,
            phase=BACKWARD,
            module=shape.name,
            module_class=shape.module_class,
            key=GRAD_PREFIX + watch.slot_keys[slot],
            stats=stats,
            inputs=inputs,
            params=_nonfinite_params(self._by_name[shape.name]),
            propagated=propagated,
        )
        return trip

    def _unreproduced(self, phase: str, seen: str, *, backward_kept: bool) -> Trip:
        if phase == BACKWARD and not backward_kept:
            why = (
                "its backward can't be run again: the gradients of the model's outputs were "
                "too large to keep (a loss computed outside the model)"
            )
        else:
            why = (
                "the step run again from the same inputs and RNG states under the full tripwire "
                "was finite (non-deterministic kernels, or inputs changed in place since)"
            )
        return Trip(
            step=self.step_index,
            rank=self.rank.rank,
            phase=phase,
            module=ROOT,
            module_class=type(self.model).__name__,
            key="",
            stats={},
            inputs={},
            unreproduced=(
                f"{seen} was non-finite, but {why}; record with eager_tripwire=True to check "
                "every module as it runs"
            ),
        )

    def _trip(self, trip: Trip) -> None:
        self.trips.append(trip)
        if self._index is not None:
            self._index.write("tripwire", **trip.to_json())
        if self.on_nonfinite in ("raise", "dump"):
            raise NonFiniteError(trip)
        logger.warning("%s", trip.message())

    @_writes
    def _trip_dump(self, trip: Trip, fill: Callable[[DumpWriter, Recorder], None]) -> str | None:
        """With "dump": the step's full tensors, once per run and phase, as that step's file.
        With only the flight recorder armed (`flight=True`), a forward trip's file holds the
        culprit's output and its flight record: nothing had to be held for it."""
        full = self.on_nonfinite.startswith("dump")
        if not (full or (self.flight and trip.phase == FORWARD)) or trip.phase in self._dumped:
            return None
        self._dumped.add(trip.phase)
        if self._writer is not None:  # the step's own recording gives way to the full dump
            self._writer.abort()
            self._writer = None
            self._recorder = None
        path = self.out_dir / step_file_name(self.step_index, self.rank.rank)
        self._flight: dict[str, Any] | None = None
        with DumpWriter(path, dead_threshold=self.dead_threshold, hist=self.hist) as writer:
            recorder = Recorder(writer)
            fill(writer, recorder)
            order = [*recorder.order, *(k for k in writer.stats if k.startswith(GRAD_PREFIX))]
            kind = "activations+gradients" if trip.phase == BACKWARD else "activations"
            writer.finish(
                {
                    "kind": kind,
                    **self._common_meta(),
                    "order": json.dumps(order),
                    "skipped": json.dumps(recorder.skipped),
                    "skipped_none": str(recorder.skipped_none),
                    "record": json.dumps(self._settings()),
                    "tripwire": json.dumps(trip.to_json()),
                    **({"trend": json.dumps(list(self._recent))} if self._recent else {}),
                    **({"flight": json.dumps(self._flight)} if self._flight else {}),
                }
            )
        return path.name

    def _dump_forward(self, recorder: Recorder, culprit: Call | None) -> None:
        watch = self._watch
        assert watch is not None
        for c in watch.calls:
            recorder.record(c.name, c.output)
        for c in watch.calls:
            if culprit is not None and c.name == culprit.name:
                recorder.record(c.name, {**dict(enumerate(c.args)), **c.kwargs}, is_input=True)

    def _held_backward(self) -> Callable[[DumpWriter, Recorder], None] | None:
        """With "dump": what a backward trip's file holds (the forward's outputs, every
        gradient), taken now, while the watch has them; written if the trip comes."""
        watch = self._watch
        if watch is None or not self.on_nonfinite.startswith("dump"):
            return None
        calls = list(watch.calls)
        grads = [
            (GRAD_PREFIX + watch.slot_keys[slot], watch.grads[slot])
            for slot in sorted(watch.grads, key=lambda s: watch.grad_flags[s][0])
        ]

        def fill(writer: DumpWriter, recorder: Recorder) -> None:
            for c in calls:
                recorder.record(c.name, c.output)
            for key, grad in grads:
                writer.tensor(key, grad, count_zeros=True)

        return fill


class _StepSink:
    """The recorded step's sink: statistics to the writer, and a tensor hook for each gradient."""

    def __init__(self, owner: Recording) -> None:
        self.owner = owner

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        owner = self.owner
        if owner._writer is None:
            return
        try:
            owner._writer.tensor(key, tensor.detach())
        except OSError as exc:
            raise owner._write_failed(exc) from None
        if owner.grads and tensor.requires_grad:
            owner._grad_hooked.append(key)
            tensor.register_hook(self._grad_hook(key))

    def alias(self, key: str, target: str) -> None:
        owner = self.owner
        if owner._writer is None:
            return
        owner._writer.alias(key, target)
        if owner.grads:
            owner._grad_aliases[key] = target

    def _grad_hook(self, key: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            owner = self.owner
            with owner._lock:
                if owner._writer is not None and key not in owner._grad_keys:
                    grad = grad.detach()
                    scale = owner._scale()
                    if scale is not None:
                        grad = grad / scale  # what the optimizer sees once the scaler unscales
                    try:
                        owner._writer.tensor(GRAD_PREFIX + key, grad, count_zeros=True)
                    except OSError as exc:
                        raise owner._write_failed(exc) from None
                    owner._grad_keys[key] = None

        return hook


def _output_grad_norm(writer: DumpWriter, module: str) -> float | None:
    """The norm of the gradient w.r.t. `module`'s output (its first tensor) in this step."""
    prefix = GRAD_PREFIX + module
    for key, stats in writer.stats.items():
        if key == prefix or key.startswith(prefix + ":"):
            return stats.norm
    return None


def _wrap_closure(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`optimizer.step`'s arguments as a step hook gets them (the optimizer first) with its
    closure wrapped; None when it has none."""
    if callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": wrap(kwargs["closure"])}
    if len(args) > 1 and callable(args[1]):
        return (args[0], wrap(args[1]), *args[2:]), kwargs
    return None


def _scaler_enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _nonfinite_params(module: nn.Module) -> dict[str, dict[str, Any]]:
    import torch

    from modeltap.stats import tensor_stats

    out = {}
    for name, p in module.named_parameters():
        local = dist.local_view(p.detach())
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            out[name] = tensor_stats(local).to_json()
    return out


def record(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    every: int = 100,
    grads: bool = True,
    params: bool = True,
    stats_only: bool = True,
    full_every: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    depth: int | None = None,
    on_nonfinite: str = "raise",
    rules: Sequence[RuleFn] | None = None,
    gather: bool = False,
    dead_threshold: float = 0.0,
    start_step: int | None = None,
    hist: bool = False,
    eval: bool = False,
    eval_batches: int | None = 1,
    scaler: Any = None,
    resume: bool | str = False,
    overwrite: bool = False,
    keep_last: int = 8,
    flight: bool = False,
    eager_tripwire: bool = False,
) -> Recording:
    """Record `model` inside a training loop: `with record(model, "runs/x") as rec: ... rec.step()`.

    Steps are numbered from `start_step` (default 0), the training's own step numbers (a
    framework's global_step); step N is recorded when N % every == 0, with full
    tensors when N % full_every == 0 (or always with stats_only=False). `grads`: gradients w.r.t.
    the selected modules' outputs; `params`: parameter gradients (and update ratios).
    `on_nonfinite`: "raise" (NonFiniteError), "dump" (write the step's full tensors, then raise),
    "warn" (log and go on), "dump-warn", or "off". `rules`: callables over statistics
    (default: `rules.default_rules()`); hits go to the index, the step file and the
    `modeltap.record` logger, and `step()` returns them. Under torchrun each rank writes its own
    files; `gather=True` writes sharded (DTensor) tensors whole, on rank 0 only.
    `hist`: each step file's statistics get a fixed-bin histogram per tensor (`stats.HIST_EDGES`).

    A step holds the training forward and backward only; forwards under no_grad/inference_mode
    or with the model in eval mode are evaluations: `eval=True` writes the first `eval_batches`
    of each (None: all) to `eval{N:06d}.rank{R}.safetensors`, N the last step that trained.
    `scaler`: the run's `torch.amp.GradScaler`; gradients are then recorded unscaled, and a step
    it skips for inf/NaN gradients is reported as skipped (index, `show`), not as a trip.
    Parameter gradients are those an optimizer step over the model's parameters applies: read
    before it steps, or when its closure returns (LBFGS: the first evaluation's).
    A folder that already holds a run is refused unless `resume=True` (continue it, same options:
    at `start_step`, or without one after its last step) or `overwrite=True` (its files are
    removed first). A `start_step` at or before the folder's last step (a checkpoint before it)
    is refused too, unless `resume="truncate"`: that run's files of steps >= start_step are moved
    into the subfolder `truncated-step{start_step:06d}` and the index says so.
    With `flight=True` (implied by `on_nonfinite="dump"`), a forward trip writes a flight record
    (see `modeltap.record.flight`) that `modeltap replay` re-runs, with the statistics of the last
    `keep_last` recorded steps as `trend` metadata; alone it holds nothing more than the tripwire,
    while "dump" keeps every tensor of the step for its full dump.

    Non-finite gradients trip when such an optimizer step is about to apply them (so never
    reach the weights); a step whose gradients no optimizer step takes (a GradScaler skipped
    it, known or not; a loop that steps no optimizer) is reported as skipped, with a warning
    naming where they came from unless `scaler` says why.
    The tripwire checks every module's output and gradient on recorded steps. On the others it
    checks the model's outputs and the gradients of the source modules (those with no input
    needing a gradient), and runs the step again under the full check only when one is
    non-finite (`modeltap.record.sentinel`): a NaN that the code after it masks out, or a weight
    gradient that alone overflows, goes unseen there. `eager_tripwire=True` checks everything
    on every step (as do runs of several ranks); "dump" and the flight recorder write what the
    step's re-run, from its own RNG states, holds.
    """
    return Recording(
        model,
        out_dir,
        every=every,
        grads=grads,
        params=params,
        stats_only=stats_only,
        full_every=full_every,
        include=include,
        exclude=exclude,
        depth=depth,
        on_nonfinite=on_nonfinite,
        rules=rules,
        gather=gather,
        dead_threshold=dead_threshold,
        start_step=start_step,
        hist=hist,
        eval=eval,
        eval_batches=eval_batches,
        scaler=scaler,
        resume=resume,
        overwrite=overwrite,
        keep_last=keep_last,
        flight=flight,
        eager_tripwire=eager_tripwire,
    )
