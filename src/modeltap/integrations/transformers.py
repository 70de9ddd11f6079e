"""`ModeltapCallback` for transformers' `Trainer`: `modeltap.record` with the Trainer's steps.

Step N of the recording is the Trainer's `global_step` N: the forwards and backwards that end
with optimizer step N (all `gradient_accumulation_steps` micro-batches, as `name@k` keys). The
parameter gradients are read just before the optimizer steps, after the Trainer's gradient
clipping and the GradScaler's unscaling: what the optimizer sees. Evaluation forwards (the Trainer's
`evaluate`, in eval mode under no_grad) are never mixed into a step; `eval=True` writes them to
`eval{N:06d}` files, N the global_step they followed.

transformers' callbacks hear of no exception: when `train()` raises, the hooks stay on the model
until `callback.close()` or the next `train()`, which closes the old recording first.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from modeltap.integrations.start import RecordingCallback


class ModeltapCallback(RecordingCallback, TrainerCallback):
    """`Trainer(..., callbacks=[ModeltapCallback("runs/exp1", every=50)])`; other keyword
    options are `modeltap.record`'s (grads, params, full_every, include, depth, eval, formats,
    ops...)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None:
            raise ValueError("ModeltapCallback got no model from the Trainer; pass it to Trainer")
        self.close(finished=False)  # a train() that raised left its recording open
        # accelerate's optimizer wrapper holds the GradScaler of fp16 training.
        self.start(model, global_step=state.global_step, scaler=getattr(optimizer, "scaler", None))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recording is not None:
            self.recording.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self, *, finished: bool = True) -> None:
        """End the recording: hooks off, and the last step written when `finished` (a run that
        raised leaves no half step); nothing if none is open."""
        recording, self.recording = self.recording, None
        if recording is not None:
            failed = None if finished else RuntimeError
            recording.__exit__(failed, None, None)
