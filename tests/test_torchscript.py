"""TorchScript archives: module outputs read from the inlined graph under the eager keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from modeltap.capture import capture
from modeltap.capture.torchscript import save_traced
from modeltap.cli import app
from tests.fixtures.backends import OTHER_GRAPH, nested, read_dump

runner = CliRunner()


def test_traced_and_scripted_archives_dump_the_eager_keys_exactly(tmp_path: Path) -> None:
    model = nested()
    x = torch.randn(2, 5, 4)
    save_file({"x": x}, tmp_path / "x.safetensors")
    # the very tensor the CLI reads: a copy at another address may take another kernel path
    want = capture(model, load_file(tmp_path / "x.safetensors")["x"])
    eager = {k: want[k] for k in want.keys()}
    torch.jit.save(torch.jit.trace(model, (x,)), tmp_path / "traced.pt")
    torch.jit.save(torch.jit.script(model), tmp_path / "scripted.pt")
    save_traced(model, (x,), {}, tmp_path / "recorded.pt")
    for name in ("traced.pt", "scripted.pt", "recorded.pt"):
        out = f"{name}.safetensors"
        r = runner.invoke(
            app,
            ["dump", str(tmp_path / name), "--input-file", str(tmp_path / "x.safetensors")]
            + ["-o", out],
        )
        assert r.exit_code == 0, r.output
        got, meta = read_dump(out)
        assert set(got) == set(eager), name
        for key, value in eager.items():
            torch.testing.assert_close(got[key], value, **OTHER_GRAPH, msg=f"{name} {key}")
        assert meta["backend"] == "torchscript"
        assert meta["unmapped"] == '["blocks"]'  # the ModuleList, never called
        r = runner.invoke(app, ["ls", str(tmp_path / name)])
        assert r.exit_code == 0 and "Block" in r.output and "LayerNorm" in r.output


def _eager_and_traced(model_dir: Path, texts: list[str], traced: str) -> tuple[dict, dict, dict]:
    """Eager dump of the model and dump of the archive, through the CLI, read with safetensors."""
    r = runner.invoke(app, ["dump", str(model_dir), *texts, "-o", "eager.safetensors"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["dump", traced, *texts, "--tokenizer", str(model_dir), "-o", "traced.safetensors"]
    )
    assert r.exit_code == 0, r.output
    eager, _ = read_dump("eager.safetensors")
    got, meta = read_dump("traced.safetensors")
    return eager, got, meta


def _assert_same(eager: dict, got: dict) -> None:
    assert set(got) == set(eager)
    for key, value in eager.items():
        torch.testing.assert_close(got[key], value, **OTHER_GRAPH, msg=key)


def test_traced_bert_from_export_dumps_the_eager_keys_exactly(bert_dir: Path) -> None:
    texts = ["hello world", "a second sentence about the model"]
    r = runner.invoke(app, ["export", str(bert_dir), *texts, "-o", "m.pt"])
    assert r.exit_code == 0, r.output
    assert "TorchScript trace" in r.output
    eager, got, meta = _eager_and_traced(bert_dir, texts, "m.pt")
    # (tensor, None) tuples and the encoder's ModelOutput keep their `:part`s
    assert {"encoder:last_hidden_state", "encoder.layer.0.attention.self:0"} <= set(got)
    assert len(eager) == 46
    _assert_same(eager, got)
    details = json.loads(meta["backend_details"])
    assert meta["backend"] == "torchscript" and details["output_record"] is True
    assert "structure_unmatched" not in details and "parts_not_in_graph" not in details


def test_bert_traced_elsewhere_says_its_keys_follow_the_graph(bert_dir: Path) -> None:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(bert_dir).eval()
    ids = torch.tensor([[2, 10, 20, 30, 3], [2, 11, 12, 3, 0]])
    mask = (ids > 0).long()
    torch.jit.save(torch.jit.trace(model, (ids, mask), strict=False), "plain.pt")
    save_file({"input_ids": ids, "attention_mask": mask}, "ids.safetensors")
    r = runner.invoke(
        app, ["dump", "plain.pt", "--input-file", "ids.safetensors", "-o", "p.safetensors"]
    )
    assert r.exit_code == 0, r.output
    assert "no record of the modules' eager output structure" in " ".join(r.output.split())
    got, meta = read_dump("p.safetensors")
    assert json.loads(meta["backend_details"])["output_record"] is False
    want = capture(model, input_ids=ids, attention_mask=mask)
    for key in set(got) & set(want.keys()):
        torch.testing.assert_close(got[key], want[key], **OTHER_GRAPH, msg=key)
    # without the record a (tensor, None) tuple or a ModelOutput is keyed by its bare value
    assert "encoder" in got and "encoder:last_hidden_state" not in got


def test_traced_gpt2_without_cache_dumps_the_eager_keys_exactly(gpt2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpt2_dir, use_cache=False).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    save_file({"input_ids": ids}, "ids.safetensors")
    ids = load_file("ids.safetensors")["input_ids"]
    save_traced(model, (), {"input_ids": ids}, "g.pt")
    want = capture(model, input_ids=ids)
    r = runner.invoke(app, ["dump", "g.pt", "--input-file", "ids.safetensors", "-o", "g.st"])
    assert r.exit_code == 0, r.output
    got, _ = read_dump("g.st")
    assert len(want.keys()) == 31  # GPT2LMHeadModel: the body, lm_head and the root
    _assert_same({k: want[k] for k in want.keys()}, got)


class _Pair(nn.Module):
    """Returns its values in another order than it computes them, with a None between."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        a = self.lin(x)
        b = a * 2.0
        return b, None, a


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()

    def forward(self, x: torch.Tensor) -> dict:
        b, _, a = self.pair(x)
        return {"sum": a + b, "first": b}


