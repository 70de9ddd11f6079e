"""The dump format as a package: format.py (keys, metadata schema, version), writer.py (streaming,
atomic, the writer thread), reader.py (the lazy Dump)."""

from modeltap.dump.format import FORMAT, FORMAT_VERSION, GRAD_PREFIX, METADATA_KEYS
from modeltap.dump.reader import Dump, load_dump
from modeltap.dump.writer import (
    DEFAULT_MAX_INFLIGHT,
    DumpWriter,
    check_writable,
    remove_stale_temps,
    temp_path,
    write_target,
)

__all__ = [
    "DEFAULT_MAX_INFLIGHT",
    "FORMAT",
    "FORMAT_VERSION",
    "GRAD_PREFIX",
    "METADATA_KEYS",
    "Dump",
    "DumpWriter",
    "check_writable",
    "load_dump",
    "remove_stale_temps",
    "temp_path",
    "write_target",
]
