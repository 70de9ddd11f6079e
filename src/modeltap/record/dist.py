"""Where this process stands in a torch.distributed run, and local or full views of tensors.

Only torch.distributed's own process group is used; the one collective of our own is
`DTensor.full_tensor()` when gathering is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    backend: str = "none"


def rank_info() -> RankInfo:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return RankInfo()
    return RankInfo(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


def unwrap(model: nn.Module) -> nn.Module:
    """The module DDP (or DataParallel) wraps, so keys read the same with and without it."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def is_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def placement(tensor: Any) -> dict[str, Any]:
    """How a DTensor is laid out: placements, global shape, mesh shape, local shape."""
    return {
        "placements": [repr(p) for p in tensor.placements],
        "global_shape": list(tensor.shape),
        "mesh": list(tensor.device_mesh.shape),
        "local_shape": list(tensor.to_local().shape),
    }


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def full_view(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from every rank (a collective: every rank must call it)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]
