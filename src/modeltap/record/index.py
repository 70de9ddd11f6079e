"""The per-rank index of a recorded run: one JSON line per event, so `show DIR` reads a run
without opening a single step file.

`index.rank{R}.jsonl` lines, each an object with an `event`:
  start     rank, world_size, backend, every, full_every, grads, params, gather, on_nonfinite,
            modules, model_class, start_step
  resume    the same, when `record(..., resume=True)` continued the run
  truncate  rank, from_step, folder, files: `resume="truncate"` moved the files of steps >=
            from_step into the subfolder `folder`; the events of those steps before this line
            no longer count
  step      step, file, full, keys {key: {norm, absmax, dead, nonfinite}}, updates, hits,
            skipped (true when a GradScaler skipped the step's optimizer)
  eval      step, file, keys: an evaluation's forwards (`record(..., eval=True)`)
  skipped   step: a GradScaler skipped the optimizer (inf/NaN gradients)
  tripwire  step, phase, module, key, message, file (with "dump")
A line cut short by a crash is skipped on reading. Under `gather=True` only rank 0 writes one.
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeltap.errors import InputError
from modeltap.stats import TensorStats

INDEX_RE = re.compile(r"^index\.rank(\d+)\.jsonl$")


def step_file_name(step: int, rank: int) -> str:
    return f"step{step:06d}.rank{rank}.safetensors"


def index_name(rank: int) -> str:
    return f"index.rank{rank}.jsonl"


def eval_file_name(step: int, rank: int) -> str:
    return f"eval{step:06d}.rank{rank}.safetensors"


_STEP_OF_FILE = re.compile(r"^(step|eval)(?P<step>\d{6})")


def file_step(name: str) -> int | None:
    """The step a step or evaluation file belongs to (`step000004.rank0...`: 4), else None."""
    match = _STEP_OF_FILE.match(name)
    return int(match["step"]) if match else None


def write_error(exc: OSError, folder: Path, *, step: int | None = None) -> Exception:
    """What a run's failed write raises: one line naming the fix for a full or read-only disk
    (an InputError), else the OSError itself."""
    lost = "" if step is None else f" (step {step} was not kept)"
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return InputError(
            f"no space left on the device writing the run in '{folder}'{lost}; free some space "
            "or record into another folder"
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return InputError(
            f"the run folder '{folder}' is not writable ({exc.strerror}){lost}; record into a "
            "folder on a writable disk"
        )
    return exc


# What a run writes into its folder: indexes, step and evaluation files (NAME.rankR.EXT).
_RUN_FILE = re.compile(
    r"^(index|step\d{6}|eval\d{6}(-\d+)?)\.rank(?P<rank>\d+)\.(jsonl|safetensors)$"
)


def run_files(folder: Path, rank: int | None = None) -> list[Path]:
    """The files of a recorded run in `folder` (of one rank, or all), nothing else there."""
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.iterdir()):
        match = _RUN_FILE.match(path.name)
        if match and (rank is None or int(match["rank"]) == rank):
            out.append(path)
    return out


def summary(stats: TensorStats, *, gradient: bool = False) -> dict[str, Any]:
    """What the index keeps of a tensor's statistics: enough for trends and flags."""
    out: dict[str, Any] = {"norm": stats.norm, "absmax": stats.absmax}
    if stats.dead_fraction is not None and not gradient:
        out["dead"] = stats.dead_fraction
    if stats.nan or stats.inf:
        out["nonfinite"] = stats.nan + stats.inf
    return out


