"""The dump format: a safetensors file written as the model runs, atomically, and its lazy reader.

Layout: the usual safetensors header (8-byte little-endian length, JSON), then the tensor bytes.
The writer reserves header space up front, padded with spaces as the format allows, and appends each
distinct tensor as its module returns, so memory does not grow with the number of captured layers.
If the final header does not fit the reservation, the data is moved once behind a larger header.

Metadata (`__metadata__`, all values strings, JSON where structured): see METADATA_KEYS and README.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import DumpFormatError, InputError, first_line
from modeltap.stats import TensorStats, tensor_stats

if TYPE_CHECKING:
    import torch

FORMAT = "modeltap"
FORMAT_VERSION = 1
GRAD_PREFIX = "grad/"

# Every metadata key the writer may set; values are strings, JSON-encoded when marked.
METADATA_KEYS = {
    "format": "always 'modeltap'",
    "format_version": "integer, bumped on incompatible changes",
    "kind": "'activations', 'gradients' or both joined by '+'",
    "modeltap_version": "version that wrote the file",
    "model": "model id or path as given",
    "revision": "resolved commit hash of a Hub model, when known",
    "model_class": "class that loaded the model, e.g. BertModel",
    "inputs": "JSON: texts, or input file name and sha256, and the input tensors' shapes",
    "dtype": "model dtype",
    "device": "device the model ran on",
    "torch": "torch version",
    "transformers": "transformers version",
    "seed": "seed set before the forward",
    "train_mode": "'true' when dropout etc. were active",
    "selection": "JSON: depth, include, exclude, inputs",
    "order": "JSON list: every key (aliases too) in the order the model produced it",
    "aliases": "JSON object: alias key -> key of the stored tensor",
    "skipped": "JSON object: key -> type name of outputs that are not tensors (None is counted)",
    "skipped_none": "number of None outputs",
    "stats": "JSON object: stored key -> statistics (see stats.TensorStats)",
    "stats_only": "'true' when no tensor data was written",
    "dead_threshold": "threshold used for dead units",
    "grad": "JSON, with gradients: target, loss, grad_output, seed, wrt, no_path, jacobian...",
    # Written by modeltap.record, one file per recorded step and rank:
    "step": "training step the file records",
    "rank": "torch.distributed rank that wrote it (0 without a process group)",
    "world_size": "number of ranks (1 without a process group)",
    "dist_backend": "process group backend (gloo, nccl...) or 'none'",
    "record": "JSON: every, full_every, grads, params, gather, on_nonfinite, not_run",
    "placements": "JSON: key -> placements, global_shape, mesh, local_shape of a sharded tensor",
    "updates": "JSON: parameter -> ||w_after - w_before|| / ||w_before|| of the step",
    "rules": "JSON list of rule hits: rule, step, rank, key, value, message",
    "tripwire": "JSON: where the first non-finite value came from (step, phase, module...)",
    "devices": "JSON object: stored key -> device the tensor came from (cpu, cuda:0, ...)",
    "device_map": "JSON object, with --device-map: module -> device accelerate placed it on",
    "backend": "how the model ran: eager, compile, export, torchscript or fx",
    "backend_details": "JSON: the backend's details (compile: backend, graphs, graph_breaks...)",
    "unmapped": "JSON list: selected modules that produced no value (never called, or unmappable)",
}

_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}

_ALIGN = 8


@functools.cache
def _torch_dtype(code: str) -> Any:
    """safetensors dtype code -> torch dtype (None if unknown)."""
    import torch

    name = next((n for n, c in _DTYPES.items() if c == code), None)
    return getattr(torch, name, None) if name else None


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_target(path: Path) -> Path:
    """Where writing `path` really lands: through a symbolic link to its target, as `cp` does.

    The link stays a link and now points at the new file; a dangling link creates its target.
    """
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_writable(path: Path) -> None:
    """Fail before any work when the dump could not be written.

    Missing folders are fine (the writer creates them); the nearest existing one must be a
    writable folder.
    """
    path = write_target(path)
    if path.is_dir():
        raise InputError(f"output '{path}' is a directory; give a file name with -o/--out")
    parent = path.parent if str(path.parent) else Path(".")
    existing = parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"output folder '{parent}' can't be made: '{existing}' is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"output folder '{existing}' is not writable; change -o/--out")


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
    ) -> None:
        self.path = write_target(Path(path))
        check_writable(self.path)
        self.stats_only = stats_only
        self.dead_threshold = dead_threshold
        self.row_mask = row_mask
        self.stats: dict[str, TensorStats] = {}
        self.aliases: dict[str, str] = {}
        self._entries: dict[str, dict[str, Any]] = {}
        self._reserve = _align(reserve)
        self._offset = 0
        self._tmp = temp_path(self.path)
        self._file: Any = None

    def __enter__(self) -> DumpWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.path.parent)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in finish() or abort()
        self._file.write(b"\0" * (8 + self._reserve))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()

    def tensor(self, key: str, tensor: torch.Tensor, *, count_zeros: bool = False) -> None:
        self.stats[key] = tensor_stats(
            tensor,
            dead_threshold=self.dead_threshold,
            row_mask=self.row_mask,
            count_zeros=count_zeros,
        )
        if self.stats_only:
            return
        dtype = _DTYPES.get(self.stats[key].dtype)
        if dtype is None:
            raise InputError(
                f"can't store '{key}' of dtype {self.stats[key].dtype}; use --stats-only"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(_byte_dtype())
        size = data.numel()
        if size:
            self._file.write(memoryview(data.numpy()))
        self._entries[key] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, self._offset + size],
        }
        self._offset += size

    def alias(self, key: str, target: str) -> None:
        self.aliases[key] = target

    def finish(self, metadata: dict[str, str]) -> Path:
        """Write the header, move the file into place, and return its path."""
        meta = dict(metadata)
        meta.update(
            format=FORMAT,
            format_version=str(FORMAT_VERSION),
            aliases=json.dumps(self.aliases),
            stats=json.dumps({k: s.to_json() for k, s in self.stats.items()}),
            stats_only=str(self.stats_only).lower(),
            dead_threshold=repr(float(self.dead_threshold)),
        )
        header = json.dumps({"__metadata__": meta, **self._entries}, separators=(",", ":")).encode()
        try:
            if len(header) <= self._reserve:
                self._file.seek(0)
                self._file.write(struct.pack("<Q", self._reserve) + header.ljust(self._reserve))
                self._file.close()
            else:
                self._relocate(header)
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def _relocate(self, header: bytes) -> None:
        """The header outgrew its reservation: copy the data behind a bigger one (kernel-side)."""
        self._file.close()
        padded = header.ljust(_align(len(header)))
        moved = self._tmp.with_name(self._tmp.name + ".2")
        try:
            with open(self._tmp, "rb") as src, open(moved, "wb") as dst:
                dst.write(struct.pack("<Q", len(padded)) + padded)
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
        if self._file is not None and not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def _byte_dtype() -> torch.dtype:
    import torch

    return torch.uint8


@dataclass
class Dump:
    """A dump opened lazily: metadata now, each tensor only when asked for (memory-mapped)."""

    path: Path
    metadata: dict[str, str]
    stored: list[str]
    aliases: dict[str, str] = field(default_factory=dict)
    order: list[str] | None = None
    stats: dict[str, TensorStats] = field(default_factory=dict)
    _handle: Any = None
    _map: Any = None

    def _mapped(self, target: str) -> torch.Tensor | None:
        """A zero-copy, copy-on-write view of the tensor in the memory-mapped file, if possible.

        Pages come straight from the page cache; writing to the tensor changes only this
        process's private copy, never the file. None when the layout does not allow a view.
        """
        import mmap

        import torch

        if self._map is None:
            header = _read_header(self.path)
            if header is None:
                return None
            with open(self.path, "rb") as f:
                self._map = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), *header)
        buffer, start, entries = self._map
        info = entries.get(target)
        dtype = _torch_dtype(info["dtype"]) if info else None
        if dtype is None:
            return None
        begin, end = info["data_offsets"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end == begin or (start + begin) % itemsize:
            return None
        flat = torch.frombuffer(
            buffer, dtype=dtype, count=(end - begin) // itemsize, offset=start + begin
        )
        return flat.reshape(info["shape"])

    @property
    def is_modeltap(self) -> bool:
        return self.metadata.get("format") == FORMAT

    @property
    def stats_only(self) -> bool:
        return self.metadata.get("stats_only") == "true"

    def keys(self) -> list[str]:
        """Every key, aliases included: in execution order when recorded, else in file order.

        A file edited after modeltap wrote it stays consistent: keys whose tensor is gone are left
        out (but in a stats-only dump, which has no data at all), tensors the order does not know
        come last.
        """
        if self.order is None:
            return [*self.stored, *self.aliases]
        if self.stats_only:
            return list(self.order)
        stored = set(self.stored)
        known = set(self.order)
        return [k for k in self.order if self.resolve(k) in stored] + [
            k for k in self.stored if k not in known
        ]

    def resolve(self, key: str) -> str:
        return self.aliases.get(key, key)

    def __contains__(self, key: object) -> bool:
        return key in self.aliases or key in self.stored

    def __getitem__(self, key: str) -> torch.Tensor:
        target = self.resolve(key)
        if target not in self.stored:
            raise KeyError(key)
        view = self._mapped(target) if sys.byteorder == "little" else None
        return view if view is not None else self._handle.get_tensor(target)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            if self.resolve(key) in self.stored:
                yield key, self[key]

    def stats_for(self, key: str) -> TensorStats | None:
        return self.stats.get(self.resolve(key))


def _read_header(path: Path) -> tuple[int, dict[str, Any]] | None:
    """(data start, tensor entries) of a safetensors file that safe_open already validated."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return None
        (size,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def load_dump(path: str | os.PathLike[str]) -> Dump:
    """Open a dump (or any safetensors file) without reading its tensors."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.is_file():
        raise InputError(f"no file '{p}'; check the path")
    try:
        handle = safe_open(str(p), framework="pt")
        metadata = handle.metadata() or {}
        stored = list(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise DumpFormatError(
            f"'{p}' is not a readable safetensors file ({first_line(exc)}); "
            "re-create it with `modeltap dump`"
        ) from exc
    dump = Dump(p, dict(metadata), stored, _handle=handle)
    if metadata.get("format") != FORMAT:
        return dump
    version = metadata.get("format_version", "")
    if not version.isdigit() or int(version) > FORMAT_VERSION:
        raise DumpFormatError(
            f"'{p}' has dump format version {version!r}, newer than this modeltap reads "
            f"({FORMAT_VERSION}); upgrade modeltap"
        )
    try:
        dump.aliases = json.loads(metadata.get("aliases", "{}"))
        dump.order = json.loads(metadata["order"]) if "order" in metadata else None
        dump.stats = {
            k: TensorStats.from_json(v) for k, v in json.loads(metadata.get("stats", "{}")).items()
        }
    except (ValueError, TypeError) as exc:
        raise DumpFormatError(f"'{p}' has corrupt modeltap metadata ({exc}); re-create it") from exc
    return dump
