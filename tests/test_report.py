"""`modeltap report` and the histograms it shows: pages built from real dumps, diffs and runs,
checked against values computed in the test, then opened in headless Chromium."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

import modeltap
from modeltap.cli import app
from modeltap.dump import load_dump
from tests.test_record import Tiny, batch
from tests.test_stats import reference_hist

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def _hooked_outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every named module's output, captured by plain forward hooks."""
    seen: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: object, out: object, name: str) -> None:
        if isinstance(out, torch.Tensor):
            seen[name] = out.detach().clone()

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, a, out, name=name: keep(m, a, out, name))
    return seen


def test_dump_hist_stores_each_tensors_histogram(bert_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    result = invoke("dump", bert_dir, "hello world", "--hist", "--stats-only", "-o", "h.st")
    assert result.exit_code == 0, result.output
    dump = load_dump(tmp_path / "h.st")
    model = AutoModel.from_pretrained(bert_dir).eval()
    seen = _hooked_outputs(model)
    tok = AutoTokenizer.from_pretrained(bert_dir)
    with torch.no_grad():
        model(**tok(["hello world"], return_tensors="pt"))
    checked = 0
    for name, tensor in seen.items():
        if name in dump:
            assert dump.stats_for(name).hist == reference_hist(tensor), name
            checked += 1
    assert checked >= 10
    plain = invoke("dump", bert_dir, "hello world", "--stats-only", "-o", "p.st")
    assert plain.exit_code == 0
    assert all(s.hist is None for s in load_dump(tmp_path / "p.st").stats.values())


def test_record_hist_stores_each_steps_histograms(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    seen = _hooked_outputs(model)
    with modeltap.record(model, tmp_path / "run", every=1, grads=False, hist=True) as rec:
        for step in range(2):
            seen.clear()
            model(batch(step)).square().mean().backward()
            rec.step()
    dump = load_dump(tmp_path / "run" / "step000001.rank0.safetensors")
    assert {k: dump.stats_for(k).hist for k in seen} == {
        k: reference_hist(t) for k, t in seen.items()
    }
