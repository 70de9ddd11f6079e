"""MODEL as pkg.module:function: modules, (module, example inputs), and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modeltap.capture import capture
from modeltap.cli import app
from modeltap.errors import InputError
from modeltap.loading.factory import is_factory, load_factory
from tests.fixtures.backends import build_nested, build_nested_bf16, read_dump

runner = CliRunner()


def test_factory_with_example_inputs_dumps_like_eager() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.backends:build_nested", "-o", "f.safetensors"])
    assert r.exit_code == 0, r.output
    got, meta = read_dump("f.safetensors")
    model, (x,) = build_nested()
    want = capture(model, x)
    assert set(got) == set(want.keys())
    for key in want.keys():
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    assert meta["backend"] == "eager" and meta["model_class"] == "Nested"


def test_a_bfloat16_factorys_dump_says_bfloat16() -> None:
    spec = "tests.fixtures.backends:build_nested_bf16"
    r = runner.invoke(app, ["dump", spec, "-o", "b.safetensors"])
    assert r.exit_code == 0, r.output
    got, meta = read_dump("b.safetensors")
    model, (x,) = build_nested_bf16()
    assert meta["dtype"] == str(next(model.parameters()).dtype).removeprefix("torch.")
    assert "bfloat16" in r.output.splitlines()[0] and "float32" not in r.output.splitlines()[0]
    want: dict[str, torch.Tensor] = {}  # plain hooks on the bfloat16 model and input
    for name in ("embed", "head"):  # called once a forward
        model.get_submodule(name).register_forward_hook(  # returns None: the output is kept
            lambda m, a, out, name=name: want.__setitem__(name, out.detach().clone())
        )
    with torch.no_grad():
        want["__root__"] = model(x)
    for key, value in want.items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=key)


def test_factory_names() -> None:
    assert is_factory("tests.fixtures.backends:build_nested")
    assert not is_factory("bert-base-uncased") and not is_factory("./m")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_pkg.models:build", "can't import 'no_such_pkg.models'"),
        ("tests.fixtures.backends:missing", "has no function 'missing'"),
        ("tests.fixtures.backends:read_dump", "failed"),
        ("tests.fixtures.backends:_example", "returned Tensor; it must return an nn.Module"),
    ],
)
def test_bad_factories_are_one_line_errors(spec: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        load_factory(spec)
    r = runner.invoke(app, ["dump", spec, "-o", "x.safetensors"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert not Path("x.safetensors").exists()
