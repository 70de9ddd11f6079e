"""A debug log of where each tensor of a dump spent its time: `MODELTAP_TIMELINE=path.jsonl`.

For every tensor a `DumpWriter` is given, one JSON line: when its module returned (`hook`, the
moment the writer got it), and the spans of its copy, its statistics and its write, each with the
thread that ran it: `main` (the caller, inline), `writer` (the writer thread), `deferred` (small
tensors done together in the caller, one span for the whole batch), `final` (the statistics
workers of `final` tensors). A pipeline tensor that waited for room in the writer's buffer has a
`wait` span. Times are seconds from the writer's creation. One line per dump closes it
(`"event": "end"`): when the writer was entered, when `settle` started and ended (everything
given so far done) and when the file was in place. Lines are appended, so one run of several
dumps (a recorded training run) keeps them all; each line names its dump.

Off (the variable unset), a writer holds `None` and pays a few `is None` checks per tensor.
`summary` turns the lines of one dump into the figures `scripts/timeline.py` prints.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

ENV = "MODELTAP_TIMELINE"

# A span: [start, end, thread]
Span = list[Any]


class Timeline:
    """The records of one dump, written when it is finished (or aborted)."""

    def __init__(self, log: Path, dump: Path) -> None:
        self.log = log
        self.dump = dump
        self.t0 = time.perf_counter()
        self.records: list[dict[str, Any]] = []
        self.events: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, dump: Path) -> Timeline | None:
        log = os.environ.get(ENV)
        return cls(Path(log), dump) if log else None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def tensor(self, key: str, nbytes: int) -> dict[str, Any]:
        """A new tensor's record, its hook time now."""
        record = {"key": key, "bytes": nbytes, "hook": self.now()}
        with self._lock:  # gradient hooks may call from autograd's threads
            self.records.append(record)
        return record

    def span(self, record: dict[str, Any], what: str, start: float, thread: str) -> None:
        record[what] = [start, self.now(), thread]

    def event(self, name: str) -> None:
        """The first time `name` happened (a writer settled by its owner settles again in
        `finish`, with nothing left to do)."""
        self.events.setdefault(name, self.now())

    def write(self, status: str) -> None:
        """Append this dump's lines to the log, once (a writer aborted before any tensor, as a
        recorded step in which the model never ran, leaves none)."""
        if not self.records and (status != "done" or not self.events):
            return
        name = str(self.dump)
        lines = [json.dumps({"dump": name, **_rounded(r)}) for r in self.records]
        end = {"dump": name, "event": "end", "status": status, "end": self.now(), **self.events}
        lines.append(json.dumps(_rounded(end)))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:  # one write: a dump's lines stay together
            f.write("\n".join(lines) + "\n")
        self.records, self.events = [], {}


def _rounded(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in record.items():
        if isinstance(v, float):
            v = round(v, 6)
        elif isinstance(v, list):
            v = [round(x, 6) if isinstance(x, float) else x for x in v]
        out[k] = v
    return out


def read(path: str | os.PathLike[str]) -> list[list[dict[str, Any]]]:
    """The log's dumps in the order they ended, each its lines (the `end` line last); a file
    written twice (a recorded run's step files overwritten) is two dumps."""
    dumps: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            current.append(json.loads(line))
            if current[-1].get("event") == "end":
                dumps.append(current)
                current = []
    return dumps


def summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one dump's lines: the forward (entered to the last hook), the statistics' and
    writes' total time and how much of each ran before the last hook, the tail after it, and the
    busy fraction of each thread over the whole dump.

    A deferred batch's one span is counted once, not once per tensor in it.
    """
    end = next(r for r in lines if r.get("event") == "end")
    tensors = [r for r in lines if "key" in r]
    start = end.get("enter", 0.0)
    last_hook = max((r["hook"] for r in tensors), default=start)
    done = end.get("settled", end["end"])
    out: dict[str, Any] = {
        "tensors": len(tensors),
        "bytes": sum(r["bytes"] for r in tensors),
        "forward_s": last_hook - start,
        "tail_s": done - last_hook,
        "finish_s": end["end"] - done,
        "total_s": end["end"] - start,
    }
    busy: dict[str, list[tuple[float, float]]] = {}
    for what in ("copy", "wait", "stats", "write"):
        spans = {tuple(r[what]) for r in tensors if what in r}  # a batch's span once
        total = sum(e - s for s, e, _ in spans)
        before = sum(max(0.0, min(e, last_hook) - s) for s, e, _ in spans)
        out[f"{what}_s"] = total
        out[f"{what}_before_last_hook_s"] = before
        for s, e, thread in spans:
            busy.setdefault(thread, []).append((s, e))
    length = max(out["total_s"], 1e-9)
    out["busy"] = {thread: _union(spans) / length for thread, spans in sorted(busy.items())}
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= reach:
            continue
        total += e - max(s, reach)
        reach = e
    return total
