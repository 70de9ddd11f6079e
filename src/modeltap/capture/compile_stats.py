"""Statistics computed inside the compiled graph, for `dump --compile --stats-only`.

The plain compiled capture makes every logged tensor a graph output: inductor can no longer reuse
its buffers, and the statistics read all of them again once the graph has returned (bert-base
8 x 128: 692 MB, after the forward, 1.31 x the compiled forward). Here each hook replaces its
module's output by `stats.graph_stats` of each tensor in it, so the graph returns a few numbers
per tensor: inductor computes them in its own kernels, beside the ones that make the tensor, while
the tensor is in cache, and frees or reuses the tensor as it would without hooks. Values are
taken where the module returned, whatever the graph does to them in place afterwards.

What the numbers cannot say comes from one eager forward with the same hooks' selection before
compiling (`_layout`): each key's shape, dtype and device, the aliases (a module that returns its
child's very tensor, as eager names it) and the skipped values, so the keys, order and aliases
are the eager dump's. The compiled run is named by the same `Recorder` and must produce exactly
the eager run's keys in the eager order.

A module that runs more than once may run its calls in another order compiled (capture/order.py):
its calls are matched with the eager ones by their statistics' mean, min and max, as the copying
path matches them by value.

`graph_stats_run` says why it can't (and the caller takes the copying path) when: a tensor has a
dtype or layout the graph statistics don't take (complex, float8, sparse), the compiled run's
keys differ from eager's, or a tensor held a NaN or Inf (its counts and masked moments need the
tensor itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture.compile import (
    CompiledCapture,
    CompileInfo,
    record_log,
    renumber_like_eager,
    seeded_run,
)
from modeltap.capture.recorder import Recorder

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.stats import TensorStats


class NotInGraph(Exception):
    """The statistics of this run can't come from the graph; the message says why."""


@dataclass
class StatsCapture(CompiledCapture):
    """A compiled model whose selected modules log `(name, output)` with every tensor of the
    output replaced by its `graph_stats` vector."""

    row_mask: Any = None
    dead_threshold: float = 0.0
    # modules whose every output tensor is an alias of an earlier key (eager's dropouts in eval
    # mode, wrappers that return their child's tensor): their hooks compute nothing
    aliased: frozenset[str] = frozenset()

    def _output_hook(self, name: str, copy: bool) -> Callable[..., None]:
        log = self.log
        stats = self._placeholders if name in self.aliased else self._stats

        def stats_hook(module: nn.Module, args: Any, output: Any) -> None:
            log.append((name, stats(output), False))

        return stats_hook

    def _input_hook(self, name: str, copy: bool) -> Callable[..., None]:
        log = self.log
        stats = self._stats

        def stats_input_hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            log.append((name, stats((args, kwargs)), True))

        return stats_input_hook

    def _stats(self, value: Any) -> Any:
        import torch
        from torch.utils import _pytree

        from modeltap.stats import graph_stats, rows_kept

        mask, threshold = self.row_mask, self.dead_threshold

        def one(t: torch.Tensor) -> torch.Tensor:
            return graph_stats(t.detach(), rows_kept(t, mask), threshold)

        return _pytree.tree_map_only(torch.Tensor, one, value)

    def _placeholders(self, value: Any) -> Any:
        """The structure of `value`, an empty tensor for each tensor (named, never read)."""
        import torch
        from torch.utils import _pytree

        def empty(t: torch.Tensor) -> torch.Tensor:
            return t.new_empty(0, dtype=torch.float64)

        return _pytree.tree_map_only(torch.Tensor, empty, value)


@dataclass
class _Layout:
    """A sink for the eager forward that learns the keys: shape, dtype and device of each."""

    tensors: dict[str, tuple[list[int], torch.dtype, torch.device]] = field(default_factory=dict)
    unfit: str | None = None  # a key whose tensor graph_stats doesn't take

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        import torch

        self.tensors[key] = (list(tensor.shape), tensor.dtype, tensor.device)
        plain = tensor.dtype.is_floating_point and tensor.dtype.itemsize >= 2
        fits = tensor.layout == torch.strided and (plain or not tensor.dtype.is_floating_point)
        if self.unfit is None and (not fits or tensor.is_complex()):
            self.unfit = f"'{key}' is {tensor.layout} {tensor.dtype}"

    def alias(self, key: str, target: str) -> None:
        pass


@dataclass
class _Vectors:
    """A sink for the compiled run's named statistics vectors."""

    vectors: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        self.vectors[key] = tensor

    def alias(self, key: str, target: str) -> None:
        pass


