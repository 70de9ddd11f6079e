"""torch.compile backend: `compile_capture` (the library's capture through torch.compile) and
`CompileBackend` (the dump's), over `compile_log` (hooks that log inside the graph, named after the
forward) and `compile_stats` (a stats-only dump's statistics computed in the graph itself).
`compiled_forward` compiles a model's forward for runs whose hooks act during it (gradients)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modeltap.capture.backend import BackendRun, RunRequest
from modeltap.capture.compile_log import DEFAULT_BACKEND, CompileInfo, check_backend, compiled_run
from modeltap.capture.compile_stats import NotInGraph, graph_stats_run
from modeltap.capture.recorder import Captured, DumpSink, MemorySink
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "DEFAULT_BACKEND",
    "CompileBackend",
    "CompileInfo",
    "check_backend",
    "compile_capture",
    "compiled_forward",
]


def compile_capture(
    model: nn.Module,
    *args: Any,
    modules: list[str] | None = None,
    backend: str = DEFAULT_BACKEND,
    fullgraph: bool = False,
    inputs: bool = False,
    seed: int | None = 0,
    **kwargs: Any,
) -> tuple[Captured, CompileInfo]:
    """`capture` through torch.compile: the same keys as eager, values from the compiled graph."""
    names = modules if modules is not None else [n or ROOT for n, _ in model.named_modules()]
    sink = MemorySink()
    recorder, info, output = compiled_run(
        model,
        names,
        sink,
        args,
        kwargs,
        backend=backend,
        fullgraph=fullgraph,
        inputs=inputs,
        seed=seed,
    )
    captured = Captured(sink.tensors, recorder.aliases, recorder.order, recorder.skipped, output)
    return captured, info


@dataclass
class CompileBackend:
    """`dumping.dump_model(..., backend=CompileBackend("inductor"))`: dump through torch.compile."""

    backend: str = DEFAULT_BACKEND
    fullgraph: bool = False
    name: str = "compile"

    def around_grads(self, model: nn.Module) -> Any:
        """The gradient run goes through `compiled_forward` (see there)."""
        return compiled_forward(model, self.backend)

    def run(self, request: RunRequest) -> BackendRun:
        model, modules, sink, args, kwargs = request.call
        options = {
            "backend": self.backend,
            "fullgraph": self.fullgraph,
            "inputs": request.inputs,
            "train_mode": request.train_mode,
            "seed": request.seed,
        }
        in_graph = sink.graph_stats_options() if isinstance(sink, DumpSink) else None
        reason = ""
        if in_graph is not None:  # a stats-only dump: the statistics can come from the graph
            try:
                recorder, info, output = graph_stats_run(
                    model, modules, sink, args, kwargs, **in_graph, **options
                )
            except NotInGraph as exc:
                reason = str(exc)
            else:
                info.statistics = "in the graph"
                return BackendRun(recorder, info.as_dict(), info.unmapped, output)
        recorder, info, output = compiled_run(model, modules, sink, args, kwargs, **options)
        if reason:
            info.statistics = f"after the forward: {reason}"
        return BackendRun(recorder, info.as_dict(), info.unmapped, output)


@contextmanager
def compiled_forward(model: nn.Module, backend: str = DEFAULT_BACKEND) -> Iterator[CompileInfo]:
    """`model.forward` compiled for the block, for runs whose hooks must act during the forward
    (gradients: the eager hooks break the graph at each hooked module, and the graphs between
    them run compiled). The info's graph count says how far the forward was split."""
    import torch

    check_backend(backend)
    info = CompileInfo(backend, fullgraph=False)
    inner = torch._dynamo.lookup_backend(backend)

    def counting(gm: Any, example_inputs: Any) -> Any:
        info.graphs += 1
        info.graph_breaks = info.graphs - 1
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=counting)  # type: ignore[method-assign]
    try:
        yield info
    finally:
        del model.forward  # the class's forward again
        torch._dynamo.reset()
