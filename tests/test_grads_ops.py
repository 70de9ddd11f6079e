"""`grads --ops`: inside a module that gets gradients, each op's output and the gradient of the
target w.r.t. it, each equal to torch.autograd.grad of the same target w.r.t. the same
intermediate computed here in plain torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import modeltap
from modeltap.cli import app
from modeltap.dump import load_dump
from tests.fixtures.ops_models import Net, build_softmax

runner = CliRunner()


def test_cli_grads_ops_equal_autograd_wrt_each_intermediate() -> None:
    r = runner.invoke(app, ["grads", "tests.fixtures.ops_models:build_softmax", "--ops",
                            "--include", "block", "-o", "g.safetensors"])
    assert r.exit_code == 0, r.output
    dump = load_dump("g.safetensors")
    ops = json.loads(dump.metadata["ops"])
    assert list(ops) == ["block/op00.matmul", "block/op01.softmax", "block/op02.mul"]
    assert ops["block/op01.softmax"]["op"] == "torch.softmax"
    model, (x,) = build_softmax()
    h = x @ model.block.w
    p = torch.softmax(h, -1)
    doubled = p * 2
    out = model.head(doubled)
    # the target is the model's output, seeded with ones (grads' default)
    want = torch.autograd.grad(out, (h, p, doubled), torch.ones_like(out))
    for key, grad in zip(ops, want, strict=True):
        torch.testing.assert_close(dump[f"grad/{key}"], grad)
    # the ops' values come with their gradients; the module's own gradient is still there
    torch.testing.assert_close(dump["block/op01.softmax"], p.detach())
    torch.testing.assert_close(dump["grad/block"], want[2])
    assert json.loads(dump.metadata["grad"])["no_path"] == {}


def test_grads_ops_target_a_module_and_wrt_one_op() -> None:
    r = runner.invoke(app, ["grads", "tests.fixtures.ops_models:build_softmax", "--ops",
                            "--target", "block", "--wrt", "block/op00.matmul",
                            "--grad-output", "randn", "-o", "g.safetensors"])
    assert r.exit_code == 0, r.output
    dump = load_dump("g.safetensors")
    model, (x,) = build_softmax()
    grads = [k for k in json.loads(dump.metadata["order"]) if k.startswith("grad/")]
    assert grads == ["grad/block/op00.matmul"]
    h = x @ model.block.w
    out = torch.softmax(h, -1) * 2
    v = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (want,) = torch.autograd.grad(out, h, v)
    torch.testing.assert_close(dump["grad/block/op00.matmul"], want)


class _ScaleInPlace(nn.Module):
    """`h = x @ w`, then in place: a view of it tripled, its first row zeroed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        flat = h.view(-1)
        flat.mul_(3)
        h[0] = 0.0
        return h


def test_gradients_of_in_place_ops_are_wrt_the_value_each_produced(tmp_path) -> None:
    torch.manual_seed(0)
    model = Net(_ScaleInPlace()).eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    path = modeltap.grads(model, x, tmp_path / "g.safetensors", include=["block"], ops=True)
    dump = load_dump(path)
    ops = list(json.loads(dump.metadata["ops"]))
    assert ops == ["block/op00.matmul", "block/op01.view", "block/op02.mul_",
                   "block/op03.setitem"]
    # plain torch, out of place: each value a tensor of its own
    h0 = x @ model.block.w
    h1 = h0 * 3
    h2 = torch.cat([torch.zeros_like(h1[:1]), h1[1:]])
    out = model.head(h2)
    g0, g2 = torch.autograd.grad(out, (h0, h2), torch.ones_like(out))
    torch.testing.assert_close(dump["block/op00.matmul"], h0.detach())
    torch.testing.assert_close(dump["grad/block/op00.matmul"], g0)
    torch.testing.assert_close(dump["grad/block/op03.setitem"], g2)
    torch.testing.assert_close(dump["block/op02.mul_"], h1.detach().reshape(-1))
    # A view that is then changed in place leaves the graph (its base's history is rewritten):
    # plain torch has no gradient w.r.t. it either, and the dump says so.
    h = x @ model.block.w
    flat = h.view(-1)
    flat.mul_(3)
    h[0] = 0.0
    out = model.head(h)
    assert torch.autograd.grad(out.sum(), flat, allow_unused=True) == (None,)
    no_path = json.loads(dump.metadata["grad"])["no_path"]
    assert no_path == {"block/op01.view": "no path", "block/op02.mul_": "no path"}


def test_grads_ops_with_no_module_getting_gradients_is_refused(tmp_path) -> None:
    from modeltap.errors import InputError

    model, (x,) = build_softmax()
    with pytest.raises(InputError, match="--ops: no module gets gradients"):
        modeltap.grads(model, {"x": x}, tmp_path / "g.safetensors", wrt=["x"], ops=True)
    assert not (tmp_path / "g.safetensors").exists()


def test_dump_grads_ops_refused_under_compile() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.ops_models:build_softmax", "--grads",
                            "--ops", "--compile", "-o", "x.safetensors"])
    assert r.exit_code == 2, r.output
    assert "--ops sees the torch functions" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not Path("x.safetensors").exists()


def test_dump_grads_ops_holds_activations_ops_and_their_gradients() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.ops_models:build_softmax", "--grads",
                            "--ops", "--include", "block", "-o", "d.safetensors"])
    assert r.exit_code == 0, r.output
    dump = load_dump("d.safetensors")
    model, (x,) = build_softmax()
    h = x @ model.block.w
    p = torch.softmax(h, -1)
    out = model.head(p * 2)
    (want,) = torch.autograd.grad(out, p, torch.ones_like(out))
    torch.testing.assert_close(dump["grad/block/op01.softmax"], want)
    torch.testing.assert_close(dump["block"], (p * 2).detach())
