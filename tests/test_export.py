"""torch.export backend and .pt2 archives: eager keys, exact values, the pickle pre-scan."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modeltap.capture import MemorySink, capture
from modeltap.capture.backend import RunRequest
from modeltap.capture.export import (
    ExportBackend,
    export_program,
    flat_inputs,
    module_names,
    skeleton,
)
from modeltap.cli import app
from modeltap.errors import InputError
from modeltap.loading.archive import load_pt2, scan_pt2
from tests.fixtures.backends import OTHER_GRAPH, nested, read_dump

runner = CliRunner()


def _run(path: Path, args: tuple, kwargs: dict) -> tuple[MemorySink, object]:
    program = load_pt2(path)
    tree = skeleton(module_names(program))
    names = [n or "__root__" for n, _ in tree.named_modules()]
    sink = MemorySink()
    done = ExportBackend(program).run(RunRequest(tree, names, sink, args, kwargs))
    return sink, done


def _assert_exact(sink: MemorySink, done, want) -> None:
    rec = done.recorder
    assert set(rec.order) == set(want.keys())
    for key in want.keys():
        got = sink.tensors[rec.aliases.get(key, key)]
        torch.testing.assert_close(got, want[key], **OTHER_GRAPH, msg=key)


def test_nested_module_exports_with_eager_keys_and_exact_values(tmp_path: Path) -> None:
    model = nested()
    x = torch.randn(2, 5, 4)
    torch.export.save(export_program(model, (x,), {}), tmp_path / "n.pt2")
    other = torch.randn(3, 7, 4)  # dynamic batch and sequence
    sink, done = _run(tmp_path / "n.pt2", (other,), {})
    want = capture(model, other)
    _assert_exact(sink, done, want)
    assert done.recorder.order == want.keys()  # shared, shared@1, shared@2 in call order
    # the in-place `h += 1` after norm returned, and ReLU(inplace) after head, don't leak in
    head = model.head(want["norm"] + 1.0)
    torch.testing.assert_close(sink.tensors["head"], head, **OTHER_GRAPH)
    assert done.unmapped == ["blocks"]  # a ModuleList is never called


def test_tiny_bert_cli_export_then_dump_equals_eager(bert_dir: Path) -> None:
    texts = ["hello world", "a second sentence about the model"]
    r = runner.invoke(app, ["export", str(bert_dir), *texts, "-o", "m.pt2"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["dump", str(bert_dir), *texts, "-o", "eager.safetensors"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["dump", "m.pt2", "-o", "exported.safetensors"])  # example inputs
    assert r.exit_code == 0, r.output
    eager, _ = read_dump("eager.safetensors")
    exported, meta = read_dump("exported.safetensors")
    assert set(exported) == set(eager) and len(eager) == 46
    for key, value in eager.items():
        torch.testing.assert_close(exported[key], value, **OTHER_GRAPH, msg=key)
    assert meta["backend"] == "export"
    # other inputs through the dynamic dims, tokenized with the model's tokenizer
    r = runner.invoke(
        app,
        ["dump", "m.pt2", "the quick brown fox jumps over the lazy dog", "--tokenizer"]
        + [str(bert_dir), "-o", "longer.safetensors"],
    )
    assert r.exit_code == 0, r.output
    longer, _ = read_dump("longer.safetensors")
    assert longer["encoder.layer.1"].shape[1] > eager["encoder.layer.1"].shape[1]
    r = runner.invoke(app, ["ls", "m.pt2"])
    assert r.exit_code == 0 and "BertEncoder" in r.output


def test_gpt2_without_cache_exports_exactly(gpt2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpt2_dir, use_cache=False).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    torch.export.save(export_program(model, (), kwargs), tmp_path / "g.pt2")
    sink, done = _run(tmp_path / "g.pt2", (), kwargs)
    want = capture(model, **kwargs)
    _assert_exact(sink, done, want)


def test_static_export_refuses_other_shapes(tmp_path: Path) -> None:
    model = nested()
    torch.export.save(
        export_program(model, (torch.randn(2, 5, 4),), {}, dynamic=False), tmp_path / "s.pt2"
    )
    with pytest.raises(Exception, match="static size 5.*re-export with dynamic shapes"):
        _run(tmp_path / "s.pt2", (torch.randn(2, 6, 4),), {})


def _crafted_pt2(tmp_path: Path, marker: Path) -> Path:
    """A real .pt2 whose sample inputs are replaced by a pickle that creates `marker`."""

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    good = tmp_path / "good.pt2"
    torch.export.save(export_program(nested(), (torch.randn(2, 5, 4),), {}), good)
    bad = tmp_path / "bad.pt2"
    buffer = io.BytesIO()
    torch.save(Payload(), buffer, _use_new_zipfile_serialization=True)
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if "/data/sample_inputs/" in item.filename:
                data = buffer.getvalue()
            dst.writestr(item, data)
    return bad


def test_crafted_pickle_archive_is_refused_before_anything_is_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = _crafted_pt2(tmp_path, marker)
    assert scan_pt2(bad).needs_pickle
    r = runner.invoke(app, ["dump", str(bad), "-o", "x.safetensors"])
    assert r.exit_code == 2
    assert "needs a full unpickle" in r.output and "--allow-pickle" in r.output
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["ls", str(bad)])
    assert r.exit_code == 2
    assert not marker.exists()
    assert not Path("x.safetensors").exists()
    # no config file or environment variable can switch the check off
    Path("modeltap.toml").write_text("allow_pickle = true\n")
    r = runner.invoke(app, ["dump", str(bad), "-o", "x.safetensors"])
    assert r.exit_code == 2 and not marker.exists()
    Path("modeltap.toml").unlink()
    # the scan is what stood in the way: with --allow-pickle torch.export.load runs the payload
    r = runner.invoke(app, ["dump", str(bad), "--allow-pickle", "-o", "x.safetensors"])
    assert marker.exists()
    assert not Path("x.safetensors").exists()


def test_use_pickle_weights_are_refused(tmp_path: Path) -> None:
    good = tmp_path / "good.pt2"
    torch.export.save(export_program(nested(), (torch.randn(2, 5, 4),), {}), good)
    bad = tmp_path / "weights.pt2"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("weights_config.json"):
                config = json.loads(data)
                first = next(iter(config["config"]))
                config["config"][first]["use_pickle"] = True
                data = json.dumps(config).encode()
            dst.writestr(item, data)
    assert any("use_pickle" not in s for s in scan_pt2(bad).needs_pickle)
    r = runner.invoke(app, ["dump", str(bad), "-o", "x.safetensors"])
    assert r.exit_code == 2 and "needs a full unpickle" in r.output


def test_wrong_archive_kinds_are_one_line_errors(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "weights.pt")
    r = runner.invoke(app, ["dump", str(tmp_path / "weights.pt"), "-o", "x.safetensors"])
    assert r.exit_code == 2 and "torch.save file, not a model archive" in r.output
    (tmp_path / "text.pt2").write_text("not a zip")
    r = runner.invoke(app, ["dump", str(tmp_path / "text.pt2"), "-o", "x.safetensors"])
    assert r.exit_code == 2 and "not a zip archive" in r.output
    assert not Path("x.safetensors").exists()


def test_a_model_that_cannot_be_exported_says_why() -> None:
    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(Exception, match="torch.export can't export DataDependent") as info:
        export_program(DataDependent(), (torch.randn(2, 3),), {})
    assert info.value.exit_code == 2


@pytest.mark.slow
def test_minilm_exports_exactly(minilm_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_dir).eval()
    batch = dict(
        AutoTokenizer.from_pretrained(minilm_dir)(
            ["hello world", "a longer second sentence"], return_tensors="pt", padding=True
        )
    )
    torch.export.save(export_program(model, (), batch), tmp_path / "m.pt2")
    sink, done = _run(tmp_path / "m.pt2", (), batch)
    want = capture(model, **batch)
    assert len(want.keys()) == 114
    _assert_exact(sink, done, want)


def test_archive_without_preserved_signatures_maps_modules_from_their_scopes(
    tmp_path: Path,
) -> None:
    model = nested()
    x = torch.randn(2, 5, 4)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "plain.pt2")  # made elsewhere
    sink, done = _run(tmp_path / "plain.pt2", (x,), {})
    want = capture(model, x)
    _assert_exact(sink, done, want)
    assert done.details["inferred_from_scopes"] == 11  # all modules but the root and `blocks`


def test_bert_program_without_signatures_maps_structured_outputs_with_the_eager_record(
    bert_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModel

    from modeltap.capture.structure import record_outputs

    model = AutoModel.from_pretrained(bert_dir).eval()
    ids = torch.tensor([[2, 10, 20, 30, 3], [2, 11, 12, 3, 0]])
    kwargs = {"input_ids": ids, "attention_mask": (ids > 0).long()}
    program = torch.export.export(model, (), kwargs, strict=False)  # made elsewhere
    torch.export.save(program, tmp_path / "plain.pt2")
    want = capture(model, **kwargs)
    # the graph alone: a (tensor, None) tuple or a ModelOutput is a bare value
    sink, done = _run(tmp_path / "plain.pt2", (), kwargs)
    assert done.details["output_record"] is False
    assert "encoder" in done.recorder.order and "encoder:last_hidden_state" in want.keys()
    assert len(set(done.recorder.order) & set(want.keys())) == 41
    # with the eager model's record, every key and value of the eager dump
    program = load_pt2(tmp_path / "plain.pt2")
    tree = skeleton(module_names(program))
    sink = MemorySink()
    names = [n or "__root__" for n, _ in tree.named_modules()]
    backend = ExportBackend(program, outputs=record_outputs(model, (), kwargs))
    done = backend.run(RunRequest(tree, names, sink, (), kwargs))
    assert len(want.keys()) == 46
    _assert_exact(sink, done, want)
    assert done.details["output_record"] is True and "structure_unmatched" not in done.details


def _ls_rows(output: str) -> list[tuple[str, str, int]]:
    """(short name, class, params) of each row of `modeltap ls`."""
    rows = []
    for line in output.splitlines()[1:]:
        *_, name, cls, params = line.split()
        rows.append((name, cls, int(params.replace(",", ""))))
    return rows


def _eager_rows(model: torch.nn.Module) -> list[tuple[str, str, int]]:
    return [
        (
            name.rpartition(".")[2] or "__root__",
            type(m).__name__,
            sum(p.numel() for p in m.parameters()),
        )
        for name, m in model.named_modules()
    ]


def test_ls_of_an_archive_shows_the_eager_classes_and_parameter_counts(tmp_path: Path) -> None:
    model = nested()
    x = torch.randn(2, 5, 4)
    # exported elsewhere: no record of the classes; `blocks` is never called
    torch.export.save(torch.export.export(model, (x,), strict=False), tmp_path / "plain.pt2")
    torch.jit.save(torch.jit.trace(model, (x,)), tmp_path / "traced.pt")
    want = sorted(_eager_rows(model))
    assert ("blocks", "ModuleList", sum(p.numel() for p in model.blocks.parameters())) in want
    for name in ("plain.pt2", "traced.pt"):
        r = runner.invoke(app, ["ls", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        assert sorted(_ls_rows(r.stdout)) == want, name


def test_ls_of_an_exported_bert_matches_the_eager_model(bert_dir: Path) -> None:
    from transformers import AutoModel

    r = runner.invoke(app, ["export", str(bert_dir), "hello world", "-o", "b.pt2"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["ls", "b.pt2"])
    assert r.exit_code == 0, r.output
    model = AutoModel.from_pretrained(bert_dir)
    assert sorted(_ls_rows(r.stdout)) == sorted(_eager_rows(model))


def test_one_text_exports_a_dynamic_batch_that_two_texts_then_run(bert_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    r = runner.invoke(app, ["export", str(bert_dir), "hello world", "-o", "one.pt2"])
    assert r.exit_code == 0, r.output
    assert "dynamic batch and sequence dims" in r.stderr
    assert "specialized" not in r.output  # torch's own warning for a fixed dim
    texts = ["hello world", "a second sentence about the model"]
    r = runner.invoke(
        app, ["dump", "one.pt2", *texts, "--tokenizer", str(bert_dir), "-o", "two.safetensors"]
    )
    assert r.exit_code == 0, r.output
    got, _ = read_dump("two.safetensors")
    model = AutoModel.from_pretrained(bert_dir).eval()
    tok = AutoTokenizer.from_pretrained(bert_dir)
    with torch.no_grad():
        want = model(**tok(texts, padding=True, return_tensors="pt"))
    for part in ("last_hidden_state", "pooler_output"):
        torch.testing.assert_close(got[f"__root__:{part}"], want[part], atol=1e-6, rtol=1e-5)
    # the archive keeps the example it was given: a batch of one
    r = runner.invoke(app, ["dump", "one.pt2", "-o", "example.safetensors"])
    assert r.exit_code == 0, r.output
    assert read_dump("example.safetensors")[0]["__root__:last_hidden_state"].shape[0] == 1
    # an archive's text is cut to --max-length as a model's is
    r = runner.invoke(
        app,
        ["dump", "one.pt2", "the quick brown fox jumps over", "--tokenizer", str(bert_dir)]
        + ["--max-length", "3", "-o", "cut.safetensors"],
    )
    assert r.exit_code == 0, r.output
    assert read_dump("cut.safetensors")[0]["__root__:last_hidden_state"].shape[:2] == (1, 3)


def test_export_names_the_dims_that_stayed_static(caplog: pytest.LogCaptureFixture) -> None:
    from modeltap.capture.export import describe_shapes

    model = nested()
    one_token = export_program(model, (torch.randn(1, 1, 4),), {})
    assert describe_shapes(one_token) == (
        "dynamic batch dim; static x dim 1 (torch.export fixed the example's size)"
    )
    assert not [r for r in caplog.records if r.name.startswith("torch._export")]
    assert describe_shapes(export_program(model, (torch.randn(1, 3, 4),), {})) == (
        "dynamic batch and sequence dims"
    )
    assert describe_shapes(export_program(model, (torch.randn(2, 3, 4),), {}, dynamic=False)) == (
        "static shapes"
    )
    with pytest.raises(InputError, match="torch.export fixed that dim to the example's size 1"):
        flat_inputs(one_token, (torch.randn(1, 3, 4),), {})


@pytest.mark.parametrize("name", ["m.pt2", "m.pt"])
def test_the_export_verb_writes_an_archive_that_runs_as_the_eager_model(
    tmp_path: Path, name: str
) -> None:
    # modeltap.export(model, inputs, path): the library verb `modeltap export` calls
    import modeltap
    from modeltap.loading import Inputs

    torch.manual_seed(0)
    model = nested().eval()
    x = torch.randn(2, 5, 4)
    done = modeltap.export(model, x, tmp_path / name)
    assert done.path == tmp_path / name and done.traced == name.endswith(".pt")
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left
    other = torch.randn(2, 5, 4)
    if done.traced:
        got = torch.jit.load(str(done.path))(other)
    else:
        assert done.signatures > 0
        got = torch.export.load(str(done.path)).module()(other)
    with torch.no_grad():
        want = model(other)
    torch.testing.assert_close(got, want, **OTHER_GRAPH)
    with pytest.raises(InputError, match="must end in .pt2"):
        modeltap.export(model, Inputs((x,), {}, {}), tmp_path / "m.onnx")
