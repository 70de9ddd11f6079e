"""What `modeltap grads` differentiates: the target, the loss, the output gradient v."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError

if TYPE_CHECKING:
    import torch




LOSSES = ("sum", "lm", "mlm")



PROBES = ("rademacher", "gaussian")



@dataclass(frozen=True)
class GradSpec:
    """What to differentiate, and how. See docs/commands/grads.md."""

    target: str | None = None
    wrt: tuple[str, ...] = ()
    loss: str = "sum"
    grad_output: str = "ones"
    params: bool = False
    jacobian_norm: int = 0
    probes: str = "rademacher"
    vanishing: float = 1e-7
    exploding: float = 1e3

    @classmethod
    def from_settings(cls, s: Any) -> GradSpec:
        """The spec a run's `Settings` asks for: each field of the same name (`wrt` a tuple)."""
        values = {f.name: getattr(s, f.name) for f in dataclasses.fields(cls)}
        return cls(**{**values, "wrt": tuple(values["wrt"])})

    def check(self) -> None:
        if self.loss not in LOSSES:
            raise InputError(f"--loss must be one of {', '.join(LOSSES)}, got '{self.loss}'")
        if self.target is not None and self.loss != "sum":
            raise InputError(f"--loss {self.loss} is for the whole model; drop --target or --loss")
        if self.loss != "sum" and self.grad_output != "ones":
            raise InputError(f"--grad-output needs a tensor target; --loss {self.loss} is scalar")
        if self.probes not in PROBES:
            raise InputError(f"--probes must be one of {', '.join(PROBES)}, got '{self.probes}'")
        if self.jacobian_norm < 0:
            raise InputError("--jacobian-norm must be 0 (off) or a number of probes")
        if not 0 <= self.vanishing < self.exploding:
            raise InputError("need 0 <= --vanishing < --exploding")
        parse_grad_output(self.grad_output)



def parse_grad_output(spec: str) -> tuple[str, Any]:
    """("ones", None) | ("randn", None) | ("unit", index tuple) | ("file", Path)."""
    if spec in ("ones", "randn"):
        return spec, None
    if spec.startswith("unit:"):
        try:
            index = tuple(int(i) for i in spec[5:].split(","))
        except ValueError:
            raise InputError(
                f"--grad-output '{spec}': give unit:I,J,... with one integer index per dimension "
                "(e.g. unit:0,3,42 for batch 0, token 3, unit 42)"
            ) from None
        return "unit", index
    path = Path(spec)
    if path.suffix.lower() in (".safetensors", ".npy", ".npz", ".pt", ".pth"):
        if not path.is_file():
            raise InputError(f"no --grad-output file '{spec}'; check the path")
        return "file", path
    raise InputError(
        f"--grad-output '{spec}': use ones, randn, unit:I,J,... or a tensor file "
        "(.safetensors, .npy, .pt)"
    )



def seed_tensor(spec: str, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The vector v of the vector-Jacobian product v^T dy/dx."""
    import torch

    kind, arg = parse_grad_output(spec)
    if kind == "ones":
        return torch.ones_like(y)
    if kind == "randn":
        return torch.randn(y.shape, generator=generator, dtype=torch.float32).to(y)
    if kind == "unit":
        if len(arg) != y.dim() or any(not -s <= i < s for i, s in zip(arg, y.shape, strict=True)):
            raise InputError(
                f"--grad-output unit:{','.join(map(str, arg))} is not an index into the target "
                f"of shape {list(y.shape)}; give {y.dim()} indices within it"
            )
        v = torch.zeros_like(y)
        v[arg] = 1
        return v
    from modeltap.loading import file_inputs

    loaded = file_inputs(arg)
    tensors = [*loaded.args, *loaded.kwargs.values()]
    if len(tensors) != 1 or list(tensors[0].shape) != list(y.shape):
        raise InputError(
            f"--grad-output file '{arg.name}' must hold one tensor of the target's shape "
            f"{list(y.shape)}"
        )
    return tensors[0].to(y)
