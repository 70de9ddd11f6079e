"""A model whose block loses its values in bfloat16 (the inside-a-module guide's example):
`h + 4096` keeps 8 bits of mantissa there, so `- 4096` gives h back in steps of 16."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        big = h + 4096.0
        back = big - 4096.0
        return self.act(back) + x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x.to(self.embed.weight.dtype))))


def make() -> tuple[nn.Module, torch.Tensor]:
    """The model and its example input, as `modeltap ... cancelling:make` takes them."""
    torch.manual_seed(0)
    return Model(), torch.randn(4, 8)


def make_bf16() -> tuple[nn.Module, torch.Tensor]:
    """The same model and input in bfloat16."""
    model, x = make()
    return model.to(torch.bfloat16), x.to(torch.bfloat16)
