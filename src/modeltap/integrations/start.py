"""What every framework's callback shares: its options checked, and its recording started at the
framework's global step (`RecordingCallback`, the base of transformers.py's and lightning.py's
callbacks; the package's `__init__` only names them)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modeltap.record import Recording


def check_options(options: dict[str, Any]) -> None:
    """What a callback sets from its framework may not be given."""
    for name in ("start_step", "scaler"):
        if name in options:
            raise ValueError(f"ModeltapCallback sets {name} from the Trainer; leave it out")


def start_recording(
    model: Any,
    out_dir: str | os.PathLike[str],
    *,
    every: int,
    global_step: int,
    scaler: Any,
    options: dict[str, Any],
) -> Recording:
    """`record(...)` entered for a framework's training: step N is the framework's global_step
    N (the step ending with the N-th optimizer step), always, resumed or not. A run resumed
    from a checkpoint continues the folder's run when the folder holds one (`resume` option:
    True by default then; refused when the folder went past the checkpoint, unless
    resume="truncate"), and starts one in a new or empty folder."""
    from pathlib import Path

    from modeltap.record import dist, record
    from modeltap.record.index import run_files

    options = dict(options)
    if global_step > 0 and not options.get("overwrite"):
        options.setdefault("resume", True)
    if options.get("resume") and not run_files(Path(out_dir), dist.rank_info().rank):
        options["resume"] = False  # nothing of this rank's to continue: a new run, numbered alike
    recording = record(
        model, out_dir, every=every, start_step=global_step + 1, scaler=scaler, **options
    )
    recording.__enter__()
    return recording


class RecordingCallback:
    """A framework callback's options and recording; the framework's own callback class comes
    after it in the bases (`class ModeltapCallback(RecordingCallback, TrainerCallback)`)."""

    def __init__(self, out_dir: str | os.PathLike[str], *, every: int = 100, **options: Any):
        check_options(options)
        self.out_dir = out_dir
        self.every = every
        self.options = options
        self.recording: Recording | None = None

    def start(self, model: Any, *, global_step: int, scaler: Any) -> None:
        """Start recording `model` at the framework's `global_step`."""
        self.recording = start_recording(
            model,
            self.out_dir,
            every=self.every,
            global_step=global_step,
            scaler=scaler,
            options=self.options,
        )
