"""torch.compile backend: hooks that dynamo can trace, naming after the forward.

The eager hook names and flattens each output as the module returns it; inside a compiled graph
that breaks the graph (dynamo cannot trace dict-key iteration in `flatten`), and `fullgraph=True`
fails. Here each hook only appends `(name, output)` to a list, which dynamo turns into extra graph
outputs of one graph; naming, flattening and alias detection happen after the forward, through the
same `Recorder` as eager, so the keys are the eager keys (no `_orig_mod.` prefix: the hooks sit on
the eager modules).

Dynamo ignores hooks added after a module was compiled, so the hooks go on first and the dynamo
caches are reset before compiling. A value the model changes in place after its module returned
(`h += 1`, `ReLU(inplace=True)`) comes back from a compiled graph already changed; when a graph
changes a logged value in place, the capture compiles again with hooks that copy each output.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture.backend import BackendRun
from modeltap.capture.recorder import Captured, MemorySink, Recorder, Sink
from modeltap.errors import InputError, RunError, SelectionError, first_line
from modeltap.selection import ROOT, unknown_name_message

if TYPE_CHECKING:
    from torch import nn

DEFAULT_BACKEND = "inductor"

_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.imatmul,
    operator.setitem,
}


def check_backend(name: str) -> None:
    """A registered torch.compile backend, or an InputError listing the ones there are."""
    import torch

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise InputError(
            f"no torch.compile backend '{name}'; use one of: {', '.join(sorted(known))}"
        )


@dataclass
class CompileInfo:
    """What the compiled run did, for the dump's metadata."""

    backend: str
    fullgraph: bool
    graphs: int = 0
    graph_breaks: int = 0
    copied_outputs: bool = False
    first_call_s: float = 0.0
    run_s: float = 0.0
    unmapped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "compile_backend": self.backend,
            "fullgraph": self.fullgraph,
            "graphs": self.graphs,
            "graph_breaks": self.graph_breaks,
            "copied_outputs": self.copied_outputs,
            "first_call_s": round(self.first_call_s, 3),
            "run_s": round(self.run_s, 4),
        }


