"""Reading a dump lazily: metadata now, each tensor only when asked for."""

from __future__ import annotations

import json
import mmap
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import DumpFormatError, InputError, first_line
from modeltap.stats import (
    TensorStats,
)

if TYPE_CHECKING:

    import torch

from modeltap.dump.format import (
    _NUMPY,
    FORMAT,
    FORMAT_VERSION,
    _checked_header,
    _read_header,
    _torch_dtype,
)


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

    def _mapping(self) -> tuple[Any, int, dict[str, Any]] | None:
        """(the file mapped copy-on-write, data start, tensor entries), opened once."""
        if self._map is None:
            header = _read_header(self.path)
            if header is None:
                return None
            with open(self.path, "rb") as f:
                self._map = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), *header)
        return self._map

    def _mapped(self, target: str) -> torch.Tensor | None:
        """A zero-copy, copy-on-write view of the tensor in the memory-mapped file, if possible.

        Pages come straight from the page cache; writing to the tensor changes only this
        process's private copy, never the file. None when the layout does not allow a view.
        """
        import torch

        mapping = self._mapping()
        if mapping is None:
            return None
        buffer, start, entries = mapping
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
        if view is not None:
            return view
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle.get_tensor(target)

    def array(self, key: str) -> tuple[Any, str] | None:
        """(a numpy array of the tensor, its dtype name), without torch: a read-only view of the
        memory-mapped file, or for bfloat16 an exact float32 copy. None for a dtype numpy can't
        hold (float8, complex) or a layout that allows no view: read those with `dump[key]`."""
        import numpy as np

        target = self.resolve(key)
        if target not in self.stored:
            raise KeyError(key)
        mapping = self._mapping()
        if mapping is None:
            return None
        buffer, start, entries = mapping
        info = entries.get(target)
        code = info["dtype"] if info else None
        stored = _NUMPY.get(code or "")
        if stored is None or sys.byteorder != "little":
            return None
        begin, end = info["data_offsets"]
        itemsize = np.dtype(stored).itemsize
        if (start + begin) % itemsize:
            return None
        flat = np.frombuffer(
            buffer, dtype=stored, count=(end - begin) // itemsize, offset=start + begin
        )
        name = "bfloat16" if code == "BF16" else str(flat.dtype)
        if code == "BF16":  # the top half of a float32, to the bit
            flat = (flat.astype(np.uint32) << 16).view(np.float32)
        return flat.reshape(info["shape"]), name

    def shape(self, key: str) -> list[int] | None:
        """The shape of `key`'s tensor from the file's header, no data read (None when unknown)."""
        mapping = self._mapping()
        info = mapping[2].get(self.resolve(key)) if mapping is not None else None
        return list(info["shape"]) if info else None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            if self.resolve(key) in self.stored:
                yield key, self[key]

    def stats_for(self, key: str) -> TensorStats | None:
        return self.stats.get(self.resolve(key))



def load_dump(path: str | os.PathLike[str]) -> Dump:
    """Open a dump (or any safetensors file) without reading its tensors (nor importing torch:
    the header is read and checked here; safetensors opens the file when a tensor is asked for)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no file '{p}'; check the path")
    try:
        metadata, stored = _checked_header(p)
    except (OSError, ValueError) as exc:
        raise DumpFormatError(
            f"'{p}' is not a readable safetensors file ({first_line(exc)}); "
            "re-create it with `modeltap dump`"
        ) from exc
    handle = None
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
