"""torch.compile capture: hooks that dynamo can trace, naming after the forward (`compile.py` is
the backend over it).

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

Across a graph break the change happens later, in eager code or in a later graph that takes the
value as an input (and bumps its version counter). The first run stamps each logged tensor with its
version where it left the graph that logged it (or entered it, for a graph's own input: never later
than its module returned); a tensor whose version moved by the end of the forward was changed after
its module returned, and the capture compiles again with copying hooks on just those modules. A
forward of one graph skips the stamps after that first run.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture.order import renumber_like_eager
from modeltap.capture.recorder import DumpSink, Recorder, Sink
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
    # modules whose logged value a later graph or eager code changed in place (their hooks copy)
    changed_after_return: list[str] = field(default_factory=list)
    first_call_s: float = 0.0
    run_s: float = 0.0
    unmapped: list[str] = field(default_factory=list)
    # stats-only dumps: "in the graph", or why they were taken after the forward
    statistics: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "compile_backend": self.backend,
            "fullgraph": self.fullgraph,
            "graphs": self.graphs,
            "graph_breaks": self.graph_breaks,
            "copied_outputs": self.copied_outputs,
            "changed_after_return": self.changed_after_return,
            "first_call_s": round(self.first_call_s, 3),
            "run_s": round(self.run_s, 4),
            **({"statistics": self.statistics} if self.statistics else {}),
        }


@dataclass
class CompiledCapture:
    """A compiled model whose selected modules log `(name, output)`; call `run` for each forward.

    Use as a context manager: the hooks come off and `training` is restored at the end.
    `copy`: the modules whose hooks log a copy of the value besides the value (entries are then
    `(value, copy)` pairs). `watch`: stamp each logged tensor's version at the graph boundaries,
    for `changed`.
    """

    model: nn.Module
    modules: list[str]
    backend: str = DEFAULT_BACKEND
    fullgraph: bool = False
    inputs: bool = False
    train_mode: bool = False
    copy: frozenset[str] = frozenset()
    watch: bool = False
    log: list[tuple[str, Any, bool]] = field(default_factory=list)
    graphs: list[Any] = field(default_factory=list)
    # per log entry: its tensors' versions when the entry was logged (see `_stamp`)
    _stamps: list[list[int]] = field(default_factory=list)
    # id -> (tensor, version) of the last graph call's inputs as it began and outputs as it ended
    _boundary: dict[int, tuple[Any, int]] = field(default_factory=dict)
    # log index -> versions, for entries a hook logged in eager code (see `_eager_stamp`)
    _eager: dict[int, list[int]] = field(default_factory=dict)
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
        hooks = []
        try:
            for name in self.modules:
                module = named[name]
                # The root's hooks run outside the compiled graph, and nothing can change its
                # output after it returned: never copy it (a copy there is a graph of its own).
                copy = name in self.copy and module is not self.model
                hooks.append(self._output_hook(name, copy))
                self._handles.append(module.register_forward_hook(hooks[-1]))
                if self.inputs:
                    hooks.append(self._input_hook(name, copy))
                    self._handles.append(
                        module.register_forward_pre_hook(hooks[-1], with_kwargs=True)
                    )
            # Compiled code cached for this model's forward (by an earlier compile, or before the
            # hooks changed) would run without our hooks: start from empty caches.
            torch._dynamo.reset()
            _plain_when_called_from_eager(hooks)  # after the reset, which forgets it
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
        self._stamps.clear()
        self._eager.clear()
        self._boundary = {}
        try:
            with torch.no_grad():
                output = self._compiled(*args, **kwargs)
            if self.watch:
                self._stamp()  # the last graph's entries and the root's
            return output
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
        finally:
            self._boundary = {}

    @property
    def copy_outputs(self) -> bool:
        """Whether the log's entries are `(value, copy)` pairs."""
        return bool(self.copy)

    def changed(self) -> set[str]:
        """The modules (not copied) whose logged tensors changed in place after they were logged:
        a later graph or eager code after a graph break changed them (needs `watch`)."""
        found = set()
        paired = self.copy_outputs
        for (name, value, _), stamp in zip(self.log, self._stamps, strict=False):
            if name in self.copy or name in found:
                continue
            if [t._version for t in _tensors(value[0] if paired else value)] != stamp:
                found.add(name)
        return found

    def _stamp(self) -> None:
        """Stamp the entries logged since the last boundary. Dynamo appends a graph's entries
        right after the graph returns, so a tensor the last graph returned has the version it
        had then; one it took as input (an identity module's output), the version it had as the
        graph began, which can only be older than its module's return (a needless copy, never a
        missed change). A hook run in eager code stamped its entry as it logged it."""
        boundary = self._boundary
        paired = self.copy_outputs
        for _, value, _ in self.log[len(self._stamps) :]:
            eager = self._eager.get(len(self._stamps))
            if eager is not None:
                self._stamps.append(eager)
                continue
            if paired:
                value = value[0]
            stamp = []
            for t in _tensors(value):
                seen = boundary.get(id(t))
                stamp.append(seen[1] if seen is not None and seen[0] is t else t._version)
            self._stamps.append(stamp)

    def has_inplace(self) -> bool:
        """Whether any graph changes a tensor in place (then logged values may have changed)."""
        return any(_graph_mutates(gm) for gm in self.graphs)

    def _counting_backend(self) -> Callable[..., Any]:
        import torch

        inner = torch._dynamo.lookup_backend(self.backend)

        def backend(gm: Any, example_inputs: Any) -> Any:
            self.graphs.append(gm)
            compiled = inner(gm, example_inputs)
            boxed = getattr(compiled, "_boxed_call", False)

            def watched(*args: Any) -> Any:
                if not self.watch:
                    return compiled(*args)
                self._stamp()
                flat = args[0] if boxed else args
                boundary = {id(t): (t, t._version) for t in flat if isinstance(t, torch.Tensor)}
                out = compiled(*args)
                for t in out:
                    if isinstance(t, torch.Tensor) and id(t) not in boundary:
                        boundary[id(t)] = (t, t._version)
                self._boundary = boundary
                return out

            if boxed:
                watched._boxed_call = True  # type: ignore[attr-defined]
            return watched

        return backend

    def _output_hook(self, name: str, copy: bool) -> Callable[..., None]:
        log = self.log
        stamp = self._eager_stamp
        if copy:

            def copying_hook(module: nn.Module, args: Any, output: Any) -> None:
                log.append((name, (output, _copy(output)), False))
                stamp()

            return copying_hook
        if self.copy_outputs:  # a pair like the copied ones, without the copy

            def pair_hook(module: nn.Module, args: Any, output: Any) -> None:
                log.append((name, (output, output), False))
                stamp()

            return pair_hook

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            log.append((name, output, False))
            stamp()

        return hook

    def _input_hook(self, name: str, copy: bool) -> Callable[..., None]:
        log = self.log
        stamp = self._eager_stamp
        paired = self.copy_outputs  # uncopied inputs come as a pair too, without the copy

        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            value = (args, kwargs)
            log.append((name, (value, _copy(value) if copy else value) if paired else value, True))
            stamp()

        return hook

    def _eager_stamp(self) -> None:
        """After a hook's append: a hook that runs in eager code (outside the graphs: the
        root's, or one in a frame dynamo skipped) stamps its entry now, when the value is the
        one its module returned. In a graph this traces to nothing."""
        from torch.compiler import is_compiling

        if is_compiling() or not self.watch:
            return
        index = len(self.log) - 1
        value = self.log[index][1]
        self._eager[index] = [t._version for t in _tensors(value[0] if self.copy else value)]


