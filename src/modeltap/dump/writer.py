"""Writing a dump: a safetensors file streamed as the model runs, atomically.

Layout: the usual safetensors header (8-byte little-endian length, JSON), then the tensor bytes.
The writer reserves header space up front (a hole in the file: nothing is written there until the
end), and appends each distinct tensor as its module returns, so memory does not grow with the
number of captured layers. At the end the header goes into the reservation, padded with spaces as
the format allows. If it does not fit, or would leave more padding than its own size (a generation
that stopped early, or whose estimate counted modules that run only in the prefill), the data is
moved once behind a header of its own size (see `_wasted`).
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.dump.pipeline import (
    Pipeline,
    byte_view,
    dense,
    formats_here,
    hold_threads,
    pwrite_all,
    spare_cores,
    write_at,
)
from modeltap.dump.timeline import Timeline
from modeltap.errors import InputError
from modeltap.stats import (
    TensorStats,
    batch_stats,
    begin_stats,
    dtype_name,
    final_stats,
)

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch

from modeltap.dump.format import (
    _DTYPES,
    FORMAT,
    FORMAT_VERSION,
    _align,
)

# Bytes a DumpWriter may hold copied but not yet written (its writer thread's buffer).
DEFAULT_MAX_INFLIGHT = 32 << 20
# CPU tensors smaller than this are done in the caller: handing them to the thread costs more
# (a copy, and the thread's Python competing for the GIL) than it saves.
_THREAD_MIN_BYTES = 1 << 20
# Workers computing the statistics of `final` tensors (numpy's passes run on one core each).
_FINAL_WORKERS = 2
# Small tensors' bytes are gathered up to this much before one write.
_STAGE_BYTES = 1 << 20
# Padding a header may keep beyond its own size before the data is moved behind a fitting one.
_PADDING_SLACK = 256 << 10
# ... unless the data to move is more than this many times the padding it would give back.
_MOVE_PER_PADDING = 8


def write_target(path: Path) -> Path:
    """Where writing `path` really lands: through a symbolic link to its target, as `cp` does.

    The link stays a link and now points at the new file; a dangling link creates its target.
    """
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_writable(path: Path, option: str = "-o/--out") -> None:
    """Fail before any work (before a model loads) when `path` could not be written.

    Missing folders are fine: they are made now, a file is created in the last one and removed,
    and the folders made are removed again (the writer makes them when it writes). Permission
    bits alone do not tell (root may write anywhere by them, `/proc` refuses new folders).
    `option` is the flag to name in the message.
    """
    path = write_target(path)
    if path.is_dir():
        raise InputError(f"output '{path}' is a directory; give a file name with {option}")
    parent = path.parent if str(path.parent) else Path(".")
    missing: list[Path] = []
    existing = parent
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"output folder '{parent}' can't be made: '{existing}' is a file")
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        probe = parent / f".modeltap-probe.{os.getpid()}.tmp"
        probe.open("xb").close()
        probe.unlink()
    except OSError as exc:
        state = "is not writable" if parent.exists() else "can't be made"
        why = exc.strerror or type(exc).__name__
        raise InputError(f"output folder '{parent}' {state} ({why}); change {option}") from None
    finally:
        for folder in reversed(made):
            folder.rmdir()


def temp_path(path: Path) -> Path:
    """The hidden file beside `path` that a write goes to before it is moved into place."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


_TEMP_NAME = re.compile(r"^\.(?P<name>.+\.safetensors)\.(?P<pid>\d+)\.tmp(\.2)?$")


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete dump temp files in `folder` whose writing process is gone (killed with SIGKILL, a
    power cut): ours by name (`.NAME.safetensors.PID.tmp`), never a live process's."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        if _alive(int(match["pid"])):
            continue
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


