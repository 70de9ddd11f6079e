"""`record(..., ops=True)`, a part of `Recording` (record.recording): on a recorded step, every op
the selected modules' own code runs in a training forward (capture/ops.py's `OpTracer`), written
to the step's file as module outputs are (keys `module/opNN.name`, with their gradients as
`grad/module/opNN.name` when `grads`), and the `ops` metadata.

Nothing of it exists on a step that is not recorded: the module hooks that tell the tracer which
module runs are registered when a recorded step begins and removed when it ends (between
forwards), and the `TorchFunctionMode` is pushed by the root's pre-hook of each training forward
of a recorded step and popped by its post-hook (`always_call`, so a forward that raises pops it
too). The mode lives within one forward, so the user's own modes (`with torch.device(...)`)
nest around it as they would around any call. One tracer serves the step, so a second forward's
ops are keyed `module@1/opNN.name`, as its module outputs are `module@1`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from modeltap.capture.ops import OpTracer


def check_ops_model(model: nn.Module) -> None:
    """ops=True needs the eager model running its own Python code: a torch.compile'd one runs
    a graph (the ops seen would be dynamo's tracing, not the model's calls)."""
    from modeltap.errors import InputError

    compiled = type(model).__name__ == "OptimizedModule" or (
        getattr(model, "_compiled_call_impl", None) is not None
    )
    if compiled:
        raise InputError(
            "ops=True sees the torch functions of the eager model's Python code, which a "
            "torch.compile'd model does not run; record the module before compiling it "
            "(model._orig_mod), or drop ops"
        )


class StepOps:
    """The op tracing of recorded steps (`Recording`'s state: `_op_tracer`, `_op_mode`,
    `_op_handles`)."""

    _op_tracer: OpTracer | None = None
    _op_mode: Any = None
    _op_handles: list[Any]

    def _root_op_hooks(self, root: nn.Module) -> list[Any]:
        """The root's hooks that push and pop the mode (registered for the whole recording)."""
        return [
            root.register_forward_pre_hook(self._ops_before_forward),
            root.register_forward_hook(self._ops_after_forward, always_call=True),
        ]

    def _start_ops(self) -> None:
        """A recorded step begins: its tracer, and the hooks that tell it which module runs."""
        from modeltap.capture.ops import OpTracer

        assert self._recorder is not None  # type: ignore[attr-defined]
        tracer = OpTracer(self._recorder)  # type: ignore[attr-defined]
        self._op_tracer = tracer
        by_name = self._by_name  # type: ignore[attr-defined]
        for name in self._modules:  # type: ignore[attr-defined]
            module = by_name[name]
            self._op_handles.append(module.register_forward_pre_hook(self._op_enter(name)))
            self._op_handles.append(module.register_forward_hook(self._op_leave, prepend=True))

    def _stop_ops(self) -> None:
        """The step is over (or the recording): its hooks off, the mode popped if a forward
        left it on."""
        for handle in self._op_handles:
            handle.remove()
        self._op_handles = []
        self._pop_op_mode()
        self._op_tracer = None

    def _ops_meta(self) -> dict[str, str]:
        """The step file's `ops` metadata (none without ops)."""
        tracer = self._op_tracer
        return {} if tracer is None else {"ops": json.dumps(tracer.meta)}

    def _ops_before_forward(self, module: nn.Module, args: Any) -> None:
        import torch

        tracer = self._op_tracer
        if tracer is None or not (module.training and torch.is_grad_enabled()):
            return  # not a recorded step, or an evaluation forward: no mode
        from torch.overrides import TorchFunctionMode

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                return tracer.call(func, args, kwargs or {})

        self._pop_op_mode()
        tracer.stack.clear()
        mode = _Mode()
        mode.__enter__()
        self._op_mode = mode

    def _ops_after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._pop_op_mode()

    def _pop_op_mode(self) -> None:
        mode, self._op_mode = self._op_mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def _op_enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._op_mode is not None:
                self._op_tracer.enter(name)  # type: ignore[union-attr]

        return hook

    def _op_leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._op_mode is not None:
            self._op_tracer.leave()  # type: ignore[union-attr]
