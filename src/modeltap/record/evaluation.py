"""Evaluation forwards, a part of `Recording` (record.recording): a forward under no_grad or in
eval mode is left out of the step, or with `eval=True` its first `eval_batches` are written to
`eval{N:06d}.rank{R}.safetensors`, N the last step that trained."""

from __future__ import annotations

import json
from typing import Any

from modeltap.capture import Recorder
from modeltap.dump import DumpWriter
from modeltap.record.index import eval_file_name, summary
from modeltap.record.run_folder import writes
from modeltap.record.steps import RESERVE_PER_KEY
from modeltap.selection import ROOT


class Evaluations:
    """Each evaluation's file (`Recording`'s state)."""

    @writes
    def _record_eval(self, name: str, output: Any) -> None:
        if self.options.gather and self.rank.rank != 0:
            return
        if name == ROOT:
            self._eval_forwards += 1  # the root returns last: this forward is complete
            if (
                self.options.eval_batches is not None
                and self._eval_forwards > self.options.eval_batches
            ):
                return
        elif (
            self.options.eval_batches is not None
            and self._eval_forwards >= self.options.eval_batches
        ):
            return
        if self._eval_writer is None:
            self._eval_at = self._eval_step()
            self._eval_writer = DumpWriter(
                self.out_dir / self._eval_name(),
                stats_only=self.options.stats_only,
                dead_threshold=self.options.dead_threshold,
                reserve=8192
                + (RESERVE_PER_KEY + 384 * self.options.hist)
                * len(self._modules)
                * (self.options.eval_batches or 4),
                hist=self.options.hist,
                formats=tuple(self.options.formats),
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

    @writes
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
                "record": json.dumps(self.options.settings()),
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
