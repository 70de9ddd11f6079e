"""Statistics computed inside the compiled graph, for `dump --compile --stats-only`.

The plain compiled capture makes every logged tensor a graph output: inductor can no longer reuse
its buffers, and the statistics read all of them again once the graph has returned (bert-base
8 x 128: 692 MB, after the forward, 1.31 x the compiled forward). Here each hook logs, in place
of its module's output, `stats.graph_stats` of each tensor in it (the forward itself goes on as
it would), so the graph returns a few numbers per tensor: inductor computes them in its own
kernels, one read of each tensor while it is in cache, and frees or reuses the tensor as it would
without hooks. Values are taken where the module returned, whatever the graph does to them in
place afterwards.

What the numbers cannot say comes from one eager forward with the same hooks' selection before
compiling (`learn_layout`): each key's shape, dtype and device, the aliases (a module that
returns its child's very tensor, as eager names it) and the skipped values, so the keys, order
and aliases are the eager dump's. The compiled run is named by the same `Recorder` and must
produce exactly the eager run's keys in the eager order.

A module that runs more than once may run its calls in another order compiled (capture/order.py):
its calls are matched with the eager ones by their statistics' mean, min and max, as the copying
path matches them by value.

`graph_stats_run` says why it can't (and the caller takes the copying path) when: a tensor has a
dtype or layout the graph statistics don't take (complex, float8, sparse), an output holds
tensors pytree can't find (a plain dataclass, which modeltap's keys open), the compiled run's
keys differ from eager's, the hooks with statistics fail to compile, a tensor held a NaN or Inf
(its counts and masked moments need the tensor itself), or values past 1e19 overflowed the
float32 sums (an additive attention mask of float32's lowest value).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture.compile_log import (
    CompiledCapture,
    CompileInfo,
    record_log,
    seeded_run,
)
from modeltap.capture.order import renumber_like_eager
from modeltap.capture.recorder import MemorySink, Recorder
from modeltap.errors import RunError
from modeltap.selection import ROOT

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

    def check(self, name: str, is_input: bool = False) -> Callable[..., None]:
        """A hook noting, in `unfit`, an output (or inputs) whose tensors pytree doesn't find
        as `keys.flatten` does."""

        def check(module: nn.Module, args: Any, *rest: Any) -> None:
            import torch
            from torch.utils import _pytree

            from modeltap.capture.order import tensor_leaves

            value = (args, rest[0]) if is_input else rest[0]
            found = [t for t in _pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            named = tensor_leaves(value)
            same = len(found) == len(named)
            same = same and all(a is b for a, b in zip(found, named, strict=True))
            if self.unfit is None and not same:
                self.unfit = f"'{name}' returns a {type(value).__name__} pytree can't look into"

        return check


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
    by_name = {(n or ROOT): m for n, m in model.named_modules()}
    # the hooks see what `StatsCapture`'s will: their tensors, found by pytree, must be the ones
    # modeltap's keys name (`flatten` also opens plain dataclasses and other Mappings)
    checks = [by_name[name].register_forward_hook(layout.check(name)) for name in modules]
    if inputs:
        checks += [
            by_name[name].register_forward_pre_hook(layout.check(name, True), with_kwargs=True)
            for name in modules
        ]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            with hooks(model, modules, layout, inputs=inputs, train_mode=train_mode) as eager:
                run_model(model, args, kwargs)
    finally:
        for handle in checks:
            handle.remove()
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

    differ = NotInGraph("the compiled run's outputs differ from the eager run's")
    named = Recorder(MemorySink())
    record_log(named, log)
    if named.order != eager.order:
        raise differ
    vectors = named.sink.tensors  # type: ignore[attr-defined]
    keys = [key for key in eager.order if key not in eager.aliases]
    # An empty tensor's vector is empty, like a placeholder's: the compiled recorder may have
    # named it an alias of one. Any other key without its vector is a mismatch.
    if any(key not in vectors and math.prod(layout.tensors[key][0]) for key in keys):
        raise differ
    found = {key: vectors[key].reshape(-1) for key in keys if key in vectors}
    # one transfer per device (from a GPU: one sync, not one per tensor)
    numbers: dict[str, list[float]] = {}
    for device in {v.device for v in found.values()}:
        here = [key for key, v in found.items() if v.device == device]
        flat = torch.cat([found[key].to(torch.float64) for key in here]).tolist()
        at = 0
        for key in here:
            numbers[key] = flat[at : at + found[key].numel()]
            at += found[key].numel()
    computed: dict[str, TensorStats] = {}
    for key in keys:
        shape, dtype, _ = layout.tensors[key]
        got = numbers.get(key, [])
        try:
            stats = stats_from_graph(got, shape, dtype)
        except ValueError:
            raise differ from None
        if stats is None:
            extremes_finite = all(math.isfinite(v) for v in got[2:4])
            raise NotInGraph(
                f"'{key}' has values past 1e19, whose float32 sums overflow"
                if extremes_finite
                else f"'{key}' holds a NaN or Inf"
            )
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
        try:
            info.first_call_s = seeded_run(cap, args, kwargs, seed)[1]
        except RunError as exc:  # the copying path says so again if the model itself fails
            raise NotInGraph(f"the hooks with statistics did not compile ({exc})") from exc
        output, info.run_s = seeded_run(cap, args, kwargs, seed)
        info.graphs = len(cap.graphs)
        info.graph_breaks = max(0, info.graphs - 1)
        fired = {name for name, _, _ in cap.log}
        info.unmapped = [m for m in modules if m not in fired]
    # after the compiled capture's hooks came off: this runs the eager model
    renumber_like_eager(cap, model, args, kwargs, train_mode=train_mode, seed=seed, stats=True)
    hand_over(cap.log, eager, layout, sink)
    return eager, info, output
