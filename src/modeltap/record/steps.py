"""A recorded step's file, a part of `Recording` (record.recording): which steps are recorded, the
writer each one opens, the sink its module outputs and their gradients stream into, and what
finishing one writes (the rules' hits, the index entry); a step no optimizer step took is
reported as skipped."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modeltap.capture import Recorder
from modeltap.dump import GRAD_PREFIX, DumpWriter
from modeltap.record.index import step_file_name, summary
from modeltap.record.optimizer_hooks import scaler_enabled
from modeltap.record.rules import RuleHit, VanishingGradient, apply_rules
from modeltap.record.run_folder import writes
from modeltap.record.tripwire import Trip
from modeltap.selection import ROOT

if TYPE_CHECKING:
    import torch

    from modeltap.record.recording import Recording

logger = logging.getLogger("modeltap.record")

# Header bytes reserved per recorded key (statistics and entry).
RESERVE_PER_KEY = 768


class StepFiles:
    """Beginning and finishing each step's file (`Recording`'s state)."""

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

    @writes
    def _begin_step(self) -> None:
        self._stop_ops()  # type: ignore[attr-defined]
        self._reset_step_state()
        self._recording = self.step_index % self.options.every == 0
        sentinel = self._sentinel
        self._lazy = bool(sentinel and sentinel.sources is not None and not self._recording)
        if not self._recording or (self.options.gather and self.rank.rank != 0):
            return  # gathering ranks other than 0 take part in the collectives only
        full = not self.options.stats_only or bool(
            self.options.full_every and self.step_index % self.options.full_every == 0
        )
        keys = (
            len(self._modules) * (1 + self.options.grads) * (1 + 8 * self.options.ops)
            + len(self._named_params) * self.options.params
        )
        writer = DumpWriter(
            self.out_dir / step_file_name(self.step_index, self.rank.rank),
            stats_only=not full,
            dead_threshold=self.options.dead_threshold,
            # 43 counts a key with hist, four figures a format with formats
            reserve=8192
            + (RESERVE_PER_KEY + 384 * self.options.hist + 128 * len(self.options.formats)) * keys,
            hist=self.options.hist,
            formats=tuple(self.options.formats),
        )
        writer.__enter__()
        self._writer = writer
        self._recorder = Recorder(_StepSink(self))
        if self.options.ops:
            self._start_ops()  # type: ignore[attr-defined]

    @writes
    def _finish_step(self) -> list[RuleHit]:
        writer, recorder = self._writer, self._recorder
        assert writer is not None and recorder is not None
        self._writer = None
        writer.settle()  # every statistic in, before the rules read them
        hits = apply_rules(
            self.options.rules,
            self._observations(writer),
            step=self.step_index,
            rank=self.rank.rank,
        )
        hits = self._structural_once(hits, writer)
        meta = {**self._metadata(writer, recorder, hits), **self._ops_meta()}  # type: ignore[attr-defined]
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
        rule = next((r for r in self.options.rules if isinstance(r, VanishingGradient)), None)
        out = []
        for hit in hits:
            if (
                rule is None
                or hit.rule != rule.name
                or hit.key[len(GRAD_PREFIX) :] not in (self._param_keys)
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
        if self.options.scaler is not None and scaler_enabled(self.options.scaler):
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
        if owner.options.grads and tensor.requires_grad:
            owner._grad_hooked.append(key)
            tensor.register_hook(self._grad_hook(key))

    def alias(self, key: str, target: str) -> None:
        owner = self.owner
        if owner._writer is None:
            return
        owner._writer.alias(key, target)
        if owner.options.grads:
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
