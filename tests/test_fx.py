"""FX backend: GraphModules from a factory, inlined modules named from nn_module_stack."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from modeltap.capture import capture
from modeltap.cli import app
from tests.fixtures.backends import build_nested, read_dump

runner = CliRunner()


def _dump(model: str, out: str) -> None:
    r = runner.invoke(app, ["dump", model, "-o", out])
    assert r.exit_code == 0, r.output


def test_traced_graph_module_has_the_eager_keys_and_values() -> None:
    _dump("tests.fixtures.backends:build_fx_nested", "fx.safetensors")
    got, meta = read_dump("fx.safetensors")
    model, (x,) = build_nested()
    want = capture(model, x)  # independent: eager hooks on the plain module
    assert set(got) == set(want.keys())
    for key in want.keys():
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    assert meta["backend"] == "fx"
    assert "blocks.0" in got and "shared@2" in got  # inlined Block, reused Linear


def test_diff_names_the_rewritten_activation_first() -> None:
    _dump("tests.fixtures.backends:build_nested", "eager.safetensors")
    _dump("tests.fixtures.backends:build_fx_tanh_gelu", "fx.safetensors")
    eager, _ = read_dump("eager.safetensors")
    fx, _ = read_dump("fx.safetensors")
    assert torch.equal(eager["blocks.0.act"], fx["blocks.0.act"])
    assert not torch.equal(eager["blocks.1.act"], fx["blocks.1.act"])
    r = runner.invoke(app, ["diff", "eager.safetensors", "fx.safetensors"])
    assert r.exit_code == 1
    assert "first divergence: blocks.1.act" in r.output
    assert not Path("x").exists()
