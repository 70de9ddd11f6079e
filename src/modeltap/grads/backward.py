"""Gradients of one module output (or a loss) w.r.t. the outputs of many modules, in one backward.

How: the forward runs with grad enabled and the selected modules hooked. Each selected float
output that is part of the autograd graph gets a tensor hook, and one `torch.autograd.grad` call
from the target asks for the gradients of every graph leaf (trainable parameters, and the leaves
started at frozen modules). The backward pass then runs through every node upstream of the
target once; each tensor hook streams its gradient to the dump as it is computed, so gradients are
never all held at once, and a selected tensor whose hook never fires has no path to the target.

`autograd.grad` never touches `.grad`: the user's parameters come out as they went in.
Tensor hooks receive the gradient w.r.t. the value the module returned, even when the model later
changes that tensor in place.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture import flatten, make_key, split_key
from modeltap.capture.keys import op_owner
from modeltap.dump import GRAD_PREFIX
from modeltap.errors import InputError, SelectionError
from modeltap.grads.jacobian import jacobian_norms
from modeltap.grads.losses import check_causal, lm_loss, mask_for_mlm, mlm_loss
from modeltap.grads.spec import GradSpec, seed_tensor
from modeltap.selection import ROOT, unknown_name_message

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.dump import DumpWriter



@dataclass
class GradRun:
    meta: dict[str, Any]
    order: list[str]  # activations in execution order, then gradients in backward order
    skipped: dict[str, str]
    skipped_none: int
    ops: dict[str, Any] | None = None  # with ops: each op's metadata (capture/ops.py)



@dataclass
class _GradSink:
    """Receives the forward's outputs: writes activations if asked, hooks tensors for gradients."""

    writer: DumpWriter
    activations: set[str]  # modules whose outputs are written as activations
    wrt: Callable[[str], bool]  # keys that get gradients
    target: str | None
    keep: bool  # keep references to the wrt tensors (for the Jacobian probes)
    candidates: list[str] = field(default_factory=list)  # wrt keys in forward order
    hooked: dict[str, torch.Tensor] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    no_path: dict[str, str] = field(default_factory=dict)
    grad_aliases: dict[str, str] = field(default_factory=dict)
    y: torch.Tensor | None = None
    # Where each hooked tensor meets the graph: asking autograd for these rather than for the
    # parameters skips every weight gradient nobody stores (without keeping the tensors alive).
    edges: list[Any] = field(default_factory=list)
    live: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seen: dict[str, weakref.ref[Any]] = field(default_factory=dict)

    def stores(self, key: str) -> bool:
        """Whether `key`'s value is written: an activation asked for, or an op's output (an
        op's value comes with its gradient; the writer copies it before a later in-place op)."""
        return op_owner(key) is not None or split_key(key)[0] in self.activations

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        if self.stores(key):
            self.writer.tensor(key, tensor.detach())
        if key == self.target:
            self.y = tensor
        self._seen[key] = weakref.ref(tensor)
        if not self.wrt(key):
            return
        self.candidates.append(key)
        if not tensor.is_floating_point() and not tensor.is_complex():
            self.no_path[key] = f"{str(tensor.dtype).removeprefix('torch.')}, not float"
        elif not tensor.requires_grad:
            self.no_path[key] = "no path"
        else:
            import torch

            tensor.register_hook(self._writer_hook(key))
            self.edges.append(torch.autograd.graph.get_gradient_edge(tensor))
            self.hooked[key] = tensor if self.keep else None  # type: ignore[assignment]

    def alias(self, key: str, target: str) -> None:
        if self.stores(key):
            self.writer.alias(key, target)
        if key == self.target:
            self.y = self._seen[target]()
        if self.wrt(key):
            self.candidates.append(key)
            self.grad_aliases[key] = target

    def _writer_hook(self, key: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.live:
                with self._lock:
                    self.writer.tensor(GRAD_PREFIX + key, grad.detach(), count_zeros=True)
                    self.written.append(key)

        return hook



def run_grads(
    model: nn.Module,
    inputs: Any,
    writer: DumpWriter,
    *,
    spec: GradSpec,
    modules: Sequence[str],
    activations: Sequence[str] = (),
    train_mode: bool = False,
    seed: int = 0,
    mask_token_id: int | None = None,
    special_ids: Sequence[int] = (),
    ops: bool = False,
) -> GradRun:
    """Run forward and one backward, streaming gradients (and `activations`) to `writer`.

    `modules` are the selected display names; gradients are taken w.r.t. their outputs, or only
    w.r.t. `spec.wrt` when given. Returns the `grad` metadata (target, loss, seed, no-path keys,
    Jacobian-norm estimates) and the file's key order. Raises InputError or SelectionError for
    what the user must fix.
    `ops`: inside each module that gets gradients, every op its own code runs (capture/ops.py):
    the op's output (`module/opNN.name`) and the gradient w.r.t. it (`grad/module/opNN.name`).
    """
    import torch

    spec.check()
    by_name = {(n or ROOT): m for n, m in model.named_modules()}
    wrt_inputs = [w for w in spec.wrt if w not in by_name and w in inputs.kwargs]
    wrt_modules, wrt_keys = _wrt_sets(
        [w for w in spec.wrt if w not in wrt_inputs], modules, by_name, only_inputs=bool(wrt_inputs)
    )
    hooked = set(wrt_modules) | set(activations) | _target_module(spec, by_name)
    args = inputs.args
    generator = torch.Generator().manual_seed(seed)
    kwargs, labels, loss_info = _loss_inputs(
        model, spec, dict(inputs.kwargs), mask_token_id, special_ids, generator
    )

    def wanted(key: str) -> bool:
        module = _module_of(key)
        return module in wrt_modules and (not wrt_keys or _key_matches(key, wrt_keys))

    sink = _GradSink(
        writer, set(activations), wanted, target=spec.target, keep=spec.jacobian_norm > 0
    )
    frozen = _params_to_enable(model, modules) if spec.params else []
    for name in wrt_inputs:
        kwargs[name] = _input_leaf(name, kwargs[name], sink)
    try:
        for p in frozen:
            p.requires_grad_(True)
        traced = _op_modules(ops, wrt_modules, by_name)
        output, recorder, leaves, op_meta = _forward(
            model, args, kwargs, sink, hooked, wrt_modules, by_name, train_mode, seed, traced
        )
        y, target_key = _target(spec, sink, output, recorder, model, kwargs, labels, loss_info)
        v = seed_tensor(spec.grad_output, y, generator) if y.dim() else torch.ones_like(y)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        results = _backward(model, y, v, spec, sink, [p for _, p in params] + leaves, train_mode)
        param_keys = _collect(writer, sink, target_key, spec, modules, by_name, params, results)
        del results
        jacobian = _jacobian(y, spec, sink, target_key, generator) if spec.jacobian_norm else {}
    finally:
        for p in frozen:
            p.requires_grad_(False)
    order = [k for k in recorder.order if sink.stores(k)]
    order += [GRAD_PREFIX + k for k in sink.written]
    order += [GRAD_PREFIX + k for k in sink.grad_aliases if k not in sink.no_path]
    order += [GRAD_PREFIX + k for k in param_keys]
    meta = {
        "target": target_key,
        "loss": None if spec.target else spec.loss,
        **({"loss_info": loss_info} if loss_info else {}),
        "grad_output": spec.grad_output if y.dim() else "scalar",
        "seed": seed,
        **_keys_meta(spec, sink, param_keys),
        **({"jacobian": jacobian} if jacobian else {}),
    }
    return GradRun(meta, order, recorder.skipped, recorder.skipped_none, op_meta)


def _keys_meta(spec: GradSpec, sink: _GradSink, param_keys: list[str]) -> dict[str, Any]:
    """The `grad` metadata's keys: asked for, taken, without a path, and the thresholds."""
    return {
        "wrt": list(spec.wrt),
        "keys": [*sink.candidates, *param_keys],
        "params": param_keys,
        "no_path": sink.no_path,
        "vanishing": spec.vanishing,
        "exploding": spec.exploding,
    }


def _op_modules(ops: bool, wrt_modules: set[str], by_name: dict[str, nn.Module]) -> list[str]:
    """With `ops`, the modules whose own ops are traced: those that get gradients, in the
    model's order; none is an InputError."""
    if not ops:
        return []
    if not wrt_modules:
        raise InputError("--ops: no module gets gradients; widen --depth, --include or --wrt")
    return [name for name in by_name if name in wrt_modules]


def _jacobian(
    y: torch.Tensor, spec: GradSpec, sink: _GradSink, target_key: str, generator: torch.Generator
) -> dict[str, Any]:
    """Norm estimates of the Jacobian of the target w.r.t. each output the backward reached."""
    reached = set(sink.written) - {target_key}
    xs = [k for k in sink.candidates if k in sink.hooked and k in reached]
    estimates = jacobian_norms(
        y, [sink.hooked[k] for k in xs], spec.jacobian_norm, spec.probes, generator
    )
    return {k: e.to_json() for k, e in zip(xs, estimates, strict=True)}


def _loss_inputs(
    model: nn.Module,
    spec: GradSpec,
    kwargs: dict[str, Any],
    mask_token_id: int | None,
    special_ids: Sequence[int],
    generator: torch.Generator,
) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """The keyword inputs, labels and loss details for `--loss` without a target: lm checks the
    model is causal, mlm masks tokens (BERT's way) and labels them."""
    if spec.target is None and spec.loss == "lm":
        check_causal(model)
    if spec.target is None and spec.loss == "mlm":
        return mask_for_mlm(model, kwargs, mask_token_id, special_ids, generator)
    return kwargs, None, {}


def _target_module(spec: GradSpec, by_name: dict[str, nn.Module]) -> set[str]:
    """The module whose output `--target` names (checked), hooked as the others are."""
    if spec.target is None:
        return set()
    target_module = split_key(spec.target)[0]
    if target_module not in by_name:
        raise SelectionError("--target: " + unknown_name_message(target_module, by_name))
    return {target_module}


def _forward(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any],
    sink: _GradSink,
    hooked: set[str],
    wrt_modules: Sequence[str],
    by_name: dict[str, nn.Module],
    train_mode: bool,
    seed: int,
    traced: list[str],
) -> tuple[Any, Any, list[torch.Tensor], dict[str, Any] | None]:
    """The forward with grad enabled and the modules hooked: (output, recorder, new leaves, the
    ops' metadata when the ops of `traced` are recorded too)."""
    import torch

    from modeltap.capture import hooks, run_model
    from modeltap.capture.ops import op_capture

    leaves: list[torch.Tensor] = []

    def start_path(name: str, output: Any) -> Any:
        # A frozen module's output is not in the graph: make it a leaf so gradients can reach it.
        if (
            name in wrt_modules
            and isinstance(output, torch.Tensor)
            and output.is_floating_point()
            and not output.requires_grad
        ):
            leaf = output.detach().requires_grad_()
            leaves.append(leaf)
            return leaf
        return None

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        position = {name: i for i, name in enumerate(by_name)}
        names = sorted(hooked, key=position.__getitem__)
        with (
            hooks(model, names, sink, train_mode=train_mode, replace=start_path) as recorder,
            torch.enable_grad(),
            op_capture(model, traced, recorder) if traced else contextlib.nullcontext() as tracer,
        ):
            output = run_model(model, args, kwargs)
    return output, recorder, leaves, None if tracer is None else tracer.meta


