"""One call from a loaded model and inputs to a dump file: what `modeltap dump` does."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.capture import hooks, run_model
from modeltap.dump import DEFAULT_MAX_INFLIGHT, DumpWriter
from modeltap.loading import Inputs, check_forward_names
from modeltap.selection import Selection, select_modules

if TYPE_CHECKING:
    from torch import nn

    from modeltap.grads import GradSpec

# Header bytes reserved per hooked module (statistics, entry and order of a few keys each).
_RESERVE_PER_MODULE = 1536


def default_out(model: str, *, grads_only: bool = False) -> Path:
    """`<last part of the model id or folder>.dump.safetensors` (`.grads.` for gradients only)."""
    name = Path(model.rstrip("/\\")).name or "model"
    return Path(f"{name}.{'grads' if grads_only else 'dump'}.safetensors")


def environment() -> dict[str, str]:
    import torch
    import transformers

    from modeltap import __version__

    return {
        "modeltap_version": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def dump_model(
    model: nn.Module,
    inputs: Inputs,
    out: str | os.PathLike[str],
    *,
    selection: Selection | None = None,
    capture_inputs: bool = False,
    train_mode: bool = False,
    seed: int | None = 0,
    stats_only: bool = False,
    dead_threshold: float = 0.0,
    metadata: dict[str, str] | None = None,
    grads: GradSpec | None = None,
    activations: bool = True,
    mask_token_id: int | None = None,
    special_ids: tuple[int, ...] = (),
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
) -> Path:
    """Run `model` on `inputs` with the selected modules hooked and stream a dump to `out`.

    With `grads`, the forward runs with autograd on and one backward pass adds the gradients
    (keys under `grad/`); `activations=False` then leaves the activations out (`modeltap grads`).
    Returns the path written. The file appears only if everything succeeded. `max_inflight`:
    bytes the writer thread may hold copied but not yet written (see `DumpWriter`).
    """
    import torch

    selection = selection or Selection()
    modules = select_modules(model, selection)
    check_forward_names(model, inputs)
    mask = inputs.attention_mask
    writer = DumpWriter(
        out,
        stats_only=stats_only,
        dead_threshold=dead_threshold,
        row_mask=None if mask is None else mask.bool(),
        reserve=4096
        + _RESERVE_PER_MODULE * len(modules) * (1 + (capture_inputs or grads is not None)),
        max_inflight=max_inflight,
    )
    if grads is not None:
        return _dump_with_grads(
            model,
            inputs,
            writer,
            modules,
            grads,
            activations=activations,
            train_mode=train_mode,
            seed=seed or 0,
            mask_token_id=mask_token_id,
            special_ids=special_ids,
            meta={
                **environment(),
                "model_class": type(model).__name__,
                "seed": str(seed),
                "train_mode": str(train_mode).lower(),
                **(metadata or {}),
                "inputs": json.dumps(inputs.description),
                "selection": json.dumps({**selection.as_dict(), "inputs": False}),
            },
        )
    with writer, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        with hooks(model, modules, writer, inputs=capture_inputs, train_mode=train_mode) as rec:
            with torch.no_grad():
                run_model(model, inputs.args, inputs.kwargs)
        meta: dict[str, Any] = {
            "kind": "activations",
            **environment(),
            "model_class": type(model).__name__,
            "seed": str(seed),
            "train_mode": str(train_mode).lower(),
            **(metadata or {}),
            "inputs": json.dumps(inputs.description),
            "selection": json.dumps({**selection.as_dict(), "inputs": capture_inputs}),
            "order": json.dumps(rec.order),
            "skipped": json.dumps(rec.skipped),
            "skipped_none": str(rec.skipped_none),
        }
        return writer.finish(meta)


def _dump_with_grads(
    model: nn.Module,
    inputs: Inputs,
    writer: DumpWriter,
    modules: list[str],
    spec: GradSpec,
    *,
    activations: bool,
    train_mode: bool,
    seed: int,
    mask_token_id: int | None,
    special_ids: tuple[int, ...],
    meta: dict[str, str],
) -> Path:
    from modeltap.grads import run_grads

    with writer:
        result = run_grads(
            model,
            inputs,
            writer,
            spec=spec,
            modules=modules,
            activations=modules if activations else (),
            train_mode=train_mode,
            seed=seed,
            mask_token_id=mask_token_id,
            special_ids=special_ids,
        )
        return writer.finish(
            {
                "kind": "activations+gradients" if activations else "gradients",
                **meta,
                "grad": json.dumps(result.meta),
                "order": json.dumps(result.order),
                "skipped": json.dumps(result.skipped),
                "skipped_none": str(result.skipped_none),
            }
        )
