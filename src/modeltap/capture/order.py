"""Repeated calls of a module numbered in eager order, for a backend that calls them in another.

`name@k` is the k-th call of `name` in the eager forward. torch.compile can make the same calls
in another order: dynamo iterates a set in insertion order, CPython in hash order, so Gemma3 and
ModernBERT (which run `rotary_emb` once per layer type, looping over `set(config.layer_types)`)
call `rotary_emb` for the full-attention layers first in one and for the sliding ones first in
the other. Numbered by the compiled run's own order, `rotary_emb` of a compiled dump would hold
the other call's values than `rotary_emb` of the eager dump.

`eager_calls` runs the eager model once with hooks on the modules the backend saw more than once;
`renumber` then matches each of the backend's calls with the eager call whose values are nearest
and gives it that call's number. A module whose calls don't match one to one keeps the backend's
order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modeltap.capture.keys import flatten

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modeltap.capture.compile_log import CompiledCapture

Leaves = list["torch.Tensor"]


def tensor_leaves(value: Any) -> Leaves:
    import torch

    return [leaf for _, leaf in flatten(value) if isinstance(leaf, torch.Tensor)]


def eager_calls(
    model: nn.Module,
    modules: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    train_mode: bool,
    seed: int | None,
) -> dict[str, list[Leaves]]:
    """Each of `modules`' calls in one eager forward, in call order: its output's tensor leaves,
    copied as it returns."""
    import torch

    from modeltap.capture.eager import model_mode
    from modeltap.selection import ROOT

    by_name = {(n or ROOT): m for n, m in model.named_modules()}
    calls: dict[str, list[Leaves]] = {name: [] for name in modules}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            calls[name].append([t.detach().clone() for t in tensor_leaves(output)])

        return hook

    handles = [by_name[name].register_forward_hook(keep(name)) for name in modules]
    try:
        with model_mode(model, train_mode), torch.random.fork_rng(devices=[]), torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


# A backend's call is an eager call when their values are this close, relative to the eager
# call's largest value: far above what compiling changes in float32 or bfloat16 (kernels that round
# otherwise), far below the difference between calls on different inputs.
SAME_CALL = 0.05


def matching(got: list[Leaves], eager: list[Leaves], *, nearest: bool = False) -> list[int] | None:
    """For each of the backend's calls, the number of the eager call it is (the only one within
    SAME_CALL); None when they don't match one to one (dropout in training mode, two calls on the
    same input). `nearest`: the one nearest within SAME_CALL, at most half as far as the next (for
    summaries of calls, such as statistics, which lie closer together than their values do)."""
    if len(got) != len(eager):
        return None
    numbers = []
    for leaves in got:
        distances = [_distance(leaves, other) for other in eager]
        ranked = sorted(distances)
        if nearest:
            unique = len(ranked) < 2 or ranked[0] <= ranked[1] / 2
            if ranked[0] > SAME_CALL or not unique:
                return None
        elif sum(d <= SAME_CALL for d in distances) != 1:
            return None
        numbers.append(distances.index(ranked[0]))
    return numbers if sorted(numbers) == list(range(len(eager))) else None


def _distance(a: Leaves, b: Leaves) -> float:
    """The largest difference between two calls' leaves, relative to the eager call's scale."""
    if len(a) != len(b):
        return float("inf")
    pairs = list(zip(a, b, strict=True))
    if any(x.shape != y.shape or x.dtype != y.dtype for x, y in pairs):
        return float("inf")
    worst = 0.0
    for x, y in pairs:
        if x.numel():
            x, y = x.detach().double().cpu(), y.double().cpu()
            worst = max(worst, float((x - y).abs().max() / (y.abs().max() + 1e-12)))
    return float("inf") if math.isnan(worst) else worst


def renumber_like_eager(
    cap: CompiledCapture,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    train_mode: bool,
    seed: int | None,
    stats: bool = False,
) -> list[str]:
    """Give each repeated call in `cap.log` the number it has in the eager forward, where the
    compiled run made the calls in another order (see capture/order.py); returns the modules
    renumbered. `stats`: the log holds `graph_stats` vectors (a `StatsCapture`'s), matched with
    the eager calls' by mean, min and max, which are on the values' own scale, each with the
    nearest (`matching`'s `nearest`: ModernBERT's two rotary tables differ by 0.04 in mean)."""
    from modeltap.stats import graph_stats

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
        want = eager[name]
        if stats:
            got = [[_extremes(v) for v in leaves] for leaves in got]
            want = [[_extremes(graph_stats(t)) for t in leaves] for leaves in want]
        numbers = matching(got, want, nearest=stats)
        if numbers is None or numbers == sorted(numbers):
            continue
        for entries in (at, inputs.get(name, [])):
            if len(entries) == len(at):  # the k-th call's inputs go with its output
                logged = [cap.log[i] for i in entries]
                for entry, number in zip(logged, numbers, strict=True):
                    cap.log[entries[number]] = entry
        renumbered.append(name)
    return renumbered


def _extremes(vector: Any) -> Any:
    """Mean, min and max of a `graph_stats` vector (an empty tensor's is empty)."""
    return vector[[0, 2, 3]] if vector.numel() else vector