def learn_layout(
    model: nn.Module,
    modules: list[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    inputs: bool,
    train_mode: bool,
    seed: int | None,
) -> tuple[Recorder, _Layout]:
    """One eager forward with `modules` hooked: the keys in order, aliases and skipped values (the
    recorder) and each key's shape, dtype and device. Raises NotInGraph for what the graph
    statistics can't take."""
    import torch

    from modeltap.capture.eager import hooks, run_model

    layout = _Layout()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        with hooks(model, modules, layout, inputs=inputs, train_mode=train_mode) as eager:
            run_model(model, args, kwargs)
    if layout.unfit is not None:
        raise NotInGraph(layout.unfit)
    return eager, layout


def aliased_modules(eager: Recorder) -> frozenset[str]:
    """The modules each of whose output keys is an alias in `eager`'s run."""
    from modeltap.capture.keys import INPUT_PART, split_key

    outputs: dict[str, list[str]] = {}
    for key in eager.order:
        module, _, part = split_key(key)
        if part != INPUT_PART and not part.startswith(INPUT_PART + "."):
            outputs.setdefault(module, []).append(key)
    return frozenset(m for m, keys in outputs.items() if all(k in eager.aliases for k in keys))


def hand_over(
    log: list[tuple[str, Any, bool]], eager: Recorder, layout: _Layout, sink: Any
) -> None:
    """Name what a `StatsCapture` run logged and give `sink` each key's statistics
    (`sink.computed`) or alias, in eager order; NotInGraph, before anything reached `sink`, when
    the keys differ from eager's or a tensor held a NaN or Inf."""
    import torch

    from modeltap.stats import stats_from_graph

    named = Recorder(_Vectors())
    record_log(named, log)
    if named.order != eager.order:
        raise NotInGraph("the compiled run's outputs differ from the eager run's")
    vectors = named.sink.vectors  # type: ignore[attr-defined]
    keys = [key for key in eager.order if key not in eager.aliases]
    # An empty tensor's vector is empty, like a placeholder's: the compiled recorder may have
    # named it an alias of one. Any other key without its vector is a mismatch.
    empty = torch.zeros(0, dtype=torch.float64)
    if any(key not in vectors and math.prod(layout.tensors[key][0]) for key in keys):
        raise NotInGraph("the compiled run's outputs differ from the eager run's")
    found = [vectors.get(key, empty) for key in keys]
    # one transfer for all of them (from a GPU: one sync, not one per tensor)
    numbers = torch.cat([v.reshape(-1).to(torch.float64).cpu() for v in found]).tolist()
    computed: dict[str, TensorStats] = {}
    at = 0
    for key, vector in zip(keys, found, strict=True):
        width = vector.numel()
        shape, dtype, _ = layout.tensors[key]
        stats = stats_from_graph(numbers[at : at + width], shape, dtype)
        at += width
        if stats is None:
            raise NotInGraph(f"'{key}' holds a NaN or Inf")
        computed[key] = stats
    for key in eager.order:
        target = eager.aliases.get(key)
        if target is not None:
            sink.alias(key, target)
        else:
            sink.computed(key, computed[key], layout.tensors[key][2])


def graph_stats_run(
    model: nn.Module,
    modules: list[str],
    sink: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    row_mask: torch.Tensor | None,
    dead_threshold: float,
    backend: str,
    fullgraph: bool,
    inputs: bool,
    train_mode: bool,
    seed: int | None,
) -> tuple[Recorder, CompileInfo, Any]:
    """Compile `model` with `modules` hooked to compute their statistics in the graph, run it
    twice (compile, then the timed run) and hand `sink` each key's statistics or alias in eager
    order (`hand_over`). Raises NotInGraph, before anything reached `sink`, when it can't."""

    eager, layout = learn_layout(
        model, modules, args, kwargs, inputs=inputs, train_mode=train_mode, seed=seed
    )
    info = CompileInfo(backend, fullgraph)
    with StatsCapture(
        model,
        modules,
        backend=backend,
        fullgraph=fullgraph,
        inputs=inputs,
        train_mode=train_mode,
        row_mask=row_mask,
        dead_threshold=dead_threshold,
        aliased=aliased_modules(eager),
    ) as cap:
        info.first_call_s = seeded_run(cap, args, kwargs, seed)[1]
        output, info.run_s = seeded_run(cap, args, kwargs, seed)
        info.graphs = len(cap.graphs)
        info.graph_breaks = max(0, info.graphs - 1)
        fired = {name for name, _, _ in cap.log}
        info.unmapped = [m for m in modules if m not in fired]
    # after the compiled capture's hooks came off: this runs the eager model
    renumber_like_eager(cap, model, args, kwargs, train_mode=train_mode, seed=seed, stats=True)
    hand_over(cap.log, eager, layout, sink)
    return eager, info, output