def _target(
    spec: GradSpec,
    sink: _GradSink,
    output: Any,
    recorder: Any,
    model: nn.Module,
    kwargs: dict[str, Any],
    labels: Any,
    loss_info: dict[str, Any],
) -> tuple[torch.Tensor, str]:
    """(y, its key): the target output, or the whole model's loss; checked to take gradients.
    A loss adds what it knows of itself to `loss_info`."""
    y, target_key = _pick_target(spec, sink, output, recorder, model)
    if spec.target is None and spec.loss == "lm":
        y, info = lm_loss(output, kwargs)
        loss_info.update(info)
        target_key = "loss:lm"
    elif spec.target is None and spec.loss == "mlm":
        y = mlm_loss(output, labels)
        loss_info["value"] = float(y.detach())
        target_key = "loss:mlm"
    if not y.is_floating_point():
        raise InputError(
            f"the target '{target_key}' is {str(y.dtype).removeprefix('torch.')}, not float; "
            "pick a float output (e.g. a hidden state or logits)"
        )
    if not y.requires_grad:
        raise InputError(
            f"no gradient path: '{target_key}' does not depend on anything that takes "
            "gradients; pick a later --target, or --wrt modules upstream of it"
        )
    return y, target_key


def _backward(
    model: nn.Module,
    y: torch.Tensor,
    v: torch.Tensor,
    spec: GradSpec,
    sink: _GradSink,
    wrt: list[torch.Tensor],
    train_mode: bool,
) -> Sequence[Any]:
    """One backward from y (seeded with v); the hooks stream what they see. Returns the
    gradients of `wrt` (parameters, then new leaves), or nothing when parameters are not asked."""
    import torch

    from modeltap.capture.eager import backward_error, model_mode

    try:
        with model_mode(model, train_mode):
            if not spec.params and sink.edges:
                # Only down to the hooked tensors: the same hooks fire, no weight gradient is
                # computed, and nothing is held but what the hooks stream away.
                torch.autograd.backward(
                    y, v, retain_graph=spec.jacobian_norm > 0, inputs=list(sink.edges)
                )
                return ()
            return torch.autograd.grad(
                y,
                wrt,
                grad_outputs=v,
                allow_unused=True,
                retain_graph=spec.jacobian_norm > 0,
            )
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as exc:
        raise backward_error(model, exc, train_mode=train_mode) from exc
    finally:
        sink.live = False


