"""Hutchinson estimates of Jacobian norms (`grads --jacobian-norm K`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch



# Bytes of batched probe gradients held at once while estimating Jacobian norms.
PROBE_BUDGET = 1 << 30



@dataclass
class JacobianNorm:
    """Hutchinson estimate of ||d target / d x||_F from K probes: E ||v^T J||^2 = ||J||_F^2."""

    probes: int
    kind: str
    mode: str  # batched (vmap, is_grads_batched) | loop
    squared: float
    squared_se: float | None

    @property
    def norm(self) -> float:
        return math.sqrt(max(self.squared, 0.0))

    @property
    def norm_se(self) -> float | None:
        # Delta method: se(sqrt(s)) = se(s) / (2 sqrt(s)).
        if self.squared_se is None or self.norm == 0:
            return None
        return self.squared_se / (2 * self.norm)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "norm": self.norm, "norm_se": self.norm_se}



def jacobian_norms(
    y: torch.Tensor,
    xs: Sequence[torch.Tensor],
    probes: int,
    kind: str,
    generator: torch.Generator,
) -> list[JacobianNorm]:
    """Hutchinson estimates of ||dy/dx||_F for every x, from the same `probes` probe vectors.

    Probes go through the graph in batches (`is_grads_batched`, i.e. vmap over the backward)
    sized to PROBE_BUDGET; a model whose backward vmap can't batch falls back to one probe per
    pass. The graph must have been kept (retain_graph) and is freed at the end.
    """
    import torch

    per_probe = sum(x.numel() * x.element_size() for x in xs) or 1
    chunk = max(1, min(probes, PROBE_BUDGET // per_probe))
    squares: list[list[torch.Tensor]] = [[] for _ in xs]
    mode = "batched" if probes > 1 else "loop"
    done = 0
    while done < probes:
        n = min(chunk, probes - done)
        v = _probes(kind, (n, *y.shape), generator).to(y)
        last = done + n >= probes
        grads = None
        if mode == "batched":
            try:
                grads = torch.autograd.grad(
                    y,
                    xs,
                    grad_outputs=v,
                    is_grads_batched=True,
                    retain_graph=True,
                    allow_unused=True,
                )
            except (RuntimeError, NotImplementedError):
                mode = "loop"
        if grads is not None:
            for i, g in enumerate(grads):
                squares[i].append(_squared_norms(g, n))
        else:
            for j in range(n):
                one = torch.autograd.grad(
                    y,
                    xs,
                    grad_outputs=v[j],
                    retain_graph=not (last and j == n - 1),
                    allow_unused=True,
                )
                for i, g in enumerate(one):
                    squares[i].append(_squared_norms(None if g is None else g[None], 1))
        done += n
    estimates = []
    for s in squares:
        values = torch.cat(s)
        se = float(values.std() / math.sqrt(len(values))) if len(values) > 1 else None
        estimates.append(JacobianNorm(probes, kind, mode, float(values.mean()), se))
    return estimates



def _probes(kind: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    import torch

    if kind == "gaussian":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    return torch.randint(0, 2, shape, generator=generator, dtype=torch.int8).double() * 2 - 1



def _squared_norms(g: torch.Tensor | None, n: int) -> torch.Tensor:
    import torch

    if g is None:
        return torch.zeros(n, dtype=torch.float64)
    return g.detach().reshape(n, -1).double().pow(2).sum(1)
