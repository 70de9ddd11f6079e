"""modeltap: per-layer activations of PyTorch and Hugging Face models, from one command.

The house: data flows one way, load -> select -> capture -> stats -> write -> render / diff /
compare, and each stage has one place, named for it, beside this file:

    loading/        load: models (Hub, archives, factories, placement), inputs; resolve.py for all
    selection.py    select: the module tree -> the selected names (depth, include, exclude)
    capture/        capture: keys, the recorder, one module per backend (eager, compile, fx...)
    stats/          stats: per-tensor statistics, one module per path (CPU blocks, device, graph)
    dump/           write: the safetensors format (format.py, writer.py, reader.py)
    dumping.py      the dump verb: load, select, capture, stats and write in one call
    render/         render: Rich tables and trees, and report/ (the HTML pages); only cli/ prints
    diff/           diff: two dumps, two generations or two runs -> a report, one tolerance model
    compare/        compare: two variants of a model, and the module where they part (replay)
    grads/          gradients: one forward and one backward, streamed into a dump
    generate/       decoding: model.generate() with every step's forward captured
    record/         training runs: record(), the non-finite tripwire, rules, flight records
    integrations/   recording inside transformers' Trainer and Lightning
    exporting.py    the export verb: a model as a .pt2 or TorchScript archive that dump reads
    config/         the option declarations and the Settings built from them (files.py: TOML, env)
    cli/            the commands: app.py, then one module per command (parse, call a verb, render)
    errors.py       ModeltapError, whose messages say what to do; _version.py holds the version

The public API is imported lazily so that `import modeltap` (and `modeltap --help`) stays instant.
The verbs `capture`, `compare`, `diff`, `dump`, `generate`, `grads` and `record` are the packages
of those names made callable (`_lazy.callable_package`): `modeltap.record(model, dir)` records,
`modeltap.record.RecordOptions` and `import modeltap.record.recording` work too, whichever import
comes first. The verbs `export`, `load_dump` and `report` (render/report/write.py) are functions.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from modeltap._version import __version__

# torchao (the quant extra), which transformers imports whenever it is installed, logs at import
# that its GPU kernels did not load and that torch deprecates its pytree registrations of enums:
# neither concerns the CPU recipes modeltap runs through it, so neither reaches stderr.
logging.getLogger("torchao").addFilter(lambda r: not str(r.msg).startswith("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(lambda r: "Enum subclass" not in str(r.msg))

_EXPORTS = {
    "hooks": "modeltap.capture",
    "Captured": "modeltap.capture",
    "dump_model": "modeltap.dumping",
    "load_dump": "modeltap.dump",
    "Dump": "modeltap.dump",
    "DumpWriter": "modeltap.dump",
    "load_model": "modeltap.loading",
    "text_inputs": "modeltap.loading",
    "file_inputs": "modeltap.loading",
    "inputs_from": "modeltap.loading.processors",
    "Inputs": "modeltap.loading",
    "Selection": "modeltap.selection",
    "select_modules": "modeltap.selection",
    "tensor_stats": "modeltap.stats",
    "TensorStats": "modeltap.stats",
    "ModeltapError": "modeltap.errors",
    "compare_models": "modeltap.compare",
    "generate_model": "modeltap.generate",
    "step_view": "modeltap.generate",
    "export": "modeltap.exporting",
    "report": "modeltap.render.report.write",
}

# _EXPORTS declares the lazy names; the imports under TYPE_CHECKING repeat them for type checkers
# (tests/test_architecture.py checks that they match).
# The verbs that are their packages, made callable (`_lazy.callable_package`).
_PACKAGE_VERBS = ("capture", "compare", "diff", "dump", "generate", "grads", "record")

__all__ = sorted([*_EXPORTS, "__version__", *_PACKAGE_VERBS])

if TYPE_CHECKING:
    from modeltap.capture import Captured, hooks
    from modeltap.compare import compare_models
    from modeltap.dump import Dump, DumpWriter, load_dump
    from modeltap.dumping import dump_model
    from modeltap.errors import ModeltapError
    from modeltap.exporting import export
    from modeltap.generate import generate_model, step_view
    from modeltap.loading import Inputs, file_inputs, load_model, text_inputs
    from modeltap.loading.processors import inputs_from
    from modeltap.render.report.write import report
    from modeltap.selection import Selection, select_modules
    from modeltap.stats import TensorStats, tensor_stats


def __getattr__(name: str) -> Any:
    if name in _PACKAGE_VERBS:  # the package, callable as the verb
        return importlib.import_module(f"modeltap.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'modeltap' has no attribute {name!r}")
