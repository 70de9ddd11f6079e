"""`dump --ops` beyond the eager torch functions (#32): the aten ops each op ran, and the ops of an
exported program or FX GraphModule (its graph nodes, capture/graph_ops.py), each value equal to
plain torch computed here."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

import modeltap
from modeltap.cli import app
from modeltap.dump import load_dump
from tests.fixtures import ops_models
from tests.fixtures.ops_models import build_softmax

runner = CliRunner()


def _line_of(text: str, obj: object) -> str:
    lines, start = inspect.getsourcelines(obj)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return f"{inspect.getsourcefile(obj)}:{start + index}"


class _AtenLog(TorchDispatchMode):
    """The aten ops a block runs, as torch dispatches them here (independent of modeltap)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _aten_of(call) -> list[str]:  # type: ignore[no-untyped-def]
    log = _AtenLog()
    with torch.no_grad(), log:
        call()
    return log.names


def test_each_op_names_the_aten_ops_it_ran(tmp_path: Path) -> None:
    model, (x,) = build_softmax()
    path = modeltap.dump(model, x, tmp_path / "d.safetensors", include=["block", "head"], ops=True)
    ops = json.loads(load_dump(path).metadata["ops"])
    w = model.block.w.detach()
    h = x @ w
    softmax = _aten_of(lambda: torch.softmax(h, -1))
    assert "aten._softmax" in softmax  # what torch 2.13 dispatches on CPU
    assert ops["block/op01.softmax"]["aten"] == softmax
    assert ops["block/op00.matmul"]["aten"] == _aten_of(lambda: x @ w)
    head = model.head
    linear = _aten_of(lambda: torch.nn.functional.linear(h, head.weight, head.bias))
    assert ops["head/op00.linear"]["aten"] == linear and ops["head/op00.linear"]["op"] == (
        "torch.nn.functional.linear"
    )
    # shown by `show --json`, each op's entry with its metadata
    r = runner.invoke(app, ["show", str(path), "--json"])
    assert r.exit_code == 0, r.output
    entries = {t["key"]: t for t in json.loads(r.stdout)["tensors"]}
    assert entries["block/op01.softmax"]["op"]["aten"] == softmax
    assert entries["block/op01.softmax"]["op"]["op"] == "torch.softmax"
    assert "op" not in entries["block"]


def _assert_softmax_ops(dump: Any, ops: dict, model: Any, x: torch.Tensor) -> None:
    """The graph's ops of the block: keyed as eager, values and source lines from plain torch."""
    assert [k for k in ops if k.startswith("block/")] == [
        "block/op00.matmul", "block/op01.softmax", "block/op02.mul"
    ]
    w = model.block.w.detach()
    want = torch.softmax(x @ w, -1)
    torch.testing.assert_close(dump["block/op01.softmax"], want)
    torch.testing.assert_close(dump["block/op00.matmul"], x @ w)
    torch.testing.assert_close(dump["block/op02.mul"], want * 2)
    torch.testing.assert_close(dump["block"], want * 2)
    forward = ops_models.SoftmaxBlock.forward
    assert ops["block/op01.softmax"]["source"] == _line_of("torch.softmax(h, -1)", forward)
    assert ops["block/op00.matmul"]["source"] == _line_of("h = x @ self.w", forward)
    h = x @ w
    assert ops["block/op01.softmax"]["aten"] == _aten_of(lambda: torch.softmax(h, -1))
    assert ops["block/op01.softmax"]["inputs"] == [[[3, 4], "float32"]]
    order = json.loads(dump.metadata["order"])
    assert order.index("block/op02.mul") < order.index("block")  # a module's ops before it


def test_export_ops_are_graph_nodes_with_their_stack_trace_line(tmp_path: Path) -> None:
    from modeltap.capture.export import export_program

    model, (x,) = build_softmax()
    torch.export.save(export_program(model, (x,), {}), tmp_path / "m.pt2")
    out = tmp_path / "e.safetensors"
    r = runner.invoke(app, ["dump", str(tmp_path / "m.pt2"), "--ops", "--include", "block",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    dump = load_dump(out)
    ops = json.loads(dump.metadata["ops"])
    assert dump.metadata["backend"] == "export"
    _assert_softmax_ops(dump, ops, model, x)
    assert ops["block/op01.softmax"]["op"] == "aten.softmax.int"
    assert ops["block/op01.softmax"]["node"] == "softmax"


def test_fx_ops_are_graph_nodes_with_their_stack_trace_line() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.graph_ops:build_fx_softmax", "--ops",
                            "--include", "block", "--include", "__root__", "-o", "fx.safetensors"])
    assert r.exit_code == 0, r.output
    dump = load_dump("fx.safetensors")
    ops = json.loads(dump.metadata["ops"])
    model, (x,) = build_softmax()
    _assert_softmax_ops(dump, ops, model, x)
    assert ops["block/op01.softmax"]["op"] == "torch.softmax"
    # the head, a leaf Linear not selected, is one node: an op of the root named for its class
    assert ops["__root__/op00.linear"]["op"] == "Linear (head)"
    want = model.head(torch.softmax(x @ model.block.w, -1) * 2).detach()
    torch.testing.assert_close(dump["__root__/op00.linear"], want)


def test_ops_under_compile_are_refused_naming_the_eager_ops() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.ops_models:build_softmax", "--ops",
                            "--compile", "-o", "c.safetensors"])
    assert r.exit_code == 2, r.output
    said = r.output.strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said
    assert "the ops are the eager ones" in said and "drop --compile" in said
    assert not Path("c.safetensors").exists()


def test_ops_with_nothing_selected_is_one_line() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.ops_models:build_softmax", "--ops",
                            "--exclude", "*", "-o", "n.safetensors"])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert "keeps no module" in r.output
    assert not Path("n.safetensors").exists()
