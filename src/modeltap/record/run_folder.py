"""The run's folder, a part of `Recording` (record.recording): claiming it (a new run, a resumed
one, one overwritten), moving later steps aside (resume="truncate"), and a failed write, which ends
the step's file and says how to fix the disk (`writes`)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError
from modeltap.record.index import IndexWriter, run_files, write_error

if TYPE_CHECKING:
    from modeltap.record.recording import Recording

logger = logging.getLogger("modeltap.record")


def writes(method: Callable[..., Any]) -> Callable[..., Any]:
    """A Recording method that writes the run's files: a failed write ends the step's file
    (`RunFolder._write_failed`)."""

    @functools.wraps(method)
    def wrapper(self: Recording, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise self._write_failed(exc) from None

    return wrapper


class RunFolder:
    """Claiming the run's folder and failing a write cleanly (`Recording`'s state)."""

    def _claim_folder(self) -> bool:
        """Refuse a folder that holds another run unless resuming or overwriting it; True when
        this recording continues one.

        A step number is the training's own: a run resumed at a step the folder already went
        past (a checkpoint before its last step) is refused, or with resume="truncate" the
        folder's steps from there on are moved aside, never renumbered."""
        from modeltap.record.index import read_rank

        # Each rank looks at its own files only: under torchrun the others are writing theirs.
        mine = run_files(self.out_dir, self.rank.rank)
        if not mine and not (self.options.resume and self.options.gather and self.rank.rank != 0):
            if self.options.resume:
                raise InputError(
                    f"resume={self.options.resume!r} but '{self.out_dir}' holds no run to resume; "
                    "drop resume"
                )
            return False
        if self.options.overwrite:
            for path in mine:
                path.unlink(missing_ok=True)
            return False
        if not self.options.resume:
            raise InputError(
                f"'{self.out_dir}' already holds a recorded run; pass resume=True to continue it "
                "after its last recorded step, overwrite=True to replace it, or another folder"
            )
        owner = 0 if self.options.gather else self.rank.rank  # rank 0 keeps a gathered run's index
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
        settings = self.options.settings()
        changed = [k for k, v in settings.items() if k in start and start[k] != v]
        if changed:
            k = changed[0]
            raise InputError(
                f"resume={self.options.resume!r} with {k}={settings[k]!r} but the run used "
                f"{start[k]!r}; "
                "resume with the same options, or record into another folder"
            )
        last = index.last_step()
        if last is not None and not self._start_given:
            self.step_index = max(self.step_index, last + 1)  # after the run's last step
        elif last is not None and self.step_index <= last:
            if self.options.resume != "truncate":
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
