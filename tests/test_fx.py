"""FX backend: GraphModules from a factory, inlined modules named from nn_module_stack."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from modeltap.capture import capture
from modeltap.cli import app
from tests.fixtures.backends import build_nested, read_dump
from tests.fixtures.fx_tuples import tuple_net

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


def _returned(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Independent reference: plain eager hooks, `name` or `name:i` for a tuple's parts."""
    values: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, out) -> None:
            parts = dict(enumerate(out)) if isinstance(out, tuple) else {None: out}
            for i, part in parts.items():
                values[name if i is None else f"{name}:{i}"] = part.detach().clone()

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    with torch.no_grad():
        out = model(x)
    for handle in handles:
        handle.remove()
    values.update({f"__root__:{i}": part for i, part in enumerate(out)})
    return values


def test_traced_tuple_outputs_get_the_eager_parts() -> None:
    r = runner.invoke(
        app, ["dump", "tests.fixtures.fx_tuples:build_traced", "-o", "fx.safetensors"]
    )
    assert r.exit_code == 0, r.output
    got, meta = read_dump("fx.safetensors")
    model, x = tuple_net()
    want = _returned(model, x)
    # (x + h, h): h is computed first, yet `:0` is x + h as eager returns it
    for key in ("blocks.0:0", "blocks.0:1", "blocks.1:1"):
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    # (x, h) passes its input x through: no value of the block's graph, listed, not invented
    assert "blocks.1" not in got and "blocks.1:0" not in got
    assert set(got) == set(want) - {"blocks.1:0"}
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], atol=0, rtol=0, msg=key)
    details = json.loads(meta["backend_details"])
    assert details["output_record"] is True
    assert details["parts_not_in_graph"] == ["blocks.1:0"]
    assert "1 value(s) not mapped onto the eager structure" in r.output


def test_plain_traced_tuple_outputs_are_flagged() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.fx_tuples:build_plain", "-o", "fx.safetensors"])
    assert r.exit_code == 0, r.output
    got, meta = read_dump("fx.safetensors")
    details = json.loads(meta["backend_details"])
    assert details["output_record"] is False
    assert details["parts_in_graph_order"] == ["blocks.0"]
    assert "blocks.1" in got  # one value left the block: its bare key
    assert "note: this GraphModule has no record of the modules' eager output structure" in (
        r.output
    )
