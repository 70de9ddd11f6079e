"""`compare --ops` from Python (docs/commands/compare.md): a block whose own code cancels in
bfloat16 (`h + 4096.0` keeps 8 bits of mantissa there), between its Linear and its GELU module,
with a Linear after them."""

from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

import modeltap


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.GELU()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        big = h + 4096.0
        back = big - 4096.0
        return self.proj(self.act(back))


torch.manual_seed(0)
parts = {"embed": nn.Linear(8, 16), "block": Block(), "head": nn.Linear(16, 4)}
model, x = nn.Sequential(OrderedDict(parts)).eval(), torch.randn(4, 8)
report = modeltap.compare(model, "bf16", x, ops=True)
print("passed:", report.passed)
for module in report.origins:
    print(f"origin: {module.name}  local error {module.local_error:.3g}")
worst = report.op_blame.worst
file, _, line = worst.source.rpartition(":")
print(f"op: {report.op_blame.path()}  relative error {worst.error:.3g} at {Path(file).name}:{line}")
