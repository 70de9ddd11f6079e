"""The per-rank index of a recorded run: one JSON line per event, so `show DIR` reads a run
without opening a single step file.

`index.rank{R}.jsonl` lines, each an object with an `event`:
  start     rank, world_size, backend, every, full_every, grads, params, gather, on_nonfinite,
            modules, model_class, start_step
  resume    the same, when `record(..., resume=True)` continued the run
  step      step, file, full, keys {key: {norm, absmax, dead, nonfinite}}, updates, hits,
            skipped (true when a GradScaler skipped the step's optimizer)
  eval      step, file, keys: an evaluation's forwards (`record(..., eval=True)`)
  skipped   step: a GradScaler skipped the optimizer (inf/NaN gradients)
  tripwire  step, phase, module, key, message, file (with "dump")
A line cut short by a crash is skipped on reading. Under `gather=True` only rank 0 writes one.
"""

from __future__ import annotations

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
    """Appends events to one rank's index, flushed line by line."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / index_name(rank)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": event, **fields}, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class RankIndex:
    rank: int
    start: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    trips: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    resumed: list[dict[str, Any]] = field(default_factory=list)

    def step(self, step: int) -> dict[str, Any] | None:
        return next((s for s in self.steps if s["step"] == step), None)


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
