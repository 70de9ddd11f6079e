"""A training loop whose second Linear gets one inf weight at step 3, recorded into runs/exp2
every 100 steps with `on_nonfinite="dump"`: the tripwire names the module that made the first
non-finite output and writes the step's full tensors (the NaN guide's example)."""

import torch
from torch import nn

import modeltap
from modeltap.record import NonFiniteError

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    with modeltap.record(model, "runs/exp2", every=100, on_nonfinite="dump") as rec:
        for step in range(10):
            if step == 3:  # the corruption: one weight made inf
                with torch.no_grad():
                    model[2].weight[5, 7] = float("inf")
            model(torch.randn(32, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step()
except NonFiniteError as error:
    print(f"NonFiniteError: {error}")
