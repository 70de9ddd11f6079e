"""The dump format as a package: format.py (keys, metadata schema, version), writer.py (streaming,
atomic, the writer thread), reader.py (the lazy Dump).

This package is also the verb: `modeltap.dump(model, inputs, path, depth=3)` calls
`modeltap.dumping.dump` (`_lazy.callable_package`), so the verb hides none of the names here.
"""

from modeltap._lazy import callable_package
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

callable_package(__name__, "modeltap.dumping", "dump")
