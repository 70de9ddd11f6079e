"""One call from a loaded model and inputs to a dump file: what `modeltap dump` does."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.capture import hooks, run_model
from modeltap.dump import DEFAULT_MAX_INFLIGHT, DumpWriter
from modeltap.dump.format import INPUTS_PREFIX
from modeltap.loading import Inputs, check_forward_names
from modeltap.selection import Selection, select_modules

if TYPE_CHECKING:
    from torch import nn

    from modeltap.capture.backend import Backend
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
    backend: Backend | None = None,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    hist: bool = False,
) -> Path:
    """Run `model` on `inputs` with the selected modules hooked and stream a dump to `out`.

    With `grads`, the forward runs with autograd on and one backward pass adds the gradients
    (keys under `grad/`); `activations=False` then leaves the activations out (`modeltap grads`).
    Returns the path written. The file appears only if everything succeeded.
    `backend` (capture/compile.py, ...) runs the model another way; the keys stay the eager keys.
    `max_inflight`: bytes the writer thread may hold copied but not yet written (see `DumpWriter`).
    `hist`: a fixed-bin histogram per tensor in its statistics (`stats.HIST_EDGES`).
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
        hist=hist,
    )
    sink = _DeviceLog(writer)
    stored_inputs = [] if stats_only else _processed_input_keys(inputs)
    if grads is not None:
        return _dump_with_grads(
            model,
            inputs,
            sink,
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
            backend=backend,
            stored_inputs=stored_inputs,
        )
    backend_meta = {"backend": "eager"}
    with writer, torch.random.fork_rng(devices=[]):
        _write_inputs(sink, inputs, stored_inputs)
        if backend is not None:
            done = backend.run(
                model,
                modules,
                sink,
                inputs.args,
                inputs.kwargs,
                inputs=capture_inputs,
                train_mode=train_mode,
                seed=seed,
            )
            rec = done.recorder
            backend_meta = {
                "backend": backend.name,
                "backend_details": json.dumps(done.details),
                "unmapped": json.dumps(done.unmapped),
            }
        else:
            if seed is not None:
                manual_seed(seed)
            with hooks(model, modules, sink, inputs=capture_inputs, train_mode=train_mode) as rec:
                with torch.no_grad():
                    run_model(model, inputs.args, inputs.kwargs)
        meta: dict[str, Any] = {
            "kind": "activations",
            **environment(),
            "model_class": type(model).__name__,
            "seed": str(seed),
            "train_mode": str(train_mode).lower(),
            **backend_meta,
            **(metadata or {}),
            "inputs": json.dumps(inputs.description),
            "selection": json.dumps({**selection.as_dict(), "inputs": capture_inputs}),
            "order": json.dumps([*stored_inputs, *rec.order]),
            "skipped": json.dumps(rec.skipped),
            "skipped_none": str(rec.skipped_none),
            "devices": json.dumps(sink.devices),
        }
        return writer.finish(meta)


def manual_seed(seed: int) -> None:
    """`torch.manual_seed(seed)` for every generator a forward can draw from: the CPU's and
    those of the device runtimes already started (a model on a GPU has started it).

    torch.manual_seed also queues a seed for each runtime not started (CUDA, XPU, MTIA), with a
    formatted call stack each: 1.1 ms of CPU in a new process, a sixth of what a small dump
    costs over bare hooks. Where a runtime can't be asked whether it started, or MPS or a
    custom device is present, torch.manual_seed is called as it is.
    """
    import torch

    runtimes = [getattr(torch, name, None) for name in ("cuda", "xpu", "mtia")]
    plain = all(hasattr(m, "is_initialized") for m in runtimes if m is not None)
    mps = getattr(torch.backends, "mps", None)
    plain = plain and not (mps is not None and mps.is_available())
    plain = plain and not hasattr(torch, torch._C._get_privateuse1_backend_name())
    if not plain:
        torch.manual_seed(seed)
        return
    for runtime in runtimes:
        if runtime is not None and runtime.is_initialized():
            runtime.manual_seed_all(seed)
    torch.default_generator.manual_seed(seed)


