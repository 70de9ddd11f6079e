"""Eager backend: forward hooks on the selected modules, always taken off again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from modeltap.capture.recorder import Captured, MemorySink, Recorder, Sink
from modeltap.errors import RunError, SelectionError, first_line
from modeltap.selection import ROOT, unknown_name_message

if TYPE_CHECKING:
    from torch import nn


@contextmanager
def hooks(
    model: nn.Module,
    modules: list[str] | None,
    sink: Sink,
    *,
    inputs: bool = False,
    train_mode: bool = False,
    replace: Callable[[str, Any], Any] | None = None,
    deferred: bool = False,
) -> Iterator[Recorder]:
    """Hook `modules` (display names; None: every module) of `model` for the duration of the
    block.

    The model is put in eval mode (unless `train_mode`) and every hook is removed and `training`
    restored in `finally`, so a model that went through here behaves exactly as before.
    `replace(name, output)`, when given, may return a new output for the model to go on with (the
    gradient run uses it to start a gradient path at frozen modules); None keeps the output.
    `deferred` hooks only keep each output and its version; call `recorder.drain()` after the
    forward to name them and feed the sink (for a sink that keeps every tensor anyway).
    """
    named = list(model.named_modules())
    by_name = {(n or ROOT): m for n, m in named}
    if modules is None:  # every module
        modules = list(by_name)
    missing = [n for n in modules if n not in by_name]
    if missing:
        raise SelectionError(unknown_name_message(missing[0], by_name))
    recorder = Recorder(sink)
    handles = []
    # Only touch `training` when some module differs: Module.__setattr__ is slow enough to show
    # on small models, and a model already in the right mode needs nothing.
    was_training = {m: m.training for _, m in named if m.training != train_mode}
    try:
        if was_training:
            model.train(train_mode)
        for name in modules:
            module = by_name[name]
            handles.append(
                module.register_forward_hook(_output_hook(recorder, name, replace, deferred))
            )
            if inputs:
                handles.append(
                    module.register_forward_pre_hook(
                        _input_hook(recorder, name, deferred), with_kwargs=True
                    )
                )
        yield recorder
    finally:
        for handle in handles:
            handle.remove()
        for _, module in named:
            # train() may be overridden to leave some modules alone: restore each one as it was.
            training = was_training.get(module, train_mode)
            if module.training != training:
                module.training = training


def _output_hook(
    recorder: Recorder,
    name: str,
    replace: Callable[[str, Any], Any] | None = None,
    deferred: bool = False,
) -> Callable[..., Any]:
    if deferred and replace is None:
        defer = recorder.defer

        def deferred_hook(module: nn.Module, args: Any, output: Any) -> None:
            defer(name, output)

        return deferred_hook
    if replace is None:

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            recorder.record(name, output)

        return hook

    def replacing_hook(module: nn.Module, args: Any, output: Any) -> Any:
        new = replace(name, output)
        recorder.record(name, output if new is None else new)
        return new

    return replacing_hook


def _input_hook(recorder: Recorder, name: str, deferred: bool = False) -> Callable[..., None]:
    take = recorder.defer if deferred else recorder.record

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        take(name, {**dict(enumerate(args)), **kwargs}, is_input=True)

    return hook


def run_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call the model; a failure inside it becomes a RunError naming the model and the cause."""
    try:
        return model(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunError(
            f"{type(model).__name__}.forward failed: {first}; check the inputs' names, shapes "
            "and dtypes (MODELTAP_DEBUG=1 shows the traceback)"
        ) from exc


def backward_error(model: nn.Module, exc: BaseException, *, train_mode: bool) -> RunError:
    """A failure inside the model's backward, as one line with the fix when one is known."""
    name = type(model).__name__
    cause = first_line(exc).split(" Hint:")[0]  # torch's hint names torch calls, not our options
    debug = "(MODELTAP_DEBUG=1 shows the traceback)"
    if "modified by an inplace operation" in cause:
        fix = (
            "RWKV does so to its state cache in eval mode only: run with --train-mode "
            "(RWKV has no dropout; its values stay the same)"
            if not train_mode
            else "modeltap can't take gradients through it"
        )
        return RunError(
            f"{name}'s backward failed: the forward overwrote in place a tensor the backward "
            f"needs; {fix} {debug}"
        )
    if "model.train()" in cause or "training mode" in cause:
        # Reformer's reversible layers recompute their activations in the backward, which they
        # allow in training mode only.
        return RunError(
            f"{name}'s backward failed: it runs only in training mode (reversible layers, as in "
            f"Reformer); run with --train-mode (train_mode=True from Python) {debug}"
        )
    return RunError(f"{name}'s backward failed: {cause} {debug}")


def capture(
    model: nn.Module,
    *args: Any,
    modules: list[str] | None = None,
    inputs: bool = False,
    train_mode: bool = False,
    seed: int | None = None,
    **kwargs: Any,
) -> Captured:
    """Run `model(*args, **kwargs)` under no_grad and return every selected module's output.

    `modules` are display names (see `selection.select_modules`); default all modules.
    """
    import torch

    def once(copy_keys: frozenset[str] | None) -> tuple[MemorySink, Recorder, Any]:
        # First with hooks that only keep each output (naming after the forward); if the model
        # changed some in place after their module returned, again, copying those as they return.
        sink = MemorySink(copy_keys or frozenset())
        if seed is not None:
            torch.manual_seed(seed)
        else:
            torch.set_rng_state(rng)
        options = {"inputs": inputs, "train_mode": train_mode, "deferred": copy_keys is None}
        with hooks(model, modules, sink, **options) as recorder:
            with torch.no_grad():
                output = run_model(model, args, kwargs)
        recorder.drain()
        return sink, recorder, output

    with torch.random.fork_rng(devices=[]):
        rng = torch.get_rng_state()
        sink, recorder, output = once(None)
        changed = frozenset(recorder.changed)
        if changed:
            sink, recorder, output = once(changed)
    return Captured(sink.tensors, recorder.aliases, recorder.order, recorder.skipped, output)


@contextmanager
def model_mode(model: nn.Module, train_mode: bool) -> Iterator[None]:
    """`model` in training (or eval) mode for the block, each module's own mode restored after.

    The backward of a gradient run needs it too: reversible layers recompute their forward then.
    """
    named = [m for _, m in model.named_modules()]
    was = {m: m.training for m in named if m.training != train_mode}
    try:
        if was:
            model.train(train_mode)
        yield
    finally:
        for module in named:
            training = was.get(module, train_mode)
            if module.training != training:
                module.training = training