def _collect(
    writer: DumpWriter,
    sink: _GradSink,
    target_key: str,
    spec: GradSpec,
    modules: Sequence[str],
    by_name: dict[str, nn.Module],
    params: list[tuple[str, torch.nn.Parameter]],
    results: Sequence[Any],
) -> list[str]:
    """After the backward: what had no path, the aliases' gradients, and the selected modules'
    parameter gradients written; returns those parameters' names."""
    reached = set(sink.written)
    for key in sink.hooked:
        if key not in reached:
            sink.no_path[key] = "no path"
    for key, stored in sink.grad_aliases.items():
        if stored in reached:
            writer.alias(GRAD_PREFIX + key, GRAD_PREFIX + stored)
        else:
            sink.no_path[key] = sink.no_path.get(stored, "no path")
    if not reached - {target_key}:
        raise InputError(
            f"no gradient path from '{target_key}' to any selected module; select modules "
            "upstream of it (--wrt, --include, --depth)"
        )
    param_keys: list[str] = []
    if spec.params:
        selected_ids = {id(p) for name in modules for p in by_name[name].parameters()}
        for (name, p), g in zip(params, results, strict=False):
            if id(p) not in selected_ids:
                continue
            if g is None:
                sink.no_path[name] = "no path"
            else:
                writer.tensor(GRAD_PREFIX + name, g, count_zeros=True)
                param_keys.append(name)
    return param_keys


