"""Models from Python: `MODEL` as `pkg.module:function`, a callable that builds the model.

The function returns an `nn.Module` (a `torch.fx.GraphModule` too), or `(module, example_inputs)`
where the example inputs are a tensor, a tuple of positional tensors or a dict of named ones; they
are the inputs when no TEXT or --input-file is given.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, first_line

if TYPE_CHECKING:
    from torch import nn

    from modeltap.loading.inputs import Inputs

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_factory(name: str) -> bool:
    return bool(_FACTORY.match(name)) and not Path(name).exists()


@dataclass
class Made:
    module: nn.Module
    example: Inputs | None
    graph_module: bool


def load_factory(spec: str) -> Made:
    """Import `pkg.module`, call `function()`, check what it returned."""
    import torch

    module_name, _, function_name = spec.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`: the current folder's packages
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(
            f"can't import '{module_name}' for the factory '{spec}' ({first_line(exc)}); "
            "check the module path, or run from the folder that holds the package"
        ) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise InputError(f"'{module_name}' has no function '{function_name}'; check '{spec}'")
    try:
        made = function()
    except Exception as exc:  # the user's code can fail in any way
        raise InputError(f"the factory '{spec}' failed: {first_line(exc)}") from exc
    example = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        made, example = made
    if not isinstance(made, torch.nn.Module):
        raise InputError(
            f"the factory '{spec}' returned {type(made).__name__}; it must return an nn.Module "
            "(or an fx.GraphModule), optionally as (module, example_inputs)"
        )
    made.eval()
    return Made(made, _inputs(example, spec), isinstance(made, torch.fx.GraphModule))


def _inputs(example: Any, spec: str) -> Inputs | None:
    import torch

    from modeltap.loading.inputs import Inputs

    if example is None:
        return None
    if isinstance(example, torch.Tensor):
        example = (example,)
    if isinstance(example, dict) and all(isinstance(v, torch.Tensor) for v in example.values()):
        shapes = {k: list(v.shape) for k, v in example.items()}
        return Inputs((), dict(example), {"example_inputs": "factory", "tensors": shapes})
    if isinstance(example, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in example):
        shapes = {str(i): list(v.shape) for i, v in enumerate(example)}
        return Inputs(tuple(example), {}, {"example_inputs": "factory", "tensors": shapes})
    raise InputError(
        f"the factory '{spec}' returned example inputs of type {type(example).__name__}; "
        "return a tensor, a tuple of tensors or a dict of named tensors"
    )