class DumpWriter:
    """A capture sink that computes statistics and streams tensors into a safetensors file.

    Use as a context manager: the file appears at `path` only when the block ends without error;
    on any error or Ctrl-C the temporary file beside it is removed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        stats_only: bool = False,
        dead_threshold: float = 0.0,
        row_mask: torch.Tensor | None = None,
        reserve: int = 1 << 16,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        hist: bool = False,
        formats: tuple[str, ...] = (),
    ) -> None:
        self.path = write_target(Path(path))
        check_writable(self.path)
        self.stats_only = stats_only
        self.hist = hist  # a histogram per tensor in its statistics (stats.HIST_EDGES)
        self.formats = tuple(formats)  # what-if figures per float tensor (stats/formats.py)
        self.dead_threshold = dead_threshold
        self.row_mask = row_mask
        # A mask that keeps every row changes nothing: checked once here, not once per tensor;
        # kept on the CPU, where looking at it costs a CUDA tensor no sync.
        self._stats_mask = None if row_mask is None or bool(row_mask.all()) else row_mask.cpu()
        self.stats: dict[str, TensorStats] = {}
        self.aliases: dict[str, str] = {}
        self._entries: dict[str, dict[str, Any]] = {}
        self._reserve = _align(reserve)
        self._offset = 0
        self._tmp = temp_path(self.path)
        self._file: Any = None
        if max_inflight < 0:
            raise InputError(f"max_inflight is {max_inflight}; give 0 (no writer thread) or more")
        self.max_inflight = max_inflight
        self._pipeline: Pipeline | None = None
        self._lock = threading.Lock()
        self.peak_inflight = 0  # most bytes the writer thread held at once
        self._stats_order: list[str] = []  # the header lists statistics in call order
        self._flushed = False
        self._staged = bytearray()  # small tensors' bytes, written together
        self._staged_at = 0
        # (key, copy, count_zeros, position or None, timeline record)
        self._deferred: list[tuple[str, torch.Tensor, bool, int | None, Any]] = []
        self._deferred_bytes = 0
        # statistics of `final` tensors, computed by a few workers straight from the tensors
        self._final_pool: ThreadPoolExecutor | None = None
        self._spare = 0  # cores beside the model's, set with the pool (pipeline.spare_cores)
        self._final: dict[str, Future[TensorStats]] = {}
        # MODELTAP_TIMELINE: per-tensor timings, a debug log (dump/timeline.py); None when off
        self._timeline = Timeline.from_env(self.path)
        self._staged_records: list[dict[str, Any]] = []

    def graph_stats_options(self) -> dict[str, Any] | None:
        """What a compiled graph needs to compute this dump's statistics itself
        (`stats.graph_stats`, then `computed`), or None when they need the tensors (data to
        write, histograms, or what-if figures)."""
        if not self.stats_only or self.hist or self.formats:
            return None
        return {"row_mask": self._stats_mask, "dead_threshold": self.dead_threshold}

    def computed(self, key: str, stats: TensorStats, device: Any = None) -> None:
        """Statistics of a tensor computed elsewhere (a stats-only dump: in the compiled graph,
        during the forward; its timeline line has no spans)."""
        if self._timeline is not None:
            import torch

            self._timeline.tensor(key, stats.numel * getattr(torch, stats.dtype).itemsize)
        with self._lock:
            self._stats_order.append(key)
            self.stats[key] = stats

    def _options(self, count_zeros: bool) -> dict[str, Any]:
        return {
            "dead_threshold": self.dead_threshold,
            "row_mask": self._stats_mask,
            "count_zeros": count_zeros,
            "hist": self.hist,
            "formats": self.formats,
        }

    def __enter__(self) -> DumpWriter:
        if self._timeline is not None:
            self._timeline.event("enter")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.path.parent)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in finish() or abort()
        try:
            # a hole, not written zeros: an unused reservation then costs no writes
            self._file.truncate(8 + self._reserve)
        except BaseException:
            self.abort()  # (a full disk): no temporary file left behind
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()

    def tensor(
        self, key: str, tensor: torch.Tensor, *, count_zeros: bool = False, final: bool = False
    ) -> None:
        """Take `tensor`'s statistics and bytes as they are now (the model may change it in place
        as soon as this returns).

        A small CPU tensor is copied and done later with others, in one batch (`batch_stats`,
        one write), when they add up to a megabyte, at `next_pass` or at `settle`. A large one
        (or any CUDA tensor) is copied into a reused buffer of at most `max_inflight` bytes
        (pinned for CUDA) and left to the writer thread; when the buffer is full this waits
        (back-pressure). One bigger than the whole buffer is done here and now.

        `final`: nothing changes the tensor any more (it comes from a finished forward, as the
        compile backend's do): a stats-only dump then reads it where it is, with no copy, in one
        pass (`stats.final_stats`, equal to the other path's numbers within rounding), on a few
        worker threads.
        """
        x = tensor.detach() if tensor.requires_grad else tensor
        nbytes = x.numel() * x.element_size()  # not x.nbytes: sparse tensors have none
        timeline = self._timeline
        record = None if timeline is None else timeline.tensor(key, nbytes)
        dtype = dtype_name(x.dtype)
        code = _DTYPES.get(dtype)
        if self.stats_only:
            code = None
        elif code is None:
            raise InputError(f"can't store '{key}' of dtype {dtype}; use --stats-only")
        if final and self.stats_only and x.is_cpu:
            self._take_final(key, x, count_zeros, record)
            return
        with self._lock:
            position, size = self._place(key, x, code, nbytes)
            threaded = not x.is_cpu or nbytes >= _THREAD_MIN_BYTES
            if threaded and self.max_inflight and self._file is not None:
                if self._pipeline is None:
                    self._pipeline = Pipeline(self, self.max_inflight)
                options = self._options(count_zeros)
                taken = self._pipeline.take(
                    key, x, options, position=position, write=code is not None, record=record
                )
                if taken:
                    return
            if not threaded and dense(x):
                self._defer(key, x, count_zeros, position if size else None, record)
                return
            self._take_now(key, x, count_zeros, position if size else None, threaded, record)

    def _take_final(self, key: str, x: torch.Tensor, count_zeros: bool, record: Any) -> None:
        """A finished forward's CPU tensor in a stats-only dump: its statistics on a worker,
        read where it is (`tensor`'s `final`)."""
        with self._lock:
            self._stats_order.append(key)
            if self._final_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                # CPU statistics are numpy on one core: the same bits in any thread; the torch
                # ops of --formats get the cores the model leaves, or the model's (below)
                self._spare = spare_cores()
                self._final_pool = ThreadPoolExecutor(
                    _FINAL_WORKERS, "modeltap-stats", hold_threads, (self._spare,)
                )
            options = self._options(count_zeros)
            figures, options = formats_here(x, options, self._spare)  # or on a worker
            self._final[key] = self._final_pool.submit(
                _final, self._timeline, record, x, options, figures
            )

    def _place(self, key: str, x: torch.Tensor, code: str | None, nbytes: int) -> tuple[int, int]:
        """The file position of `key`'s bytes and their size (0 when none are stored); its
        header entry and its place in the statistics' order. Under the lock."""
        size = 0 if code is None else nbytes
        position = 8 + self._reserve + self._offset
        if code is not None:
            self._entries[key] = {
                "dtype": code,
                "shape": list(x.shape),
                "data_offsets": [self._offset, self._offset + size],
            }
            self._offset += size
        self._stats_order.append(key)
        if not self._flushed and self._file is not None:
            self._file.flush()  # from here on, data goes in with pwrite at its offset
            self._flushed = True
        return position, size

    def _defer(
        self, key: str, x: torch.Tensor, count_zeros: bool, position: int | None, record: Any
    ) -> None:
        """A small dense CPU tensor, kept as it is now and done with others later, in one tight
        loop: between the model's kernels the per-tensor overhead is several times what it is in
        a row."""
        timeline = self._timeline
        if timeline is None or record is None:
            copy = x.clone()
        else:
            start = timeline.now()
            copy = x.clone()
            timeline.span(record, "copy", start, "main")
        self._deferred.append((key, copy, count_zeros, position, record))
        self._deferred_bytes += x.numel() * x.element_size()
        if self._deferred_bytes >= _STAGE_BYTES:
            self._run_deferred()

    def _take_now(
        self,
        key: str,
        x: torch.Tensor,
        count_zeros: bool,
        position: int | None,
        threaded: bool,
        record: Any,
    ) -> None:
        """Statistics here and now; the bytes staged with small ones, or written at once (a
        tensor the writer thread did not take)."""
        timeline = self._timeline
        start = 0.0 if timeline is None else timeline.now()
        self.stats[key] = begin_stats(x, **self._options(count_zeros)).result()
        if timeline is not None and record is not None:
            timeline.span(record, "stats", start, "main")
        if position is not None and not threaded:
            self._stage(x, position, record)
        elif position is not None:
            start = 0.0 if timeline is None else timeline.now()
            write_at(self._file.fileno(), x, position)
            if timeline is not None and record is not None:
                timeline.span(record, "write", start, "main")

    def _run_deferred(self) -> None:
        deferred = self._deferred
        if not deferred:
            return
        timeline = self._timeline
        start = 0.0 if timeline is None else timeline.now()
        computed = batch_stats(
            [entry[1] for entry in deferred],
            dead_threshold=self.dead_threshold,
            row_mask=self._stats_mask,
            count_zeros=[entry[2] for entry in deferred],
            hist=self.hist,
            formats=self.formats,
        )
        if timeline is not None:  # one span for the whole batch
            span = [start, timeline.now(), "deferred"]
            for entry in deferred:
                entry[4]["stats"] = span
        for (key, x, _, position, record), stats in zip(deferred, computed, strict=True):
            self.stats[key] = stats
            if position is not None:
                self._stage(x, position, record)
        self._deferred, self._deferred_bytes = [], 0

    def _stage(self, x: torch.Tensor, position: int, record: dict[str, Any] | None = None) -> None:
        """Collect small tensors' bytes and write them in one go: a syscall per tensor costs more
        than the copy."""
        if self._staged and (
            position != self._staged_at + len(self._staged) or len(self._staged) >= _STAGE_BYTES
        ):
            self._write_staged()
        if not self._staged:
            self._staged_at = position
        self._staged += byte_view(x)
        if record is not None:
            self._staged_records.append(record)

    def _write_staged(self) -> None:
        if self._staged:
            timeline = self._timeline
            start = 0.0 if timeline is None else timeline.now()
            pwrite_all(self._file.fileno(), memoryview(self._staged), self._staged_at)
            self._staged = bytearray()
            if timeline is not None:  # one span for the bytes written together
                span = [start, timeline.now(), "deferred"]
                for record in self._staged_records:
                    record["write"] = span
                self._staged_records = []

    def alias(self, key: str, target: str) -> None:
        self.aliases[key] = target

    def next_pass(self) -> None:
        """Another forward follows (a decoding step): the small tensors given so far are done
        now, in one batch, and the writer thread, if it has nothing left to do, goes.

        A thread that ever ran a torch parallel op keeps an OpenMP team beside the model's: more
        OpenMP threads than cores, and the model's own threads stop spinning between the small
        matmuls of each step (GPT-2, 64 new tokens: 1.75x of a bare generate when that thread was
        kept, 1.29x without). The statistics are numpy now, but a float8 tensor still widens
        through torch; an idle thread goes, and a busy one is left to finish during the next
        pass.
        """
        try:
            with self._lock:
                self._run_deferred()
            if self._pipeline is not None and self._pipeline.idle():
                self._pipeline.close()
                self._pipeline = None
        except BaseException:
            self.abort()
            raise

    def settle(self) -> None:
        """Wait until every tensor given so far is done: its statistics in `stats`, its bytes
        written (the thread and deferred small tensors finish their work)."""
        if self._timeline is not None:
            self._timeline.event("settle")
        try:
            if self._pipeline is not None:
                self._pipeline.close()
                self._pipeline = None
            with self._lock:
                self._run_deferred()
            if self._file is not None:
                self._write_staged()
            if self._final_pool is not None:
                for key, future in self._final.items():
                    self.stats[key] = future.result()
                self._final.clear()
                self._final_pool.shutdown()
                self._final_pool = None
        except BaseException:
            self.abort()
            raise
        if self._timeline is not None:
            self._timeline.event("settled")

    def finish(self, metadata: dict[str, str]) -> Path:
        """Write the header, move the file into place, and return its path."""
        self.settle()
        meta = dict(metadata)
        meta.update(
            format=FORMAT,
            format_version=str(FORMAT_VERSION),
            aliases=json.dumps(self.aliases),
            stats=json.dumps(
                {k: self.stats[k].to_json() for k in dict.fromkeys(self._stats_order)}
            ),
            stats_only=str(self.stats_only).lower(),
            dead_threshold=repr(float(self.dead_threshold)),
        )
        if self.formats:
            meta["formats"] = json.dumps(list(self.formats))
        header = json.dumps({"__metadata__": meta, **self._entries}, separators=(",", ":")).encode()
        try:
            if len(header) <= self._reserve and not self._wasted(len(header)):
                self._file.seek(0)
                self._file.write(struct.pack("<Q", self._reserve) + header.ljust(self._reserve))
                self._file.close()
            else:
                self._relocate(header)
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        if self._timeline is not None:
            self._timeline.write("done")
        return self.path

    def _wasted(self, header: int) -> bool:
        """Whether a `header`-byte header would leave the reservation mostly padding: more than
        its own size (and than `_PADDING_SLACK`), and moving the data instead costs at most
        `_MOVE_PER_PADDING` bytes copied per byte of padding given back."""
        padding = self._reserve - header
        return padding > max(header, _PADDING_SLACK) and (
            self._offset <= _MOVE_PER_PADDING * padding
        )

    def _relocate(self, header: bytes) -> None:
        """The header outgrew its reservation, or fills too little of it: copy the data behind
        one of its own size (kernel-side)."""
        self._file.close()
        padded = header.ljust(_align(len(header)))
        moved = self._tmp.with_name(self._tmp.name + ".2")
        try:
            with open(self._tmp, "rb") as src, open(moved, "wb") as dst:
                dst.write(struct.pack("<Q", len(padded)) + padded)
                dst.flush()  # the copy below writes at the descriptor's offset, past the header
                src.seek(8 + self._reserve)
                remaining = self._offset
                while remaining:
                    n = os.copy_file_range(src.fileno(), dst.fileno(), remaining)
                    if n == 0:
                        break
                    remaining -= n
            os.replace(moved, self._tmp)
        finally:
            moved.unlink(missing_ok=True)

    def abort(self) -> None:
        if self._final_pool is not None:
            self._final_pool.shutdown(wait=False, cancel_futures=True)
            self._final_pool = None
        if self._file is not None and not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)
        if self._timeline is not None:
            self._timeline.write("aborted")


def _final(
    timeline: Timeline | None,
    record: dict[str, Any] | None,
    x: torch.Tensor,
    options: dict[str, Any],
    figures: dict[str, Any] | None,
) -> TensorStats:
    """`final_stats` on a worker (timed on the timeline when there is one), with the --formats
    figures the caller took where it did."""
    start = 0.0 if timeline is None else timeline.now()
    stats = final_stats(x, **options)
    if timeline is not None and record is not None:
        timeline.span(record, "stats", start, "final")
    return stats if figures is None else replace(stats, formats=figures)
