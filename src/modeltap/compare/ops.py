"""`compare --ops`: inside the module that introduces the error, the op that introduces it.

The module's call is taken from the reference's forward (its inputs as the reference gave them),
and run again in the reference with every torch function its code calls recorded (the same level
as `dump --ops`, capture/ops.py). Each op is then run once more in the candidate's dtype and device
from the reference's inputs to that op, so its error is its own, not inherited from the ops before
it: the op with the largest relative error (`|candidate - reference| / |reference|`, L2) is named
with its source line. The op runs with the reference's weights cast as the candidate casts them; a
quantized variant's weights are not quantized here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture import flatten, run_model
from modeltap.capture.ops import op_name, qualified_name, source_line
from modeltap.compare.replayer import _cast, _module_dtype_device
from modeltap.compare.variants import compute_dtype, model_device
from modeltap.errors import InputError, first_line
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from torch import nn

    from modeltap.loading import Inputs


@dataclass
class OpError:
    key: str  # `module/opNN.name`, as `dump --ops` keys it
    op: str  # the torch function
    source: str  # file:line
    error: float | None  # relative L2 error of its output; None when it did not run
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "op": self.op, "source": self.source, "error": self.error,
                "note": self.note or None}  # fmt: skip


@dataclass
class OpBlame:
    module: str
    ops: list[OpError] = field(default_factory=list)

    @property
    def worst(self) -> OpError | None:
        ran = [o for o in self.ops if o.error is not None]
        return max(ran, key=lambda o: o.error or 0.0) if ran else None

    def path(self) -> str:
        """`module > opNN.name` of the worst op, or the module alone."""
        worst = self.worst
        return self.module if worst is None else f"{self.module} > {worst.key.rpartition('/')[2]}"

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "module": self.module,
            "op": None if worst is None else worst.to_json(),
            "path": self.path(),
            "ops": [o.to_json() for o in self.ops],
        }


@dataclass
class _Call:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    source: str


def blame_ops(
    reference: nn.Module, candidate: nn.Module, inputs: Inputs, module: str, *, seed: int = 0
) -> OpBlame:
    """The ops of `module` (a display name, the same in both models), each with the error it
    introduces in `candidate` (see the module doc)."""
    import torch

    ref_mod, cand_mod = _named(reference, module), _named(candidate, module)
    args, kwargs = _first_call(reference, ref_mod, inputs, seed)
    calls = _recorded(ref_mod, args, kwargs, seed)
    dtype, device = _module_dtype_device(cand_mod) or (
        compute_dtype(candidate),
        model_device(candidate),
    )
    blame = OpBlame(module)
    for index, call in enumerate(calls):
        key = f"{module}/op{index:02d}.{op_name(call.func)}"
        found = OpError(key, qualified_name(call.func), call.source, None)
        blame.ops.append(found)
        try:
            cast_args, cast_kwargs = _cast((call.args, call.kwargs), dtype, device)
            with torch.no_grad():
                got = call.func(*cast_args, **cast_kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            found.note = first_line(exc)
            continue
        found.error = _relative_error(got, call.output)
    return blame


def _named(model: nn.Module, name: str) -> nn.Module:
    modules = {(n or ROOT): m for n, m in model.named_modules()}
    if name not in modules:
        raise InputError(f"--ops: no module '{name}' in {type(model).__name__}")
    return modules[name]


def _clone(value: Any) -> Any:
    return _cast(value, None, None)


def _first_call(model: nn.Module, module: nn.Module, inputs: Inputs, seed: int) -> tuple[Any, Any]:
    """The args and kwargs of `module`'s first call in `model`'s forward, copied."""
    import torch

    seen: list[tuple[Any, Any]] = []

    def pre(mod: Any, args: Any, kwargs: Any) -> None:
        if not seen:
            seen.append((_clone(args), _clone(kwargs)))

    handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            run_model(model, inputs.args, inputs.kwargs)
    finally:
        handle.remove()
    if not seen:
        raise InputError("--ops: the module that introduces the error was not called")
    return seen[0]


def _recorded(module: nn.Module, args: Any, kwargs: Any, seed: int) -> list[_Call]:
    """Every torch function `module`'s forward calls (its children's too), with copies of its
    inputs and output as they were."""
    import torch
    from torch.overrides import TorchFunctionMode

    calls: list[_Call] = []

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") in ("__get__", "__set__"):
                return func(*args, **kwargs)
            taken = (_clone(args), _clone(kwargs))
            out = func(*args, **kwargs)
            if any(isinstance(v, torch.Tensor) for _, v in flatten(out)):
                calls.append(_Call(func, *taken, _clone(out), source_line()))
            return out

    with torch.random.fork_rng(devices=[]), torch.no_grad(), _Mode():
        torch.manual_seed(seed)
        module(*args, **kwargs)
    return calls


def _relative_error(got: Any, want: Any) -> float | None:
    import torch

    pairs = zip(flatten(got), flatten(want), strict=False)
    worst: float | None = None
    for (_, x), (_, y) in pairs:
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            continue
        if not y.is_floating_point() or x.shape != y.shape:
            continue
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        scale = float(torch.linalg.vector_norm(y))
        error = float(torch.linalg.vector_norm(x - y)) / (scale or 1.0)
        worst = error if worst is None else max(worst, error)
    return worst