class _Finished:
    """A sink in front of another, for tensors logged by a finished forward: a sink that writes a
    dump (`DumpSink`) takes them as `final` (read where they are, not copied first)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.final = isinstance(sink, DumpSink)

    def tensor(self, key: str, tensor: Any) -> None:
        if self.final:
            self.sink.tensor(key, tensor, final=True)  # type: ignore[call-arg]
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


def _plain_when_called_from_eager(hooks: list[Callable[..., None]]) -> None:
    """A hook called from eager code (in a frame dynamo fell back on) runs as plain Python, and
    `_eager_stamp` with it; dynamo would otherwise convert the hook's own frame, where
    `is_compiling()` is true and no graph is made, so the stamp would be lost. A hook traced
    inside a graph is still inlined there (the strategy is for frames, not for inlining)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for code in {hook.__code__ for hook in hooks}:
        set_code_exec_strategy(code, skip)


def _tensors(value: Any) -> list[Any]:
    """The tensor leaves of a logged value, as the copying hooks see them."""
    import torch
    from torch.utils import _pytree

    return [t for t in _pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


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
    copying hooks on every module; a logged value changed after a graph break, with copying
    hooks on the modules that returned it."""
    info = CompileInfo(backend, fullgraph)
    copy: frozenset[str] = frozenset()
    changed: set[str] = set()
    while True:
        with CompiledCapture(
            model,
            modules,
            backend=backend,
            fullgraph=fullgraph,
            inputs=inputs,
            train_mode=train_mode,
            copy=copy,
            watch=True,
        ) as cap:
            info.first_call_s += seeded_run(cap, args, kwargs, seed)[1]
            changed |= cap.changed()
            wanted = copy | changed
            if cap.has_inplace():
                wanted |= set(modules)
            if wanted != copy:
                copy = frozenset(wanted)
                continue
            # The timed run takes the first run's path; with graph breaks it is watched again
            # (a cheap check), without any the stamps' cost is spared.
            cap.watch = len(cap.graphs) > 1
            output, info.run_s = seeded_run(cap, args, kwargs, seed)
            later = cap.changed() if cap.watch else set()
            if later:  # another path than the first run's: compile again, copying those too
                changed |= later
                copy |= changed
                continue
            info.graphs = len(cap.graphs)
            info.graph_breaks = max(0, info.graphs - 1)
            info.copied_outputs = bool(copy)
            info.changed_after_return = sorted(changed)
            fired = {name for name, _, _ in cap.log}
            info.unmapped = [m for m in modules if m not in fired]
            break
    # after the compiled capture's hooks came off: this runs the eager model
    renumber_like_eager(cap, model, args, kwargs, train_mode=train_mode, seed=seed)
    return record_run(cap, sink), info, output


def seeded_run(
    cap: CompiledCapture, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int | None
) -> tuple[Any, float]:
    """`cap.run` from `seed` (the caller's RNG state left alone): its output and seconds."""
    import torch

    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        start = time.perf_counter()
        output = cap.run(args, kwargs)
        return output, time.perf_counter() - start