@dataclass
class CompiledCapture:
    """A compiled model whose selected modules log `(name, output)`; call `run` for each forward.

    Use as a context manager: the hooks come off and `training` is restored at the end.
    """

    model: nn.Module
    modules: list[str]
    backend: str = DEFAULT_BACKEND
    fullgraph: bool = False
    inputs: bool = False
    train_mode: bool = False
    copy_outputs: bool = False
    log: list[tuple[str, Any, bool]] = field(default_factory=list)
    graphs: list[Any] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    _training: dict[Any, bool] = field(default_factory=dict)
    _compiled: Any = None

    def __enter__(self) -> CompiledCapture:
        import torch

        check_backend(self.backend)
        named = dict((n or ROOT, m) for n, m in self.model.named_modules())
        missing = [n for n in self.modules if n not in named]
        if missing:
            raise SelectionError(unknown_name_message(missing[0], named))
        self._training = {m: m.training for m in named.values()}
        self.model.train(self.train_mode)
        try:
            for name in self.modules:
                module = named[name]
                # The root's hooks run outside the compiled graph, and nothing can change its
                # output after it returned: never copy it (a copy there is a graph of its own).
                copy = self.copy_outputs and module is not self.model
                self._handles.append(module.register_forward_hook(self._output_hook(name, copy)))
                if self.inputs:
                    self._handles.append(
                        module.register_forward_pre_hook(
                            self._input_hook(name, copy), with_kwargs=True
                        )
                    )
            # Compiled code cached for this model's forward (by an earlier compile, or before the
            # hooks changed) would run without our hooks: start from empty caches.
            torch._dynamo.reset()
            self._compiled = torch.compile(
                self.model, backend=self._counting_backend(), fullgraph=self.fullgraph
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        import torch

        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._compiled is not None:
            # compiled code with our hooks inlined must not serve a later compile of this model
            torch._dynamo.reset()
            self._compiled = None
        for module, training in self._training.items():
            if module.training != training:
                module.training = training

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One compiled forward; `self.log` then holds what the hooks saw, in call order."""
        import torch

        self.log.clear()
        try:
            with torch.no_grad():
                return self._compiled(*args, **kwargs)
        except InputError:
            raise
        except Exception as exc:  # dynamo wraps every backend and tracing failure its own way
            hint = (
                "drop --fullgraph, or try --compile-backend aot_eager"
                if self.fullgraph
                else "try --compile-backend aot_eager, or dump without --compile"
            )
            raise RunError(
                f"torch.compile ({self.backend}) failed: {first_line(exc)}; {hint} "
                "(MODELTAP_DEBUG=1 shows the traceback)"
            ) from exc

    def has_inplace(self) -> bool:
        """Whether any graph changes a tensor in place (then logged values may have changed)."""
        return any(_graph_mutates(gm) for gm in self.graphs)

    def _counting_backend(self) -> Callable[..., Any]:
        import torch

        inner = torch._dynamo.lookup_backend(self.backend)

        def backend(gm: Any, example_inputs: Any) -> Any:
            self.graphs.append(gm)
            return inner(gm, example_inputs)

        return backend

    def _output_hook(self, name: str, copy: bool) -> Callable[..., None]:
        log = self.log
        if copy:

            def copying_hook(module: nn.Module, args: Any, output: Any) -> None:
                log.append((name, (output, _copy(output)), False))

            return copying_hook
        if self.copy_outputs:  # the root: a pair like the others, without the copy

            def pair_hook(module: nn.Module, args: Any, output: Any) -> None:
                log.append((name, (output, output), False))

            return pair_hook

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            log.append((name, output, False))

        return hook

    def _input_hook(self, name: str, copy: bool) -> Callable[..., None]:
        log = self.log
        paired = self.copy_outputs  # the root's inputs come as a pair too, without the copy

        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            value = (args, kwargs)
            log.append((name, (value, _copy(value) if copy else value) if paired else value, True))

        return hook


class _Finished:
    """A sink in front of another, for tensors logged by a finished forward: a DumpWriter takes
    them as `final` (read where they are, not copied first)."""

    def __init__(self, sink: Sink) -> None:
        from modeltap.dump import DumpWriter

        self.sink = sink
        self.writer = sink if isinstance(sink, DumpWriter) else None

    def tensor(self, key: str, tensor: Any) -> None:
        if self.writer is not None:
            self.writer.tensor(key, tensor, final=True)
        else:
            self.sink.tensor(key, tensor)

    def alias(self, key: str, target: str) -> None:
        self.sink.alias(key, target)


def record_run(cap: CompiledCapture, sink: Sink) -> Recorder:
    """Name what the last run of `cap` logged into `sink`. The forward is over, so nothing
    changes those tensors any more: a DumpWriter reads them where they are, without copies."""
    recorder = Recorder(_Finished(sink))
    record_log(recorder, cap.log, copied=cap.copy_outputs)
    return recorder


def _copy(value: Any) -> Any:
    import torch
    from torch.utils import _pytree

    return _pytree.tree_map_only(torch.Tensor, torch.clone, value)


def _graph_mutates(gm: Any) -> bool:
    """Whether an in-place op in a dynamo graph may change a graph output (or a view of one)."""
    nodes = list(gm.graph.nodes)
    outputs: set[Any] = set()
    for node in nodes:
        if node.op == "output":
            outputs.update(n for n in node.all_input_nodes)
    for node in nodes:
        if node.op not in ("call_function", "call_method") or not _is_inplace(node):
            continue
        base = node.args[0] if node.args else None
        while base is not None and hasattr(base, "op"):
            if base in outputs:
                return True
            base = base.args[0] if _is_view(base) and base.args else None
    return False


def _op_name(node: Any) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _is_inplace(node: Any) -> bool:
    if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return True
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # and_, or_, not_: `&`, `|`, `not`, nothing in place
    name = _op_name(node)
    return name.endswith("_") and not name.endswith("__")


_VIEW_OPS = {
    "getitem",
    "view",
    "reshape",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "narrow",
    "select",
    "t",
    "flatten",
    "unflatten",
    "as_strided",
    "view_as",
    "chunk",
    "split",
    "unbind",
    "detach",
    "contiguous",
    "__getitem__",
}


def _is_view(node: Any) -> bool:
    return node.op in ("call_function", "call_method") and _op_name(node) in _VIEW_OPS


def record_log(
    recorder: Recorder, log: list[tuple[str, Any, bool]], *, copied: bool = False
) -> None:
    """Name what a deferred-hook backend logged, in order, exactly as the eager hooks would.

    `copied`: each value is (what the module returned, a copy taken as it returned). The copies are
    recorded; two copies of one tensor with equal values become one, so aliases stay aliases.
    """
    import torch
    from torch.utils import _pytree

    copies: dict[int, list[torch.Tensor]] = {}

    def same_copy(original: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        for seen in copies.setdefault(id(original), []):
            if seen.shape == copy.shape and seen.dtype == copy.dtype and torch.equal(seen, copy):
                return seen
        copies[id(original)].append(copy)
        return copy

    for name, value, is_input in log:
        if copied:
            original, copy = value
            leaves = iter(_pytree.tree_leaves(original))

            def pick(copy_leaf: torch.Tensor, leaves: Any = leaves) -> torch.Tensor:
                leaf = next(leaves)
                while not isinstance(leaf, torch.Tensor):
                    leaf = next(leaves)
                return same_copy(leaf, copy_leaf)

            value = _pytree.tree_map_only(torch.Tensor, pick, copy)
        if is_input:
            args, kwargs = value
            value = {**dict(enumerate(args)), **kwargs}
        recorder.record(name, value, is_input=is_input)


def compiled_run(
    model: nn.Module,
    modules: list[str],
    sink: Sink,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    backend: str = DEFAULT_BACKEND,
    fullgraph: bool = False,
    inputs: bool = False,
    train_mode: bool = False,
    seed: int | None = 0,
) -> tuple[Recorder, CompileInfo, Any]:
    """Compile `model` with `modules` hooked, run it twice (compile, then the timed run) and name
    what the second run logged into `sink`. In-place ops in a graph make it compile again with
    copying hooks."""
    import torch

    info = CompileInfo(backend, fullgraph)
    copy = False
    while True:
        with CompiledCapture(
            model,
            modules,
            backend=backend,
            fullgraph=fullgraph,
            inputs=inputs,
            train_mode=train_mode,
            copy_outputs=copy,
        ) as cap:
            with torch.random.fork_rng(devices=[]):
                if seed is not None:
                    torch.manual_seed(seed)
                start = time.perf_counter()
                cap.run(args, kwargs)
                info.first_call_s += time.perf_counter() - start
            if not copy and cap.has_inplace():
                copy = True
                continue
            with torch.random.fork_rng(devices=[]):
                if seed is not None:
                    torch.manual_seed(seed)
                start = time.perf_counter()
                output = cap.run(args, kwargs)
                info.run_s = time.perf_counter() - start
            info.graphs = len(cap.graphs)
            info.graph_breaks = max(0, info.graphs - 1)
            info.copied_outputs = copy
            fired = {name for name, _, _ in cap.log}
            info.unmapped = [m for m in modules if m not in fired]
            break
    # after the compiled capture's hooks came off: this runs the eager model
    renumber_like_eager(cap, model, args, kwargs, train_mode=train_mode, seed=seed)
    return record_run(cap, sink), info, output


def renumber_like_eager(
    cap: CompiledCapture,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    train_mode: bool,
    seed: int | None,
) -> list[str]:
    """Give each repeated call in `cap.log` the number it has in the eager forward, where the
    compiled run made the calls in another order (see capture/order.py); returns the modules
    renumbered."""
    from modeltap.capture.order import eager_calls, matching, tensor_leaves

    outputs: dict[str, list[int]] = {}
    inputs: dict[str, list[int]] = {}
    for i, (name, _, is_input) in enumerate(cap.log):
        (inputs if is_input else outputs).setdefault(name, []).append(i)
    repeated = [name for name, at in outputs.items() if len(at) > 1]
    if not repeated:
        return []
    eager = eager_calls(model, repeated, args, kwargs, train_mode=train_mode, seed=seed)
    renumbered = []
    for name in repeated:
        at = outputs[name]
        # with copying hooks, a value is (what the module returned, its copy as it returned)
        got = [tensor_leaves(cap.log[i][1][1] if cap.copy_outputs else cap.log[i][1]) for i in at]
        numbers = matching(got, eager[name])
        if numbers is None or numbers == sorted(numbers):
            continue
        for entries in (at, inputs.get(name, [])):
            if len(entries) == len(at):  # the k-th call's inputs go with its output
                logged = [cap.log[i] for i in entries]
                for entry, number in zip(logged, numbers, strict=True):
                    cap.log[entries[number]] = entry
        renumbered.append(name)
    return renumbered


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
    """`run.dump_model(..., backend=CompileBackend("inductor"))`: dump through torch.compile."""

    backend: str = DEFAULT_BACKEND
    fullgraph: bool = False
    name: str = "compile"

    def around_grads(self, model: nn.Module) -> Any:
        """The gradient run goes through `compiled_forward` (see there)."""
        return compiled_forward(model, self.backend)

    def run(
        self,
        model: nn.Module,
        modules: list[str],
        sink: Sink,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        inputs: bool,
        train_mode: bool,
        seed: int | None,
    ) -> BackendRun:
        recorder, info, output = compiled_run(
            model,
            modules,
            sink,
            args,
            kwargs,
            backend=self.backend,
            fullgraph=self.fullgraph,
            inputs=inputs,
            train_mode=train_mode,
            seed=seed,
        )
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
