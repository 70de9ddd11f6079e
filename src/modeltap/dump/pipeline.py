"""The dump writer's thread: each large (or CUDA) tensor copied into one reused buffer, its
statistics computed and its bytes written there while the model runs on (`Pipeline`), and the
byte-level writes at a file position that the writer uses as well."""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from modeltap.stats import begin_stats, tensor_stats
from modeltap.stats.measure import format_figures

if TYPE_CHECKING:
    import torch

    from modeltap.dump.writer import DumpWriter


def _torch() -> Any:
    import torch

    return torch


def spare_cores() -> int:
    """The cores this process may use beyond the model's torch threads: where the statistics'
    threads run their torch ops (--formats), so they start no team on the model's cores."""
    return max(0, len(os.sched_getaffinity(0)) - _torch().get_num_threads())


def hold_threads(n: int) -> None:
    """This thread's torch ops on `n` cores (torch's OpenMP thread count is per thread)."""
    _torch().set_num_threads(max(1, n))


def formats_here(
    x: torch.Tensor, options: dict[str, Any], spare: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """A CPU tensor's --formats figures taken on the caller's thread where no core is `spare`
    beside the model's (its torch ops are most of the work: with the model's cores rather than a
    second team on them, 2.6x a plain stats-only dump at 2 of 2 cores against 2.9x), and the
    options left for the statistics' thread; (None, options) where that thread takes them."""
    if spare or not options.get("formats") or not x.is_floating_point():
        return None, options
    return format_figures(x, options["formats"]), {**options, "formats": ()}


def _byte_dtype() -> torch.dtype:
    return _torch().uint8


def byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        # numpy's views cost a microsecond where torch's cost several, which small tensors pay.
        try:
            return memoryview(tensor.detach().numpy().reshape(-1).view("uint8"))
        except (TypeError, RuntimeError):  # bfloat16 and others that numpy has no type for
            pass
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(_byte_dtype())
    return memoryview(data.numpy())


def pwrite_all(fd: int, view: memoryview, position: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, position)
        view, position = view[n:], position + n


def write_at(fd: int, tensor: torch.Tensor, position: int) -> None:
    """The tensor's bytes into the file at `position` (pwrite: the thread and the caller write
    different parts of the file at once)."""
    pwrite_all(fd, byte_view(tensor), position)


def dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill their memory exactly once (any order of dims)."""
    if x.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(
        (st, sz) for sz, st in zip(x.shape, x.stride(), strict=True) if sz != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass
class _Item:
    """One tensor on its way to the file: a copy in the pipeline's buffer, or queued kernels."""

    key: str
    position: int  # in the file
    offset: int  # in the buffer
    size: int  # bytes of the copy
    charge: int  # buffer bytes held (padding and a wrapped ring's end included) until written
    copy: torch.Tensor | None  # the tensor as it was, in the buffer
    write: bool
    options: dict[str, Any]
    record: dict[str, Any] | None = None  # its timeline record (MODELTAP_TIMELINE)
    pending: Any = None  # stats.PendingStats of a CUDA tensor
    numbers: torch.Tensor | None = None  # its numbers, copied to pinned memory
    event: Any = None  # CUDA event after both copies
    formats: dict[str, Any] | None = None  # a CPU tensor's --formats figures, taken by the caller
    format_numbers: torch.Tensor | None = None  # a CUDA tensor's --formats sums, copied to pinned


class Pipeline:
    """A writer thread fed through one reused buffer of `capacity` bytes (a ring, FIFO).

    The caller copies each tensor into the ring and goes on; the thread computes its statistics
    from the copy and writes its bytes at their place in the file, in queue order (FIFO, which
    frees the ring from its tail). A full ring makes the caller wait
    (back-pressure), so the bytes in flight never exceed `capacity`. For CUDA tensors the ring is
    pinned, the copies are non-blocking and the statistics run on the device; the thread waits
    on one event per tensor and receives a few numbers with the bytes.
    """

    _ALIGN = 64

    def __init__(self, writer: DumpWriter, capacity: int) -> None:

        self.writer = writer
        self.file = writer._file
        # The thread's own descriptor: should the writer be aborted and its file closed while a
        # write is under way, the number can't be reused by another file meanwhile.
        self.fd = os.dup(self.file.fileno())
        self.capacity = capacity // self._ALIGN * self._ALIGN
        self.buffer: torch.Tensor | None = None
        self.head = self.tail = self.used = 0
        self.peak = 0
        self.queue: collections.deque[_Item] = collections.deque()
        self.busy = False
        self.stop = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        # CPU statistics are numpy on one core (the same bits in any thread, a strided tensor
        # laid out by numpy too); the torch ops it runs get the cores the model leaves (_run).
        self.spare = spare_cores()
        self.thread = threading.Thread(target=self._run, name="modeltap-writer", daemon=True)
        self.thread.start()

    def take(
        self,
        key: str,
        x: torch.Tensor,
        options: dict[str, Any],
        *,
        position: int,
        write: bool,
        record: dict[str, Any] | None = None,
    ) -> bool:
        """Queue `x`; False when it is bigger than the ring (the caller handles it inline)."""
        import torch

        cuda = x.device.type == "cuda"
        size = x.numel() * x.element_size() if (write or not cuda) else 0
        charge = -(-size // self._ALIGN) * self._ALIGN
        if charge > self.capacity or not (cuda or dense(x)):
            return False
        timeline = self.writer._timeline
        start = 0.0 if timeline is None else timeline.now()
        offset, charge = self._reserve(charge, pin=cuda)
        if record is not None:  # waiting for room in the ring: back-pressure
            timeline.span(record, "wait", start, "main")
            start = timeline.now()
        copy = x if not size else None  # an empty tensor has nothing to keep
        if size:
            assert self.buffer is not None
            flat = self.buffer[offset : offset + size].view(x.dtype)
            # The copy keeps the tensor's strides, so that copy_ is a plain memcpy; the
            # statistics read its rows in logical order whatever the layout.
            copy = flat.view(x.shape) if cuda else flat.as_strided(x.shape, x.stride())
            copy.copy_(x, non_blocking=cuda)
        if record is not None:
            timeline.span(record, "copy", start, "main")
        figures = None
        if not cuda:
            figures, options = formats_here(x, options, self.spare)
        item = _Item(key, position, offset, size, charge, copy, write, options, record)
        item.formats = figures
        if cuda:
            item.pending = begin_stats(x, **options)
            if item.pending.numbers is not None:
                item.numbers = torch.empty(
                    item.pending.numbers.shape, dtype=torch.float64, pin_memory=True
                )
                item.numbers.copy_(item.pending.numbers, non_blocking=True)
                item.pending.numbers = None
            pending_formats = item.pending.formats
            if pending_formats is not None and pending_formats.parts is not None:
                # --formats' sums as the numbers: to pinned memory behind the same event
                item.format_numbers = torch.empty(
                    pending_formats.parts.shape, dtype=torch.float64, pin_memory=True
                )
                item.format_numbers.copy_(pending_formats.parts, non_blocking=True)
            item.event = torch.cuda.Event()
            item.event.record(torch.cuda.current_stream(x.device))  # where x's copies queued
        with self.cond:
            self.queue.append(item)
            self.cond.notify_all()
        return True

    def _reserve(self, size: int, *, pin: bool) -> tuple[int, int]:
        """(offset, bytes charged) of `size` free bytes of the ring, waiting for the thread to
        free them; the charge includes the ring's end when the block wraps to the start."""
        import torch

        if self.buffer is None and size:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin)
        with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                if not size:
                    return 0, 0
                if self.used == 0:
                    self.head = self.tail = 0
                if self.head > self.tail or self.used == 0:  # in use: [tail, head)
                    if self.capacity - self.head >= size:
                        offset, charge = self.head, size
                        break
                    if size <= self.tail:  # wrap; the ring's end stays unused meanwhile
                        offset, charge = 0, size + self.capacity - self.head
                        break
                elif self.tail - self.head >= size:  # in use: [tail, end) and [0, head)
                    offset, charge = self.head, size
                    break
                self.cond.wait()
            self.head = offset + size
            self.used += charge
            self.peak = max(self.peak, self.used)
        return offset, charge

    def _release(self, item: _Item) -> None:
        """Called in FIFO order, under the lock."""
        if item.charge:
            self.used -= item.charge
            self.tail = -(-(item.offset + item.size) // self._ALIGN) * self._ALIGN
            if self.used == 0:
                self.head = self.tail = 0

    def idle(self) -> bool:
        """Whether every queued tensor is written (only the caller queues more)."""
        with self.cond:
            return not self.queue and not self.busy

    def drain(self) -> None:
        """Wait until every queued tensor is written; re-raise the thread's error."""
        with self.cond:
            while (self.queue or self.busy) and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        self.drain()
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.thread.join()
        self.writer.peak_inflight = max(self.writer.peak_inflight, self.peak)

    def _run(self) -> None:
        hold_threads(self.spare)  # --formats' torch ops on the cores the model leaves (take)
        try:
            self._loop()
        finally:
            os.close(self.fd)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stop:
                    # A writer aborted mid-run (its file closed) has nobody left to stop us.
                    if not self.cond.wait(timeout=0.25) and self.file.closed:
                        return
                if not self.queue or self.file.closed:
                    return
                item = self.queue.popleft()
                self.busy = True
            try:
                self._process(item)
            except BaseException as exc:  # handed to the caller at its next call
                with self.cond:
                    self.error = exc
                    self.busy = False
                    self.cond.notify_all()
                return
            with self.cond:
                self._release(item)
                self.busy = False
                self.cond.notify_all()

    def _process(self, item: _Item) -> None:
        timeline, record = self.writer._timeline, item.record
        start = 0.0 if timeline is None else timeline.now()
        if item.event is not None:
            item.event.synchronize()
            numbers = None if item.numbers is None else item.numbers.tolist()
            if item.format_numbers is not None:
                item.pending.format_numbers = item.format_numbers.tolist()
            stats = item.pending.result(numbers)
        else:
            assert item.copy is not None
            stats = tensor_stats(item.copy, **item.options)
            if item.formats is not None:
                stats = replace(stats, formats=item.formats)
        self.writer.stats[item.key] = stats
        if record is not None:
            timeline.span(record, "stats", start, "writer")
            start = timeline.now()
        if item.write and item.copy is not None and item.size:
            write_at(self.fd, item.copy, item.position)
            if record is not None:
                timeline.span(record, "write", start, "writer")
