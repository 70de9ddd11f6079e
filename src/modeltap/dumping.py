"""`modeltap.dump`: a model and its inputs -> a dump file, in one call (`dump`, which reads like
safetensors' `save_file`, over `dump_model`, which `modeltap dump` and `modeltap grads` call with
a loaded model, `Inputs`, a `Selection` and a backend)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.capture import hooks, run_model
from modeltap.capture.backend import RunRequest
from modeltap.dump import DEFAULT_MAX_INFLIGHT, DumpWriter
from modeltap.dump.format import INPUTS_PREFIX
from modeltap.errors import InputError
from modeltap.loading import Inputs, check_forward_names, text_inputs
from modeltap.selection import Selection, select_modules

if TYPE_CHECKING:
    from torch import nn

    from modeltap.capture.backend import Backend
    from modeltap.grads import GradSpec

# Header bytes reserved per hooked module (statistics, entry and order of a few keys each).
_RESERVE_PER_MODULE = 1536
_RESERVE_PER_FORMAT = 128  # with --formats: four figures a format


def default_out(model: str, *, grads_only: bool = False) -> Path:
    """`<last part of the model id or folder>.dump.safetensors` (`.grads.` for gradients only)."""
    name = Path(model.rstrip("/\\")).name or "model"
    return Path(f"{name}.{'grads' if grads_only else 'dump'}.safetensors")


def environment() -> dict[str, str]:
    import torch
    import transformers

    from modeltap._version import __version__

    return {
        "modeltap_version": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def dump(
    model: nn.Module,
    inputs: Any,
    path: str | os.PathLike[str],
    *,
    depth: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    stats_only: bool = False,
    tokenizer: Any = None,
    capture_inputs: bool = False,
    ops: bool = False,
    train_mode: bool = False,
    seed: int | None = 0,
    dead_threshold: float = 0.0,
    hist: bool = False,
    formats: Sequence[str] = (),
    metadata: dict[str, str] | None = None,
) -> Path:
    """`modeltap.dump(model, inputs, path, depth=3)`: run `model` on `inputs` with its modules
    hooked and write every selected module's output, with its statistics, to `path` (a
    .safetensors file, written whole or not at all); returns the path.

    `inputs`: text (a string or a list of them: give `tokenizer=`), a dict of tensors (or what a
    tokenizer or processor returns: BatchEncoding, BatchFeature) passed as keywords, a tensor or a
    tuple of them passed positionally, or an `Inputs`. `depth`, `include`, `exclude`: which
    modules (as `--depth`, `--include`, `--exclude`); `stats_only`: statistics without the tensors;
    `ops`: also every op of the selected modules' own code (as `--ops`); `formats`: what
    quantizing each float tensor in those formats would cost (as `--formats`). The rest as
    `dump_model`."""
    selection = Selection(depth=depth, include=tuple(include), exclude=tuple(exclude))
    return dump_model(
        model,
        as_inputs(inputs, tokenizer=tokenizer),
        path,
        selection=selection,
        capture_inputs=capture_inputs,
        ops=ops,
        train_mode=train_mode,
        seed=seed,
        stats_only=stats_only,
        dead_threshold=dead_threshold,
        metadata=metadata,
        hist=hist,
        formats=formats,
    )


def as_inputs(inputs: Any, *, tokenizer: Any = None) -> Inputs:
    """`dump`'s `inputs` as an `Inputs` (see there); an InputError for text without a
    tokenizer."""
    from collections.abc import Mapping

    if isinstance(inputs, Inputs):
        return inputs
    if isinstance(inputs, str) or (
        isinstance(inputs, list | tuple) and inputs and all(isinstance(i, str) for i in inputs)
    ):
        if tokenizer is None:
            raise InputError("text inputs need a tokenizer: modeltap.dump(..., tokenizer=...)")
        return text_inputs(tokenizer, [inputs] if isinstance(inputs, str) else list(inputs))
    if isinstance(inputs, Mapping):
        kwargs = dict(inputs)
        shapes = {k: list(v.shape) for k, v in kwargs.items() if _is_tensor(v)}
        return Inputs((), kwargs, {"tensors": shapes})
    args = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    return Inputs(args, {}, {})


def dump_model(
    model: nn.Module,
    inputs: Inputs,
    out: str | os.PathLike[str],
    *,
    selection: Selection | None = None,
    capture_inputs: bool = False,
    ops: bool = False,
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
    formats: Sequence[str] = (),
) -> Path:
    """Run `model` on `inputs` with the selected modules hooked and stream a dump to `out`.

    With `grads`, the forward runs with autograd on and one backward pass adds the gradients
    (keys under `grad/`); `activations=False` then leaves the activations out (`modeltap grads`).
    Returns the path written. The file appears only if everything succeeded.
    `backend` (capture/compile.py, ...) runs the model another way; the keys stay the eager keys.
    `max_inflight`: bytes the writer thread may hold copied but not yet written (see `DumpWriter`).
    `hist`: a fixed-bin histogram per tensor in its statistics (`stats.HIST_EDGES`).
    `formats`: the low-precision what-if figures of each float tensor (stats/formats.py).
    `ops`: also the ops of the selected modules' own code (capture/ops.py; of an exported
    program or FX GraphModule: its graph's nodes, capture/graph_ops.py).
    """
    selection = selection or Selection()
    if formats:
        from modeltap.stats.formats import check_formats

        formats = tuple(check_formats(formats))
    modules = select_modules(model, selection)
    if ops:
        _check_ops(modules, backend)
    check_forward_names(model, inputs)
    mask = inputs.attention_mask
    writer = DumpWriter(
        out,
        stats_only=stats_only,
        dead_threshold=dead_threshold,
        row_mask=None if mask is None else mask.bool(),
        reserve=4096
        + (_RESERVE_PER_MODULE + _RESERVE_PER_FORMAT * len(formats))
        * len(modules)
        * (1 + (capture_inputs or grads is not None)),
        max_inflight=max_inflight,
        hist=hist,
        formats=tuple(formats),
    )
    run = _Run(
        model,
        inputs,
        selection,
        modules,
        _DeviceLog(writer),
        [] if stats_only else _processed_input_keys(inputs),
        seed=seed,
        train_mode=train_mode,
        metadata=metadata,
        backend=backend,
        ops=ops,
    )
    if grads is not None:
        options = {"mask_token_id": mask_token_id, "special_ids": special_ids}
        return _dump_with_grads(run, grads, activations=activations, **options)
    return _dump_activations(run, capture_inputs=capture_inputs)


@dataclass
class _Run:
    """One dump's run: what both the activations and the gradients path take, and the metadata
    they write (built in one place, `metadata`)."""

    model: nn.Module
    inputs: Inputs
    selection: Selection
    modules: list[str]
    sink: _DeviceLog
    stored_inputs: list[str]
    seed: int | None
    train_mode: bool
    metadata: dict[str, str] | None
    backend: Backend | None
    ops: bool = False

    def metadata_for(
        self,
        kind: str,
        recorded: Any,
        *,
        inputs_captured: bool,
        backend: dict[str, str],
        after: dict[str, str] | None = None,
    ) -> dict[str, str]:
        """The dump's metadata: the run (`kind`, versions, model class, seed, mode), the
        backend's notes, the caller's `metadata`, the inputs and selection, then what the
        `recorded` run saw (its order, skips, devices) and `after` (a gradient path's notes)."""
        return {
            "kind": kind,
            **environment(),
            "model_class": type(self.model).__name__,
            "seed": str(self.seed),
            "train_mode": str(self.train_mode).lower(),
            **backend,
            **(self.metadata or {}),
            "inputs": json.dumps(self.inputs.description),
            "selection": json.dumps({**self.selection.as_dict(), "inputs": inputs_captured}),
            **(after or {}),
            "order": json.dumps([*self.stored_inputs, *recorded.order]),
            "skipped": json.dumps(recorded.skipped),
            "skipped_none": str(recorded.skipped_none),
            "devices": json.dumps(self.sink.devices),
        }


def _dump_activations(run: _Run, *, capture_inputs: bool) -> Path:
    import torch

    model, inputs, sink, backend = run.model, run.inputs, run.sink, run.backend
    backend_meta = {"backend": "eager"}
    with sink.writer, torch.random.fork_rng(devices=[]):
        _write_inputs(sink, inputs, run.stored_inputs)
        if backend is not None:
            call = (model, run.modules, sink, inputs.args, inputs.kwargs)
            options = {"inputs": capture_inputs, "train_mode": run.train_mode, "seed": run.seed}
            done = backend.run(RunRequest(*call, **options, ops=run.ops))
            rec = done.recorder
            backend_meta = {
                "backend": backend.name,
                "backend_details": json.dumps(done.details),
                "unmapped": json.dumps(done.unmapped),
            }
            if done.ops is not None:
                backend_meta["ops"] = json.dumps(done.ops)
        else:
            if run.seed is not None:
                manual_seed(run.seed)
            options = {"inputs": capture_inputs, "train_mode": run.train_mode}
            with hooks(model, run.modules, sink, **options) as rec:
                with torch.no_grad(), _ops(run, rec) as tracer:
                    run_model(model, inputs.args, inputs.kwargs)
            if tracer is not None:
                backend_meta["ops"] = json.dumps(tracer.meta)
        meta = run.metadata_for(
            "activations", rec, inputs_captured=capture_inputs, backend=backend_meta
        )
        return sink.writer.finish(meta)


def _check_ops(modules: list[str], backend: Backend | None) -> None:
    """--ops needs the eager model running its own Python code, or a graph whose nodes are the
    ops (an exported program, an FX GraphModule), and a module to look inside."""
    if not modules:
        raise InputError("--ops: no module is selected; widen --depth or --include")
    if backend is not None and backend.name == "compile":
        raise InputError(
            "--ops sees the torch functions of the eager model's Python code, which a compiled "
            "graph fuses away: the ops are the eager ones, so drop --compile to capture them (or "
            "dump a .pt2 from modeltap export with --ops for its graph's nodes)"
        )
    if backend is not None and not getattr(backend, "sees_ops", False):
        raise InputError(
            f"--ops sees the torch functions of the eager model's Python code, which the "
            f"{backend.name} backend does not run; dump the model it came from, or a .pt2 from "
            "modeltap export, with --ops"
        )


@contextmanager
def _ops(run: _Run, recorder: Any) -> Iterator[Any]:
    """`capture.ops.op_capture` for the block when the run asked for ops; yields it or None."""
    if not run.ops:
        yield None
        return
    from modeltap.capture.ops import op_capture

    with op_capture(run.model, run.modules, recorder) as tracer:
        yield tracer


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
    run: _Run,
    spec: GradSpec,
    *,
    activations: bool,
    mask_token_id: int | None,
    special_ids: tuple[int, ...],
) -> Path:
    from modeltap.grads import run_grads

    model, sink = run.model, run.sink
    with (
        sink.writer,
        _offloaded_weights_frozen(model, spec),
        _grads_through(run.backend, model) as after,
    ):
        _write_inputs(sink, run.inputs, run.stored_inputs)
        result = run_grads(
            model,
            run.inputs,
            sink,  # type: ignore[arg-type]
            spec=spec,
            modules=run.modules,
            activations=run.modules if activations else (),
            train_mode=run.train_mode,
            seed=run.seed or 0,
            mask_token_id=mask_token_id,
            special_ids=special_ids,
            ops=run.ops,
        )
        meta = run.metadata_for(
            "activations+gradients" if activations else "gradients",
            result,
            inputs_captured=False,
            backend={},
            after={
                "grad": json.dumps(result.meta),
                **({"ops": json.dumps(result.ops)} if result.ops is not None else {}),
            },
        )
        meta.update(after() if after is not None else {"backend": "eager"})
        return sink.writer.finish(meta)


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
    several GPUs, or the CPU): a `capture.recorder.DumpSink` in front of the writer."""

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

    def graph_stats_options(self) -> dict[str, Any] | None:
        return self.writer.graph_stats_options()
