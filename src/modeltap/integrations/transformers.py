"""`ModeltapCallback` for transformers' `Trainer`: `modeltap.record` with the Trainer's steps.

Step N of the recording is the Trainer's `global_step` N: the forwards and backwards that end
with optimizer step N (all `gradient_accumulation_steps` micro-batches, as `name@k` keys). The
parameter gradients are read just before the optimizer steps, after the Trainer's gradient
clipping and the GradScaler's unscaling: what the optimizer sees. Evaluation forwards (the Trainer's
`evaluate`, in eval mode under no_grad) are never mixed into a step; `eval=True` writes them to
`eval{N:06d}` files, N the global_step they followed.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from modeltap.record import Recording, record


class ModeltapCallback(TrainerCallback):
    """`Trainer(..., callbacks=[ModeltapCallback("runs/exp1", every=50)])`; other keyword
    options are `modeltap.record`'s (grads, params, full_every, include, depth, eval...)."""

    def __init__(self, out_dir: str | os.PathLike[str], *, every: int = 100, **options: Any):
        for name in ("start_step", "scaler"):
            if name in options:
                raise ValueError(f"ModeltapCallback sets {name} from the Trainer; leave it out")
        self.out_dir = out_dir
        self.every = every
        self.options = options
        self.recording: Recording | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None:
            raise ValueError("ModeltapCallback got no model from the Trainer; pass it to Trainer")
        options = dict(self.options)
        # A resumed Trainer starts at its checkpoint's step: continue the run there.
        if state.global_step > 0:
            options.setdefault("resume", True)
        self.recording = record(
            model,
            self.out_dir,
            every=self.every,
            start_step=state.global_step + 1,
            # accelerate's optimizer wrapper holds the GradScaler of fp16 training.
            scaler=getattr(optimizer, "scaler", None),
            **options,
        )
        self.recording.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recording is not None:
            self.recording.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        recording, self.recording = self.recording, None
        if recording is not None:
            recording.__exit__(None, None, None)
