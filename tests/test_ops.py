"""`dump --ops`: inside a selected module, every torch function its own code calls
(capture/ops.py), each value equal to plain torch computed here."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

import modeltap
from modeltap.cli import app
from modeltap.dump import load_dump
from tests.fixtures import ops_models
from tests.fixtures.ops_models import build_inplace, build_scaled, build_softmax

runner = CliRunner()
# transformers' log handler takes the sys.stderr of its first use: here, not a CliRunner's stream
# that is closed when its command returns (later tests' warnings would fail to print).
transformers.logging.get_verbosity()


def _line_of(text: str, obj: object) -> str:
    lines, start = inspect.getsourcelines(obj)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return f"{inspect.getsourcefile(obj)}:{start + index}"


def test_softmax_op_value_and_source_line() -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.ops_models:build_softmax", "--ops",
                            "--include", "block", "-o", "ops.safetensors"])
    assert r.exit_code == 0, r.output
    dump = load_dump("ops.safetensors")
    ops = json.loads(dump.metadata["ops"])
    assert list(ops) == ["block/op00.matmul", "block/op01.softmax", "block/op02.mul"]
    model, (x,) = build_softmax()
    w = model.block.w.detach()
    want = torch.softmax(x @ w, -1)
    torch.testing.assert_close(dump["block/op01.softmax"], want)
    torch.testing.assert_close(dump["block/op00.matmul"], x @ w)
    torch.testing.assert_close(dump["block"], want * 2)
    softmax = ops["block/op01.softmax"]
    assert softmax["op"] == "torch.softmax"
    assert softmax["source"] == _line_of("torch.softmax(h, -1)", ops_models.SoftmaxBlock.forward)
    assert softmax["inputs"] == [[[3, 4], "float32"]]
    assert not softmax["view"] and not softmax["inplace"]
    # the head is not selected: none of its ops, nor of the model's own code
    assert [k for k in dump.metadata["order"] if "head" in k] == []


def test_a_later_in_place_op_leaves_the_recorded_values(tmp_path) -> None:
    model, (x,) = build_inplace()
    path = modeltap.dump(model, x, tmp_path / "d.safetensors", include=["block"], ops=True)
    dump = load_dump(path)
    ops = json.loads(dump.metadata["ops"])
    assert list(ops) == [
        "block/op00.exp", "block/op01.view", "block/op02.mul_", "block/op03.setitem"
    ]
    h = torch.exp(x)
    torch.testing.assert_close(dump["block/op00.exp"], h)
    torch.testing.assert_close(dump["block/op01.view"], h.reshape(-1))
    tripled = h * 3
    torch.testing.assert_close(dump["block/op02.mul_"], tripled.reshape(-1))
    zeroed = tripled.clone()
    zeroed[0] = 0.0
    torch.testing.assert_close(dump["block/op03.setitem"], zeroed)
    assert ops["block/op01.view"]["view"] and not ops["block/op01.view"]["inplace"]
    assert ops["block/op02.mul_"]["inplace"] and ops["block/op03.setitem"]["inplace"]
    assert ops["block/op02.mul_"]["source"] == _line_of(
        "flat.mul_(3)", ops_models.ViewThenInPlace.forward
    )


def test_minilm_attention_probabilities_equal_output_attentions(minilm_dir, tmp_path) -> None:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
    batch = tok(["hello world", "ops inside attention"], return_tensors="pt", padding=True)
    module = "encoder.layer.2.attention.self"
    path = modeltap.dump(model, dict(batch), tmp_path / "m.safetensors", include=[module],
                         ops=True)
    with torch.no_grad():
        want = model(**batch, output_attentions=True).attentions[2]
    dump = load_dump(path)
    ops = json.loads(dump.metadata["ops"])
    (softmax,) = [k for k in ops if k.startswith(f"{module}/") and k.endswith(".softmax")]
    torch.testing.assert_close(dump[softmax], want)
    assert "modeling_bert.py" in ops[softmax]["source"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--compile"], "--ops sees the torch functions"),
    ],
)
def test_ops_refused_in_one_line(extra, message) -> None:
    r = runner.invoke(app, ["dump", "tests.fixtures.ops_models:build_softmax", "--ops",
                            *extra, "-o", "x.safetensors"])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not Path("x.safetensors").exists()


def test_ops_refused_for_a_torchscript_archive(tmp_path) -> None:
    from safetensors.torch import save_file

    model, (x,) = build_softmax()
    torch.jit.save(torch.jit.trace(model, (x,)), tmp_path / "m.pt")
    save_file({"x": x}, tmp_path / "x.safetensors")
    r = runner.invoke(app, ["dump", str(tmp_path / "m.pt"), "--input-file",
                            str(tmp_path / "x.safetensors"), "--ops", "-o", "ts.safetensors"])
    assert r.exit_code == 2, r.output
    assert "--ops sees the torch functions" in r.output and "torchscript" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not Path("ts.safetensors").exists()


def test_the_tree_shows_ops_under_their_module() -> None:
    from rich.console import Console

    from modeltap.render.tree import dump_table

    r = runner.invoke(app, ["dump", "tests.fixtures.ops_models:build_softmax", "--ops",
                            "--depth", "1", "-o", "t.safetensors"])
    assert r.exit_code == 0, r.output
    console = Console(width=100, color_system=None, record=True)
    console.print(dump_table(load_dump("t.safetensors"), width=100))
    lines = console.export_text().splitlines()
    labels = [line.split("3×4")[0].rstrip() for line in lines if "3×4" in line]
    assert labels == [
        "__root__",
        "├─ block",
        "│  ├─ /op00.matmul",
        "│  ├─ /op01.softmax",
        "│  └─ /op02.mul",
        "└─ head",
        "   └─ /op00.linear",
    ]


def test_diff_pairs_ops_around_an_added_op_and_names_the_first_diverging_one(tmp_path) -> None:
    from modeltap.diff import diff_dumps

    paths = []
    for name, build in (("a", build_softmax), ("b", build_scaled)):
        model, (x,) = build()
        dumped = modeltap.dump(model, x, tmp_path / f"{name}.safetensors", include=["block"],
                               ops=True)
        paths.append(dumped)
    report = diff_dumps(*paths)
    assert report.only_b == ["block/op01.mul"] and report.only_a == []
    paired = {p.key: p.other for p in report.pairs}
    assert paired["block/op00.matmul"] == "block/op00.matmul"
    assert paired["block/op01.softmax"] == "block/op02.softmax"
    assert paired["block/op02.mul"] == "block/op03.mul"
    first = report.first_divergence
    assert first is not None and first.key == "block/op01.softmax"
    w = model.block.w.detach()
    want = (torch.softmax(x @ w, -1) - torch.softmax(1.5 * (x @ w), -1)).abs().max().item()
    assert first.max_abs == pytest.approx(want, rel=1e-5)
    line = _line_of("torch.softmax(h, -1)", ops_models.SoftmaxBlock.forward)
    assert report.sources[first.key] == line
    assert report.to_json()["first_divergence_source"] == line

    r = runner.invoke(app, ["diff", str(paths[0]), str(paths[1])])
    assert r.exit_code == 1, r.output
    added = _line_of("h = h * 1.5", ops_models.ScaledSoftmaxBlock.forward)
    said = " ".join(r.output.split())  # however the console wrapped it
    assert f"op inserted in B: block/op01.mul at {added}" in said
    assert "first divergence: block/op01.softmax" in said and f"at {line}" in said


def test_compare_ops_names_the_line_that_cancels_in_bf16(tmp_path) -> None:
    from modeltap.compare import Options, compare_models, make_candidate, parse_against
    from modeltap.compare.ops import blame_ops
    from modeltap.diff import Tolerance
    from modeltap.loading import Inputs
    from tests.fixtures.ops_models import Cancelling, build_cancelling

    model, (x,) = build_cancelling()
    candidate = make_candidate(model, parse_against("bf16"), shared=True)
    inputs = Inputs((x,), {}, {})
    modules = ["inp", "block", "block.fc", "out"]
    bf16 = Options(tolerance=Tolerance(atol=1e-5, rtol=1.6e-2))  # torch.testing's for bf16
    report = compare_models(model, candidate, inputs, modules, tmp_path, options=bf16)
    assert report.origins[0].name == "block"
    blame = blame_ops(model, candidate, inputs, "block")
    worst = blame.worst
    lines = [_line_of(t, Cancelling.forward) for t in ("h + 4096.0", "big - 4096.0")]
    assert worst is not None and worst.source in lines
    # its error, against plain torch: the op run in bf16 from the float32 inputs it was given
    h = model.block.fc(torch.tanh(model.inp(x))).detach()
    big = h + 4096.0
    back = big.bfloat16() - 4096.0
    want = ((back.double() - (big - 4096.0).double()).norm() / (big - 4096.0).double().norm())
    assert worst.key == "block/op02.sub" and worst.error == pytest.approx(want.item(), rel=1e-6)
    others = [o.error for o in blame.ops if o is not worst]
    assert all(e is not None and e < worst.error / 10 for e in others)
    assert blame.path() == "block > op02.sub"


def test_compare_ops_in_the_cli_names_module_and_op(minilm_dir) -> None:
    r = runner.invoke(app, ["compare", str(minilm_dir), "hello world", "--against", "bf16",
                            "--ops", "--include", "encoder.layer.0.attention.self*",
                            "--preset", "exact", "--json"])
    assert r.exit_code == 1, r.output
    report = json.loads(r.stdout)
    worst = report["origins"][0]["module"]
    ops = report["ops"]
    assert ops["module"] == worst and ops["path"] == f"{worst} > {ops['op']['key'].split('/')[1]}"
    assert ops["op"]["error"] == max(o["error"] for o in ops["ops"] if o["error"] is not None)
    assert ops["op"]["source"].rpartition(":")[2].isdigit()
    text = runner.invoke(app, ["compare", str(minilm_dir), "hello world", "--against", "bf16",
                               "--ops", "--include", "encoder.layer.0.attention.self*",
                               "--preset", "exact"])
    assert f"op: {ops['path']}" in " ".join(text.output.split())


def test_compare_ops_refused_with_generate(minilm_dir) -> None:
    r = runner.invoke(app, ["compare", str(minilm_dir), "hi", "--against", "bf16", "--ops",
                            "--generate", "2"])
    assert r.exit_code == 2 and "--ops runs the eager variant's ops" in r.output, r.output
