"""TorchScript archives: module outputs read from the inlined graph under the eager keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from modeltap.capture import MemorySink, capture
from modeltap.capture.torchscript import TorchScriptBackend
from modeltap.cli import app
from tests.fixtures.backends import nested, read_dump

runner = CliRunner()


def _ts_capture(script: torch.jit.ScriptModule, *args: torch.Tensor):
    names = [n or "__root__" for n, _ in script.named_modules()]
    sink = MemorySink()
    done = TorchScriptBackend(script, "x.pt").run(
        script, names, sink, args, {}, inputs=False, train_mode=False, seed=0
    )
    return {k: sink.tensors[done.recorder.aliases.get(k, k)] for k in done.recorder.order}, done


def test_traced_and_scripted_archives_dump_the_eager_keys_exactly(tmp_path: Path) -> None:
    model = nested()
    x = torch.randn(2, 5, 4)
    save_file({"x": x}, tmp_path / "x.safetensors")
    # the very tensor the CLI reads: a copy at another address may take another kernel path
    want = capture(model, load_file(tmp_path / "x.safetensors")["x"])
    eager = {k: want[k] for k in want.keys()}
    for name, script in (
        ("traced.pt", torch.jit.trace(model, (x,))),
        ("scripted.pt", torch.jit.script(model)),
    ):
        torch.jit.save(script, tmp_path / name)
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
            torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=f"{name} {key}")
        assert meta["backend"] == "torchscript"
        assert meta["unmapped"] == '["blocks"]'  # the ModuleList, never called
        r = runner.invoke(app, ["ls", str(tmp_path / name)])
        assert r.exit_code == 0 and "Block" in r.output and "LayerNorm" in r.output


def test_traced_bert_matches_eager_except_structured_outputs(bert_dir: Path) -> None:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(bert_dir).eval()
    ids = torch.tensor([[2, 10, 20, 30, 3], [2, 11, 12, 3, 0]])
    mask = (ids > 0).long()
    script = torch.jit.trace(model, (ids, mask), strict=False)
    got, _ = _ts_capture(script, ids, mask)
    want = capture(model, input_ids=ids, attention_mask=mask)
    for key in set(got) & set(want.keys()):
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    # a module returning (tensor, None) or a ModelOutput is traced to a bare tensor
    assert set(want.keys()) - set(got) == {
        "encoder:last_hidden_state",
        "encoder.layer.0.attention:0",
        "encoder.layer.0.attention.self:0",
        "encoder.layer.1.attention:0",
        "encoder.layer.1.attention.self:0",
    }
    assert len(set(got) & set(want.keys())) == 41


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
def test_traced_minilm_values_equal_eager(minilm_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_dir).eval()
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    batch = tok(["hello world", "a second sentence"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    got, done = _ts_capture(torch.jit.trace(model, (ids, mask), strict=False), ids, mask)
    want = capture(model, input_ids=ids, attention_mask=mask)
    common = set(got) & set(want.keys())
    for key in common:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    # the 6 layers' attention and self-attention tuples and the encoder's ModelOutput are bare
    assert len(set(want.keys()) - set(got)) == 13 and len(common) == 101