def _processed_input_keys(inputs: Inputs) -> list[str]:
    """`inputs/NAME` for each tensor a processor made from images or audio (loading/processors):
    stored first, so that `diff` finds preprocessing drift before any module."""
    if "processor" not in inputs.description:
        return []
    made = inputs.description.get("tensors", {})  # not the decoder start added after it
    return [
        f"{INPUTS_PREFIX}{name}"
        for name, value in inputs.kwargs.items()
        if name in made and _is_tensor(value)
    ]


def _write_inputs(sink: Any, inputs: Inputs, keys: list[str]) -> None:
    for key in keys:
        sink.tensor(key, inputs.kwargs[key[len(INPUTS_PREFIX) :]])


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


@contextmanager
def _grads_through(
    backend: Backend | None, model: nn.Module
) -> Iterator[Callable[[], dict[str, str]] | None]:
    """Gradients through a backend that supports them (`around_grads`); yields its metadata."""
    if backend is None:
        yield None
        return
    around = getattr(backend, "around_grads", None)
    if around is None:
        from modeltap.errors import InputError

        raise InputError(f"gradients need the eager model; dump without --grads ({backend.name})")
    with around(model) as info:

        def details() -> dict[str, str]:
            done = {k: v for k, v in info.as_dict().items() if not k.endswith("_s")}
            done["hooks"] = "graph-breaking (gradients)"
            return {"backend": backend.name, "backend_details": json.dumps(done)}

        yield details


def _dump_with_grads(
    model: nn.Module,
    inputs: Inputs,
    writer: _DeviceLog,
    modules: list[str],
    spec: GradSpec,
    *,
    activations: bool,
    train_mode: bool,
    seed: int,
    mask_token_id: int | None,
    special_ids: tuple[int, ...],
    meta: dict[str, str],
    backend: Backend | None = None,
    stored_inputs: list[str] | None = None,
) -> Path:
    from modeltap.grads import run_grads

    stored_inputs = stored_inputs or []
    with (
        writer.writer,
        _offloaded_weights_frozen(model, spec),
        _grads_through(backend, model) as after,
    ):
        _write_inputs(writer, inputs, stored_inputs)
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
                "order": json.dumps([*stored_inputs, *result.order]),
                "skipped": json.dumps(result.skipped),
                "skipped_none": str(result.skipped_none),
                "devices": json.dumps(writer.devices),
                **(after() if after is not None else {"backend": "eager"}),
            }
        )


@contextmanager
def _offloaded_weights_frozen(model: nn.Module, spec: GradSpec) -> Iterator[None]:
    """Weights that accelerate swaps in per forward are fresh tensors each time, never the
    parameters autograd is asked about: gradients would stop at them and every activation upstream
    of the last resident weight would read "no path". Frozen, they leave each selected output to
    start its own path, which gives the same activation gradients (and no weight gradients)."""
    from modeltap.errors import InputError
    from modeltap.loading.placement import offloaded

    if not offloaded(model):
        yield
        return
    if spec.params:
        raise InputError(
            "--params: accelerate swaps offloaded weights in per forward, so they never hold a "
            "gradient; drop --params, or give --max-memory room for the whole model"
        )
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        yield
    finally:
        # by name: accelerate puts a new Parameter (of the same requires_grad) in place each swap
        for n, p in model.named_parameters(remove_duplicate=False):
            if n in trainable:
                p.requires_grad_(True)


@functools.cache
def device_name(device: Any) -> str:
    """`str(device)`, which costs more than the rest of a small tensor's bookkeeping."""
    return str(device)


class _DeviceLog:
    """The writer, noting the device of each tensor it is given (a big model's outputs come from
    several GPUs, or the CPU); everything else goes straight to the writer."""

    def __init__(self, writer: DumpWriter) -> None:
        self.writer = writer
        self.devices: dict[str, str] = {}

    def tensor(self, key: str, tensor: Any, **kwargs: Any) -> None:
        self.devices[key] = device_name(tensor.device)
        self.writer.tensor(key, tensor, **kwargs)

    def computed(self, key: str, stats: Any, device: Any) -> None:
        self.devices[key] = device_name(device)
        self.writer.computed(key, stats)

    def alias(self, key: str, target: str) -> None:
        self.writer.alias(key, target)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)
