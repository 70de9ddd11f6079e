"""`modeltap.grads(model, inputs, path)`: what `modeltap grads` writes, from Python."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def grads(
    model: nn.Module,
    inputs: Any,
    path: str | os.PathLike[str],
    *,
    target: str | None = None,
    wrt: Sequence[str] = (),
    loss: str = "sum",
    params: bool = False,
    stats_only: bool = False,
    activations: bool = False,
    ops: bool = False,
    formats: Sequence[str] = (),
    depth: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    tokenizer: Any = None,
    train_mode: bool = False,
    seed: int | None = 0,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Run one forward and one backward of `model` on `inputs` and write the selected modules'
    output gradients (keys under `grad/`), with their statistics, to `path`; returns the path.

    `target`: the module whose output is differentiated (default: the model's); `wrt`: only the
    gradients with respect to these modules or input names; `loss`: `sum`, or the model's `lm` /
    `mlm` loss; `params`: the weights' gradients too; `activations`: the activations too; `ops`:
    inside each module that gets gradients, every op its own code runs, its output
    (`module/opNN.name`) and the gradient w.r.t. it (`grad/module/opNN.name`), as `--ops`;
    `formats`: what quantizing each float tensor would cost, as `--formats`. `inputs`, `depth`,
    `include`, `exclude`, `stats_only` and `tokenizer` as `modeltap.dump`'s."""
    from modeltap.dumping import as_inputs, dump_model
    from modeltap.grads.spec import GradSpec
    from modeltap.selection import Selection

    spec = GradSpec(target=target, wrt=tuple(wrt or ()), loss=loss, params=params)
    return dump_model(
        model,
        as_inputs(inputs, tokenizer=tokenizer),
        path,
        selection=Selection(depth=depth, include=tuple(include), exclude=tuple(exclude)),
        train_mode=train_mode,
        seed=seed,
        stats_only=stats_only,
        metadata=metadata,
        grads=spec,
        activations=activations,
        ops=ops,
        formats=formats,
        mask_token_id=getattr(tokenizer, "mask_token_id", None),
    )