def test_tuple_values_map_by_the_order_they_were_computed_in() -> None:
    torch.manual_seed(0)
    model = _Outer().eval()
    x = torch.randn(3, 4)
    save_file({"x": x}, "x.safetensors")
    x = load_file("x.safetensors")["x"]
    save_traced(model, (x,), {}, "pair.pt")
    r = runner.invoke(app, ["dump", "pair.pt", "--input-file", "x.safetensors", "-o", "p.st"])
    assert r.exit_code == 0, r.output
    got, _ = read_dump("p.st")
    a = torch.nn.functional.linear(x, model.pair.lin.weight, model.pair.lin.bias)
    assert set(got) == {"pair.lin", "pair:0", "pair:2", "__root__:sum", "__root__:first"}
    torch.testing.assert_close(got["pair:0"], a * 2.0, **OTHER_GRAPH)  # b, computed second
    torch.testing.assert_close(got["pair:2"], a, **OTHER_GRAPH)
    torch.testing.assert_close(got["__root__:sum"], a + a * 2.0, **OTHER_GRAPH)


def test_frozen_archive_without_hierarchy_is_a_one_line_error(tmp_path: Path) -> None:
    model = nested()
    x = torch.randn(2, 5, 4)
    torch.jit.save(torch.jit.freeze(torch.jit.script(model)), tmp_path / "frozen.pt")
    save_file({"x": x}, tmp_path / "x.safetensors")
    r = runner.invoke(
        app,
        ["dump", str(tmp_path / "frozen.pt"), "--input-file", str(tmp_path / "x.safetensors")]
        + ["-o", "f.safetensors"],
    )
    assert r.exit_code == 2
    assert "no module hierarchy" in r.output and "Traceback" not in r.output
    assert not Path("f.safetensors").exists()


@pytest.mark.slow
def test_traced_minilm_dumps_the_eager_keys_exactly(minilm_dir: Path) -> None:
    texts = ["hello world", "a second sentence"]
    r = runner.invoke(app, ["export", str(minilm_dir), *texts, "-o", "m.pt"])
    assert r.exit_code == 0, r.output
    eager, got, _ = _eager_and_traced(minilm_dir, texts, "m.pt")
    assert len(eager) == 114
    _assert_same(eager, got)


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.lin(x) * mask * scale


def test_a_missing_input_is_named_with_what_the_archive_takes() -> None:
    model = _Masked().eval()
    x, mask = torch.randn(2, 3, 4), torch.ones(2, 3, 1)
    save_traced(model, (), {"x": x, "mask": mask}, "traced.pt")
    save_file({"x": x}, "x.safetensors")
    r = runner.invoke(app, ["dump", "traced.pt", "--input-file", "x.safetensors", "-o", "t.st"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert line == (
        "error: the TorchScript module in 'traced.pt' takes x, mask; mask is missing: give it "
        "by name in --input-file (or TEXT with a --tokenizer that makes it)"
    )
    assert not Path("t.st").exists()


def test_a_scripted_input_with_a_default_may_be_left_out() -> None:
    torch.manual_seed(0)
    model = _Masked().eval()
    torch.jit.save(torch.jit.script(model), "scripted.pt")
    x, mask = torch.randn(2, 3, 4), torch.rand(2, 3, 1)
    save_file({"x": x, "mask": mask}, "xm.safetensors")
    r = runner.invoke(app, ["dump", "scripted.pt", "--input-file", "xm.safetensors", "-o", "s.st"])
    assert r.exit_code == 0, r.output
    got, _ = read_dump("s.st")
    xm = load_file("xm.safetensors")
    lin = torch.nn.functional.linear(xm["x"], model.lin.weight, model.lin.bias)
    torch.testing.assert_close(got["lin"], lin, **OTHER_GRAPH)
    torch.testing.assert_close(got["__root__"], lin * xm["mask"] * 2.0, **OTHER_GRAPH)
