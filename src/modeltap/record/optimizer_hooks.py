"""The optimizer's step hooks, a part of `Recording` (record.recording): the parameter gradients
an optimizer step over the model's parameters applies are read (and non-finite ones trip) before
it steps or when its closure returns; the weights before and after give the update ratios."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from modeltap.dump import GRAD_PREFIX
from modeltap.record import dist
from modeltap.record.run_folder import writes


class OptimizerHooks:
    """Reading parameter gradients at the optimizer step (`Recording`'s state)."""

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
        if self._recording and self.options.params and not self._snapshot:
            # the weights before the step (a closure may not be called first: SAM moves them)
            self._snapshot = {
                n: dist.local_view(p).detach().clone()
                for n, p in self._named_params
                if p.requires_grad
            }
        if self._recording or self._watch is not None:
            wrapped = wrap_closure(args, kwargs, self._reading_after)
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
    @writes
    def _record_params(self) -> None:
        """Parameter gradients, once per recorded step, before the optimizer or zero_grad."""
        if not self._recording or not self.options.params or self._params_done:
            return
        self._params_done = True
        writer = self._writer
        for name, p in self._named_params:
            g = p.grad
            if g is None:
                continue
            key = GRAD_PREFIX + name
            if dist.is_sharded(g):
                if self.options.gather:
                    g = dist.full_view(g)  # every rank takes part; rank 0 writes
                else:
                    self._placements[key] = dist.placement(g)
                    g = dist.local_view(g)
            if writer is not None:
                writer.tensor(key, g.detach(), count_zeros=True)
                self._param_keys.append(name)

    def _scale(self) -> float | None:
        """The GradScaler's scale of this step's backward (read once per step), or None."""
        if self.options.scaler is None or not scaler_enabled(self.options.scaler):
            return None
        if self._grad_scale is None:
            self._grad_scale = float(self.options.scaler.get_scale())
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
        if self.options.gather and any(dist.is_sharded(p) for _, p in self._named_params):
            import torch.distributed as tdist

            tdist.all_reduce(sums)  # the shards' squares add up to the whole parameter's
        out = {}
        for name, (delta, weight) in zip(names, sums.tolist(), strict=True):
            if weight > 0 and math.isfinite(delta):
                out[name] = math.sqrt(delta / weight)
        return out


def wrap_closure(
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


def scaler_enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
