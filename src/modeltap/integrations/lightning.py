"""`ModeltapCallback` for Lightning: `modeltap.record` with the Lightning Trainer's steps.

`pl.Trainer(callbacks=[ModeltapCallback("runs/exp1", every=50)])`. Step N of the recording is
the Trainer's `global_step` N (optimizer steps, so `accumulate_grad_batches` micro-batches make
one step, as `name@k` keys). The parameter gradients are those the optimizer step applies:
Lightning runs the last micro-batch inside `optimizer.step(closure)`, and they are read when that
closure returns, after `on_before_optimizer_step` and gradient clipping. Validation and test
forwards run in eval mode under no_grad and are never mixed into a step (`eval=True` writes them
to their own files). With 16-bit mixed precision the precision plugin's GradScaler is used:
gradients are recorded unscaled and a step it skips is reported as skipped. Works with
`lightning` or `pytorch_lightning`, whichever is installed.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:
        raise ImportError(
            "modeltap.integrations.lightning needs Lightning: pip install 'modeltap[lightning]'"
        ) from exc

from modeltap.integrations.start import RecordingCallback


class ModeltapCallback(RecordingCallback, Callback):
    """Records the LightningModule's training steps; keyword options are `modeltap.record`'s
    (formats=[...] and ops=True among them)."""

    def __init__(self, out_dir: str | os.PathLike[str], *, every: int = 100, **options: Any):
        super().__init__(out_dir, every=every, **options)
        self._seen_step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        precision = getattr(trainer, "precision_plugin", None)
        self._seen_step = trainer.global_step
        scaler = getattr(precision, "scaler", None)
        self.start(pl_module, global_step=trainer.global_step, scaler=scaler)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps: a micro-batch that only accumulated leaves it.
        if self.recording is not None and trainer.global_step != self._seen_step:
            self._seen_step = trainer.global_step
            self.recording.step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        recording, self.recording = self.recording, None
        if recording is not None:
            recording.__exit__(None, None, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        recording, self.recording = self.recording, None
        if recording is not None:
            recording.__exit__(type(exception), exception, exception.__traceback__)