class IndexWriter:
    """Appends events to one rank's index, a whole line at a time: a write that fails (a full
    disk) is cut back off, so the next line does not join a half one. Errors of a full or
    read-only disk are one-line InputErrors (`write_error`)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / index_name(rank)
        self.folder = folder
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
            end = os.lseek(self._fd, 0, os.SEEK_END)
            if end and os.pread(self._fd, 1, end - 1) != b"\n":
                self._append(b"\n")  # a line a crash cut short ends here, alone
        except OSError as exc:
            self.close()
            raise write_error(exc, folder) from None

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, allow_nan=True) + "\n"
        try:
            self._append(line.encode())
        except OSError as exc:
            raise write_error(exc, self.folder, step=fields.get("step")) from None

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        end = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            os.ftruncate(self._fd, end)
            raise

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)


@dataclass
class RankIndex:
    rank: int
    start: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    trips: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    resumed: list[dict[str, Any]] = field(default_factory=list)
    truncated: list[dict[str, Any]] = field(default_factory=list)

    def step(self, step: int) -> dict[str, Any] | None:
        return next((s for s in self.steps if s["step"] == step), None)

    def last_step(self) -> int | None:
        """The last step this index has an event of (recorded, evaluated, tripped, skipped)."""
        steps = [e["step"] for e in (*self.steps, *self.evals, *self.trips)]
        steps += self.skipped
        return max(steps, default=None)

    def _drop_from(self, first: int) -> None:
        self.steps = [s for s in self.steps if s["step"] < first]
        self.evals = [e for e in self.evals if e["step"] < first]
        self.trips = [t for t in self.trips if t["step"] < first]
        self.skipped = [s for s in self.skipped if s < first]


@dataclass
class RunIndex:
    folder: Path
    ranks: dict[int, RankIndex]

    @property
    def hits(self) -> list[dict[str, Any]]:
        return [h for r in self.ranks.values() for s in r.steps for h in s.get("hits", [])]

    def step_file(self, step: int, rank: int) -> Path:
        """The file of a recorded step, or an InputError listing the steps there are."""
        index = self.ranks.get(rank)
        if index is None:
            raise InputError(
                f"no rank {rank} in '{self.folder}'; ranks: {', '.join(map(str, self.ranks))}"
            )
        entry = index.step(step)
        trip = next((t for t in index.trips if t["step"] == step and t.get("file")), None)
        name = (entry or {}).get("file") or (trip or {}).get("file")
        if name is None:
            files = {t["step"] for t in index.trips if t.get("file")}
            steps = sorted({s["step"] for s in index.steps} | files)
            shown = ", ".join(map(str, steps[:10])) + (" ..." if len(steps) > 10 else "")
            raise InputError(f"step {step} was not recorded on rank {rank}; recorded: {shown}")
        path = self.folder / name
        if not path.is_file():
            raise InputError(f"'{path}' is listed in the index but missing; was it deleted?")
        return path


def _read_index(path: Path, rank: int) -> RankIndex:
    index = RankIndex(rank)
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        kind = event.get("event")
        if kind == "start":
            index.start = event
        elif kind == "resume":
            index.resumed.append(event)
        elif kind == "step":
            index.steps = [s for s in index.steps if s["step"] != event["step"]] + [event]
        elif kind == "eval":
            index.evals.append(event)
        elif kind == "skipped":
            index.skipped.append(event["step"])
        elif kind == "tripwire":
            index.trips.append(event)
        elif kind == "truncate":
            index._drop_from(event["from_step"])
            index.truncated.append(event)
    return index


def read_rank(folder: Path, rank: int) -> RankIndex | None:
    """One rank's index in `folder`, or None when it has none."""
    path = folder / index_name(rank)
    return _read_index(path, rank) if path.is_file() else None


def read_run(folder: str | os.PathLike[str]) -> RunIndex:
    """Every rank's index in `folder` (a run written by `modeltap.record`): per rank its start
    settings, recorded steps (each with its file, per-key statistics summaries, update ratios
    and rule hits), evaluations, skipped steps and tripwire events."""
    root = Path(folder)
    ranks: dict[int, RankIndex] = {}
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        match = INDEX_RE.match(path.name)
        if match is None:
            continue
        index = _read_index(path, int(match.group(1)))
        ranks[index.rank] = index
    if not ranks:
        raise InputError(
            f"'{root}' holds no index.rank*.jsonl; give a folder written by modeltap.record, "
            "or a dump file"
        )
    return RunIndex(root, dict(sorted(ranks.items())))


def step_formats(
    run: RunIndex, rank: int
) -> tuple[list[str], list[tuple[int, dict[str, dict[str, Any]]]]]:
    """The what-if figures of `record(..., formats=[...])` on `rank`: the formats, and per
    recorded step (in order) key -> format -> its figures, read from the step files'
    statistics (the index keeps none of them). ([], []) when the run measured no format; a step
    whose file is gone is left out."""
    from modeltap.dump import load_dump

    steps = sorted(run.ranks[rank].steps, key=lambda s: s["step"]) if rank in run.ranks else []
    formats: list[str] = []
    out: list[tuple[int, dict[str, dict[str, Any]]]] = []
    for entry in steps:
        path = run.folder / entry.get("file", "")
        if not entry.get("file") or not path.is_file():
            continue
        dump = load_dump(path)
        found = json.loads(dump.metadata.get("formats", "[]"))
        if not found:
            if not formats:
                return [], []  # recorded without formats (all its steps are)
            continue
        formats += [f for f in found if f not in formats]
        out.append((entry["step"], {k: s.formats for k, s in dump.stats.items() if s.formats}))
    return formats, out
