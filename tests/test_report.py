"""`modeltap report` and the histograms it shows: pages built from real dumps, diffs and runs,
checked against values computed in the test, then opened in headless Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import modeltap
from modeltap.cli import app
from modeltap.dump import load_dump
from tests.fixtures.browser import OpenPage, launch_chromium
from tests.test_record import Tiny, batch
from tests.test_stats import reference_hist

runner = CliRunner()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    yield from launch_chromium()


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


# --- the pages, opened in Chromium --------------------------------------------------------------


def _tiny_dump(path: Path, *, poison: bool) -> dict[str, torch.Tensor]:
    """A dump of test_record's Tiny with histograms (fc2 writing a NaN when `poison`), and every
    module's output as plain hooks saw it."""
    from modeltap.loading import Inputs
    from modeltap.run import dump_model

    torch.manual_seed(0)
    model = Tiny().eval()
    model.fc2.on = poison
    seen = _hooked_outputs(model)
    x = batch(0)
    dump_model(model, Inputs((x,), {}, {"test": True}), path, hist=True)
    seen.clear()
    with torch.no_grad():
        model(x)
    return dict(seen)


def test_dump_page_draws_the_dumps_values(chromium, tmp_path: Path) -> None:
    seen = _tiny_dump(tmp_path / "tiny.safetensors", poison=True)
    result = invoke("report", "tiny.safetensors", "-o", "out/dump.html")
    assert result.exit_code == 0, result.output
    page = OpenPage(chromium, tmp_path / "out" / "dump.html")
    try:
        assert page.errors == []
        charts = page.charts()
        keys = load_dump(tmp_path / "tiny.safetensors").keys()
        modules = [k for k in keys if k in seen]
        # Norms along the execution order (of the finite values), as torch computes them.
        drawn = dict(zip(keys, charts["act-norm"][0]["y"], strict=True))
        for name in modules:
            t = seen[name].double()
            norm = float(t[t.isfinite()].norm())
            assert drawn[name] == pytest.approx(norm, rel=1e-6), name
        assert page.drawn("act-norm") == len(keys) + 5  # every point, and the NaN/Inf marks
        # NaN/Inf: the marked points and the red rows are the modules whose output has NaN.
        poisoned = {n for n in modules if seen[n].isnan().any()}
        assert poisoned >= {"fc2", "gate", "tanh", "head"}
        assert set(charts["act-norm"][1]["x"]) == {keys.index(n) for n in poisoned} | {
            keys.index(k)
            for k in keys
            if k not in seen  # the root: Tiny's own output
        }
        red = page.page.evaluate(
            "Array.from(document.querySelectorAll('tr.nonfinite')).map(r => r.dataset.name)"
        )
        assert set(red) - {"__root__"} == poisoned
        # The histogram of a clicked row is that tensor's, counted here.
        page.page.click("tr[data-name='fc1'] .label")
        one = page.charts()["hist-one"][0]
        assert one["y"] == reference_hist(seen["fc1"]) and page.drawn("hist-one") == 43
        assert len(charts["hist-all"][0]["z"]) == len(keys)
        page.screenshot("report-dump.png", tmp_path)
    finally:
        page.close()


def test_dump_page_tree_collapses_expands_and_filters(chromium, bert_dir: Path, tmp_path) -> None:
    assert invoke("dump", bert_dir, "hello world", "--hist", "-o", "b.st").exit_code == 0
    assert invoke("report", "b.st", "-o", "b.html").exit_code == 0
    page = OpenPage(chromium, tmp_path / "b.html")
    try:
        every = page.visible_rows()
        inside = [n for n in every if n.startswith("encoder.layer.0.")]
        assert inside and "encoder.layer.0" in every
        toggle = page.page.locator("tr[data-name='encoder.layer.0'] .toggle")
        toggle.focus()
        page.page.keyboard.press("Enter")  # keyboard friendly: a real <button>
        assert toggle.get_attribute("aria-expanded") == "false"
        assert page.visible_rows() == [n for n in every if n not in inside]
        page.page.keyboard.press("Enter")
        assert page.visible_rows() == every
        page.page.fill(".tree-search", "LayerNorm")
        shown = page.visible_rows()
        matching = [n for n in every if "layernorm" in n.lower()]
        assert matching and set(matching) <= set(shown)
        # what else shows is only the matches' ancestors
        assert all(any(m.startswith(n) or n == "__root__" for m in matching) for n in shown)
        assert len(shown) < len(every)
        page.page.fill(".tree-search", "")
        page.page.click(".collapse-all")
        assert len(page.visible_rows()) < len(every)
        page.page.click(".expand-all")
        assert page.visible_rows() == every
        assert page.errors == []
    finally:
        page.close()
