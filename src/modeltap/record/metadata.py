"""What a step's file says beyond its tensors, a part of `Recording` (record.recording): the rules'
observations of a step, and its metadata (versions, selection, gradients, update ratios, hits)."""

from __future__ import annotations

import json
import sys
from typing import Any

from modeltap.capture import Recorder, split_key
from modeltap.dump import GRAD_PREFIX, DumpWriter
from modeltap.record.optimizer_hooks import scaler_enabled
from modeltap.record.rules import (
    ACTIVATION,
    GRADIENT,
    PARAM_GRAD,
    UPDATE,
    ExplodingGradient,
    Observation,
    RuleHit,
    VanishingGradient,
)


class StepMetadata:
    """A step's observations and metadata (`Recording`'s state)."""

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
        record = {
            **self.options.settings(),
            "not_run": [m for m in self._modules if m not in self._ran],
        }
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
                if self.options.scaler is not None and scaler_enabled(self.options.scaler)
                else "inf/NaN gradients that no optimizer step took (a GradScaler skipped it)"
            )
        return meta

    def _grad_meta(self, keys: list[str]) -> dict[str, Any]:
        vanishing = next((r for r in self.options.rules if isinstance(r, VanishingGradient)), None)
        exploding = next((r for r in self.options.rules if isinstance(r, ExplodingGradient)), None)
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