def _input_leaf(name: str, value: Any, sink: _GradSink) -> torch.Tensor:
    """A float input of forward (`pixel_values`, `input_features`) as a leaf whose gradient is
    stored as `grad/inputs/NAME`: the gradient w.r.t. the processor's output (saliency)."""
    from modeltap.dump.format import INPUTS_PREFIX

    if not value.is_floating_point():
        raise InputError(
            f"--wrt {name}: {str(value.dtype).removeprefix('torch.')} inputs take no gradient; "
            "ask for the embeddings module's output instead (e.g. --wrt embeddings)"
        )
    import torch

    leaf = value.detach().clone().requires_grad_()
    key = INPUTS_PREFIX + name
    sink.candidates.append(key)
    leaf.register_hook(sink._writer_hook(key))
    sink.edges.append(torch.autograd.graph.get_gradient_edge(leaf))
    sink.hooked[key] = leaf if sink.keep else None  # type: ignore[assignment]
    return leaf



def _wrt_sets(
    wrt: Sequence[str],
    modules: Sequence[str],
    by_name: dict[str, Any],
    *,
    only_inputs: bool = False,
) -> tuple[set[str], set[str]]:
    """(modules to hook for gradients, exact keys asked for, empty when whole modules);
    `only_inputs`: --wrt named inputs of forward alone, so no module gets gradients."""
    if not wrt:
        return (set(), set()) if only_inputs else (set(modules), set())
    names, keys = set(), set()
    for item in wrt:
        module = _module_of(item)
        if module not in by_name:
            raise SelectionError("--wrt: " + unknown_name_message(module, by_name))
        names.add(module)
        keys.add(item)
    return names, keys



def _key_matches(key: str, asked: set[str]) -> bool:
    """A whole-module name asks for all its keys (its ops' too); `module:part`, `module@N` or
    `module/opNN.name` for that one."""
    return key in asked or _module_of(key) in asked


def _module_of(key: str) -> str:
    """The module a key belongs to: an op's (`m@1/op03.mul`) is the module whose code ran it."""
    owner = op_owner(key)
    return split_key(key if owner is None else owner)[0]



def _pick_target(
    spec: GradSpec, sink: _GradSink, output: Any, recorder: Any, model: nn.Module
) -> tuple[torch.Tensor, str]:
    """The target tensor and its key; for a whole-model loss, the model's main output."""
    import torch

    if spec.target is None:
        leaves = [(p, t) for p, t in flatten(output) if isinstance(t, torch.Tensor)]
        if not leaves:
            raise InputError(f"{type(model).__name__} returned no tensor to take gradients of")
        path, y = leaves[0]
        return y, make_key(ROOT, 0, path)
    if sink.y is not None:
        return sink.y, spec.target
    module = split_key(spec.target)[0]
    parts = [k for k in recorder.order if split_key(k)[0] == module]
    if not parts:
        raise InputError(
            f"--target '{spec.target}': the module did not run in this forward (or returned no "
            "tensor); pick one that does (`modeltap dump` shows which ran)"
        )
    raise InputError(
        f"--target '{spec.target}' names no single tensor; pick one of "
        + ", ".join(parts[:6])
        + (" ..." if len(parts) > 6 else "")
    )



def _params_to_enable(model: nn.Module, modules: Sequence[str]) -> list[torch.nn.Parameter]:
    """Frozen parameters of the selected modules, to unfreeze for the run (--params)."""
    by_name = {(n or ROOT): m for n, m in model.named_modules()}
    seen: dict[int, Any] = {}
    for name in modules:
        for p in by_name[name].parameters():
            if not p.requires_grad and p.is_floating_point():
                seen[id(p)] = p
    return list(seen.values())
