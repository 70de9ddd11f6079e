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

The recorder is one object, `Recording`, whose parts live one module per concern: `options`
(RecordOptions, the keywords of `record`), `steps` (each recorded step's file and sink), `metadata`
(what a step file says), `run_folder` (claiming, truncating, failed writes), `evaluation`,
`optimizer_hooks` (parameter gradients at the optimizer step, update ratios), `nonfinite` (the
tripwire's checks and trips), `trip_files` (what a trip writes) and `step_ops` (`ops=True`: the
ops of the selected modules' own code on recorded steps).
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError
from modeltap.record import dist
from modeltap.record.evaluation import Evaluations
from modeltap.record.index import IndexWriter, write_error
from modeltap.record.metadata import StepMetadata
from modeltap.record.nonfinite import NonFiniteChecks
from modeltap.record.optimizer_hooks import OptimizerHooks
from modeltap.record.options import RecordOptions, with_options
from modeltap.record.rules import RuleHit
from modeltap.record.run_folder import RunFolder
from modeltap.record.sentinel import Sentinel
from modeltap.record.step_ops import StepOps, check_ops_model
from modeltap.record.steps import StepFiles
from modeltap.record.trip_files import TripFiles
from modeltap.record.tripwire import Trip, Watch
from modeltap.selection import ROOT, select_modules

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from modeltap.capture import Recorder
    from modeltap.dump import DumpWriter


class Recording(
    StepFiles,
    StepMetadata,
    RunFolder,
    Evaluations,
    OptimizerHooks,
    NonFiniteChecks,
    TripFiles,
    StepOps,
):
    """What `record(...)` returns; use it as a context manager and call `step()` once per step.

    It holds the run's state; each base class holds the methods of one concern over that state
    (this module's docstring lists them). `options` is the `RecordOptions` it was made with."""

    def __init__(
        self, model: nn.Module, out_dir: str | os.PathLike[str], options: RecordOptions
    ) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise InputError(f"'{self.out_dir}' is a file; give record() a folder for the run")
        self.model = dist.unwrap(model)
        self.options = options
        if options.ops:
            check_ops_model(self.model)
        self.selection = options.selection()
        self.hits: list[RuleHit] = []
        self.trips: list[Trip] = []
        # A given start_step is the training's own step number (`RecordOptions.start_step`).
        self._start_given = options.start_step is not None
        self.step_index = options.start_step or 0
        self.skipped: list[int] = []  # steps a GradScaler skipped (inf/NaN gradients)
        # The last recorded steps' summaries, carried by a trip's file as the trend before it.
        self._recent: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=options.keep_last
        )
        self.rank = dist.RankInfo()
        self._modules: list[str] = select_modules(self.model, self.selection)
        self._by_name = {(n or ROOT): m for n, m in self.model.named_modules()}
        self._handles: list[Any] = []
        self._op_handles: list[Any] = []
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
            if self.options.on_nonfinite != "off":
                self._watch = Watch(
                    hold_grads=self.options.on_nonfinite.startswith("dump"),
                    on_backward_end=self._after_backward,
                )
                # a re-run on one rank would wait in collectives the others never join
                if not self.options.eager_tripwire and self.rank.world_size == 1:
                    self._sentinel = Sentinel(on_backward_end=self._after_lazy_backward)
            root = self.model
            self._handles.append(
                root.register_forward_pre_hook(self._before_forward, with_kwargs=True)
            )
            if self.options.ops:
                self._handles += self._root_op_hooks(root)
            for name in self._modules:
                hook = self._forward_hook(name)
                module = self._by_name[name]
                if self.options.flight:
                    self._handles.append(module.register_forward_pre_hook(self._rng_hook(name)))
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
            # Registered last, so that it runs after the root's own capture hook.
            self._handles.append(root.register_forward_hook(self._after_forward))
            self._handles.append(register_optimizer_step_pre_hook(self._before_optimizer))
            self._handles.append(register_optimizer_step_post_hook(self._after_optimizer))
            if not (self.options.gather and self.rank.rank != 0):  # gathering ranks write no index
                self._index = IndexWriter(self.out_dir, self.rank.rank)
                self._index.write(
                    "resume" if resumed else "start",
                    rank=self.rank.rank,
                    world_size=self.rank.world_size,
                    backend=self.rank.backend,
                    **self.options.settings(),
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
        self._stop_ops()
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

    # -- hooks ------------------------------------------------------------------------------
    def _forward_hook(self, name: str) -> Callable[..., None]:
        import torch

        grad_enabled = torch.is_grad_enabled
        model = self.model

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self._op_mode is None:  # ops are traced in a recorded step's forward only
                seen(module, args, kwargs, output)
                return
            tracer = self._op_tracer
            assert tracer is not None
            tracer.paused = True  # the recording's own torch calls are no op of the model's
            try:
                seen(module, args, kwargs, output)
            finally:
                tracer.paused = False

        def seen(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not (model.training and grad_enabled()):  # an evaluation forward
                if self.options.eval:
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


@with_options
def record(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    **options: Any,
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
    `formats`: each float tensor's statistics (activations, gradients, parameters) get what
    quantizing it in those formats would cost (`dump --formats`; stats/formats.py).
    `ops`: on recorded steps, every op the selected modules' own code runs in a training forward
    (`dump --ops`; record.step_ops), with its gradient when `grads`; nothing on other steps.

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

    The keywords are the fields of `RecordOptions` (record.options), which checks them:
    `Recording(model, out_dir, RecordOptions(every=10))` is `record(model, out_dir, every=10)`.
    """
    return Recording(model, out_dir, RecordOptions(**options))
