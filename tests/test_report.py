"""`modeltap report` and the histograms it shows: pages built from real dumps, diffs and runs,
checked against values computed in the test, then opened in headless Chromium."""

from __future__ import annotations

import json
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
from tests.fixtures.histograms import reference_hist
from tests.fixtures.poison import Tiny, batch

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
    """A dump of Tiny (tests/fixtures/poison.py) with histograms (fc2 writing a NaN when
    `poison`), and every module's output as plain hooks saw it."""
    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs

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


def _tiny_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Dumps of Tiny and of Tiny with fc2's weights nudged: equal up to fc1/act, then not."""
    from modeltap.dumping import dump_model
    from modeltap.loading import Inputs

    paths = []
    for name, nudge in (("cand.safetensors", 1e-3), ("ref.safetensors", 0.0)):
        torch.manual_seed(0)
        model = Tiny().eval()
        with torch.no_grad():
            model.fc2.weight += nudge
        paths.append(dump_model(model, Inputs((batch(0),), {}, {"t": 1}), tmp_path / name))
    return paths[0], paths[1]


def test_diff_page_strip_shows_each_pairs_error_and_the_first_divergence(chromium, tmp_path):
    from safetensors.torch import load_file

    cand, ref = _tiny_pair(tmp_path)
    result = invoke("diff", cand, ref, "--html", "diff.html", "--json")
    assert result.exit_code == 1  # out of tolerance: the page is written all the same
    pairs = json.loads(result.stdout)["pairs"]
    a, b = load_file(cand), load_file(ref)
    stored = load_dump(cand)

    def tensor(side: dict, dump_key: str) -> torch.Tensor:
        return side[stored.resolve(dump_key)].double()

    expected, margins, first = [], [], None
    for pair in pairs:
        x, y = tensor(a, pair["key"]), tensor(b, pair["other"])
        error = float((x - y).abs().max() / y.abs().max())
        expected.append(error if error > 0 else None)
        share = float(((x - y).abs() / (1e-8 + 1e-5 * y.abs())).max())
        margins.append(share if share > 0 else None)
        if first is None and bool(((x - y).abs() > 1e-8 + 1e-5 * y.abs()).any()):
            first = pair["key"]
    assert first == "fc2"
    page = OpenPage(chromium, tmp_path / "diff.html")
    try:
        assert page.errors == []
        # the strip: each pair's largest difference over its allowed one, the rule's line at 1
        strip = page.charts()["diff-strip"]
        drawn = strip[0]["y"]
        assert [v is None for v in drawn] == [v is None for v in margins]
        assert drawn == [None if v is None else pytest.approx(v, rel=1e-5) for v in margins]
        assert all((v or 0) > 1 for v, p in zip(drawn, pairs, strict=True) if p["status"] != "ok")
        notes = page.page.evaluate("document.getElementById('diff-strip').layout.annotations")
        assert f"first divergence: {first}" in [n["text"] for n in notes]
        assert "limit: |a−b| ≤ 1e-08 + 1e-05·|b|" in [n["text"] for n in notes]
        scaled = page.charts()["diff-errors"][0]["y"]
        assert scaled == [None if v is None else pytest.approx(v, rel=1e-6) for v in expected]
        at = [p["key"] for p in pairs].index(first)
        # hover carries both sides' statistics
        hover = strip[0]["hovertext"][at]
        assert f"A: norm {float(tensor(a, first).norm()):.4g}" in hover
        assert f"B: norm {float(tensor(b, first).norm()):.4g}" in hover
        assert page.drawn("diff-share") == len(pairs)
        page.screenshot("report-diff.png", tmp_path)
    finally:
        page.close()
    # `report A B` draws the same figures as `diff A B --html`
    assert invoke("report", cand, ref, "-o", "same.html").exit_code == 0
    figures = '<script type="application/json" id="modeltap-figures">'

    def data(path: str) -> str:
        return (tmp_path / path).read_text().split(figures)[1].split("</script>")[0]

    assert data("same.html") == data("diff.html")


def test_compare_page_puts_local_beside_cumulative_error(chromium, bert_dir: Path, tmp_path):
    # bf16 judged exactly: every module whose own code rounds differently is an origin
    result = invoke("compare", bert_dir, "hello world", "--against", "bf16", "--preset", "exact",
                    "--html", "c.html", "--json")  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "wrote c.html" in result.stderr.splitlines()

    (tmp_path / "c.json").write_text(result.stdout)
    data = json.loads(result.stdout)
    modules = data["modules"]
    page = OpenPage(chromium, tmp_path / "c.html")
    try:
        assert page.errors == []
        local, cumulative, *marks = page.charts()["compare-errors"]
        assert local["x"] == cumulative["x"] == [m["module"] for m in modules]

        def shown(value: float | None) -> float | None:
            return value if value is not None and 0 < value < float("inf") else None

        assert local["y"] == [shown(m["local_error"]) for m in modules]
        assert cumulative["y"] == [shown(m["cumulative_error"]) for m in modules]
        origins = [m["module"] for m in modules if m["verdict"] == "origin"]
        assert origins and marks[0]["x"] == origins
        bold = page.page.evaluate(
            "Array.from(document.querySelectorAll('tr.origin')).map(r => r.dataset.name)"
        )
        assert sorted(bold) == sorted(origins)
        coloured = page.page.evaluate(
            "Array.from(document.querySelectorAll('table.tree-table tbody tr'))"
            ".filter(r => r.cells[2].style.background).map(r => r.dataset.name)"
        )
        assert set(coloured) == {m["module"] for m in modules if shown(m["local_error"])}
        page.screenshot("report-compare.png", tmp_path)
    finally:
        page.close()
    # the saved JSON report draws the same page
    assert invoke("report", "c.json", "-o", "c2.html").exit_code == 0
    figures = '<script type="application/json" id="modeltap-figures">'
    same = [(tmp_path / n).read_text().split(figures)[1] for n in ("c.html", "c2.html")]
    assert same[0] == same[1]


def _fc1_rule(obs: Any) -> tuple[float, str] | None:
    if obs.key == "fc1" and obs.kind == "activation":
        return obs.stats.norm, "fc1 looked at"
    return None


def _record_two_ranks(folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Tiny trained 6 steps as rank 0 and as rank 1 (other batches), every step recorded, fc2
    writing a NaN on rank 0's last step; returns {rank: {step: {module: output norm}}}."""
    from modeltap.record import dist

    norms: dict[int, dict[int, dict[str, float]]] = {}
    for rank in (0, 1):
        monkeypatch.setattr(dist, "rank_info", lambda rank=rank: dist.RankInfo(rank, 2, "gloo"))
        torch.manual_seed(0)
        model = Tiny()
        seen = _hooked_outputs(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        norms[rank] = {}
        options = {"every": 1, "on_nonfinite": "warn", "rules": [_fc1_rule]}
        with modeltap.record(model, folder, **options) as rec:
            for step in range(6):
                model.fc2.on = rank == 0 and step == 5
                seen.clear()
                model(batch(step + 100 * rank)).square().mean().backward()
                norms[rank][step] = {k: float(t.double().norm()) for k, t in seen.items()}
                opt.step()
                opt.zero_grad()
                rec.step()
    return norms


def test_run_page_heatmaps_ranks_and_events(chromium, tmp_path, monkeypatch) -> None:
    import math

    norms = _record_two_ranks(tmp_path / "run", monkeypatch)
    result = invoke("report", "run", "-o", "run.html")
    assert result.exit_code == 0, result.output
    page = OpenPage(chromium, tmp_path / "run.html")
    try:
        assert page.errors == []
        heat, hits = page.charts()["run-norm-out"]
        assert heat["x"] == list(range(6))
        for rank in (0, 1):
            if rank:
                page.page.select_option("#rank-select", "1")
                heat, hits = page.charts()["run-norm-out"]
            for row, module in enumerate(heat["y"]):
                for column, step in enumerate(heat["x"]):
                    expected = math.log10(norms[rank][step][module])
                    if rank == 0 and step == 5 and module in ("fc2", "gate", "tanh", "head"):
                        continue  # NaN: norm of the finite values only
                    assert heat["z"][row][column] == pytest.approx(expected, abs=6e-6)
            assert hits["x"] == list(range(6)) and set(hits["y"]) == {"fc1"}
        page.page.select_option("#rank-select", "0")
        trips = page.page.evaluate("document.getElementById('run-norm-out').layout.shapes")
        assert {s["x0"] for s in trips} == {5}  # forward and backward trips, both at step 5
        # rank x module at the last step: each rank's norm against the mean over both
        ranks = page.charts()["run-ranks"][0]
        column = ranks["x"].index("fc1")
        mean = (norms[0][5]["fc1"] + norms[1][5]["fc1"]) / 2
        for row, rank in enumerate((0, 1)):
            drift = 100 * (norms[rank][5]["fc1"] - mean) / mean
            assert ranks["z"][row][column] == pytest.approx(drift, rel=1e-6)
        updates = page.charts()["run-updates"]
        assert {t["name"] for t in updates} == {n for n, _ in Tiny().named_parameters()}
        assert all(len(t["y"]) == 6 for t in updates)
        page.screenshot("report-run.png", tmp_path)
    finally:
        page.close()


def test_run_page_reduces_what_does_not_fit_and_says_so(tmp_path) -> None:
    from modeltap.record.index import RankIndex, RunIndex
    from modeltap.render.report import run_page

    modules = [f"layer.{i}" for i in range(500)]
    steps = []
    for step in range(1000):
        keys = {m: {"norm": 1.0, "absmax": 1.0} for m in modules}
        if step == 537:
            keys["layer.311"] = {"norm": 1e6, "absmax": 1.0}
        steps.append({"step": step, "keys": keys})
    page = run_page(RunIndex(tmp_path, {0: RankIndex(0, {"every": 1}, steps)}))
    heat = page.figures["run-norm-out"]["data"][0]
    assert (len(heat["z"]), len(heat["z"][0])) == (167, 250)  # 3 modules a row, 4 steps a column
    assert heat["z"][311 // 3][537 // 4] == 6.0  # the spike survives, as the max
    assert sum(v == 6.0 for row in heat["z"] for v in row) == 1
    note = next(s.note for s in page.sections if s.title == "Step × module")
    assert "1000 steps shown as 250 columns" in note and "500 modules shown as 167 rows" in note


def _one_line_error(result: Any) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_bad_inputs_are_one_line_exit_2_and_leave_nothing(tmp_path, bert_dir) -> None:
    from safetensors.torch import save_file

    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    save_file({"w": torch.ones(2)}, tmp_path / "plain.safetensors")
    (tmp_path / "empty_run").mkdir()
    cand, _ = _tiny_pair(tmp_path)
    assert invoke("dump", bert_dir, "hello", "-o", "bert.st").exit_code == 0
    (tmp_path / "old.json").write_text(json.dumps({"schema": "modeltap.compare/1"}))
    (tmp_path / "afile").write_text("x")
    cases = [
        (["junk.safetensors"], "not a readable safetensors file"),
        (["plain.safetensors"], "without modeltap's metadata"),
        (["empty_run"], "holds no index.rank*.jsonl"),
        ([cand, "bert.st"], "no key in common"),
        (["old.json"], "schema 'modeltap.compare/1'"),
        (["a", "b", "c"], "3 inputs"),
    ]
    for args, says in cases:
        line = _one_line_error(invoke("report", *args, "-o", "page.html"))
        assert says in line, line
        assert not (tmp_path / "page.html").exists()
    line = _one_line_error(invoke("report", cand, "-o", "afile/page.html"))
    assert "is a file" in line
    line = _one_line_error(invoke("report", cand, "-o", str(tmp_path)))
    assert "is a directory" in line
    # the output path is checked before any work: diff --html as well
    line = _one_line_error(invoke("diff", cand, cand, "--html", "afile/d.html"))
    assert "is a file" in line
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".html") == []


def test_a_failed_render_leaves_no_page(tmp_path, monkeypatch) -> None:
    cand, _ = _tiny_pair(tmp_path)
    (tmp_path / "page.html").write_text("the page from before")

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", broken)
    result = invoke("report", cand, "-o", "page.html")
    monkeypatch.undo()
    assert result.exit_code == 2 and "no space left" in result.output
    assert (tmp_path / "page.html").read_text() == "the page from before"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".page.html")] == []


def test_report_help_is_true_and_quick(tmp_path) -> None:
    import subprocess
    import sys

    result = runner.invoke(app, ["report", "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0 and max(map(len, result.stdout.splitlines())) <= 80
    for option in ("--out", "--atol", "--rtol", "--preset", "--map", "--include", "--strict"):
        assert option in result.stdout
    code = (
        "import sys; from modeltap.cli import app; "
        "print('plotly' in sys.modules, 'jinja2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_without_the_report_extra_the_fix_is_named(tmp_path, monkeypatch) -> None:
    import importlib.util

    cand, ref = _tiny_pair(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a)
    )
    for args in (["report", cand, "-o", "p.html"], ["diff", cand, ref, "--html", "p.html"]):
        line = _one_line_error(invoke(*args))
        assert "pip install 'modeltap[report]'" in line
    assert not (tmp_path / "p.html").exists()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_writer_histograms_on_every_path(tmp_path, device) -> None:
    """Small tensors (batched), large ones (the writer thread), through the ring and inline."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from modeltap.dump import DumpWriter

    torch.manual_seed(0)
    tensors = {
        "small": torch.randn(4, 8) * 1e-3,
        "large": torch.randn(600, 1000) * 300,  # past the thread's 1 MB: the writer thread
        "wide": torch.randn(2000, 1000),  # bigger than the ring below: done inline
    }
    tensors["large"][3, 7] = float("nan")
    with DumpWriter(tmp_path / "h.st", hist=True, max_inflight=4 << 20) as writer:
        for key, value in tensors.items():
            writer.tensor(key, value.to(device))
        path = writer.finish({})
    dump = load_dump(path)
    for key, value in tensors.items():
        assert dump.stats_for(key).hist == reference_hist(value), key


def test_report_of_a_bf16_pair_reads_the_preset_as_diff_does(tmp_path, bert_dir) -> None:
    """`report A B --preset bf16` upcasts as `diff A B --preset bf16` does (one set-up)."""
    assert invoke("dump", bert_dir, "hello", "-o", "f32.st").exit_code == 0
    assert invoke("dump", bert_dir, "hello", "--dtype", "bfloat16", "-o", "b16.st").exit_code == 0
    assert invoke("diff", "b16.st", "f32.st", "--preset", "bf16").exit_code == 0
    result = invoke("report", "b16.st", "f32.st", "--preset", "bf16", "-o", "d.html")
    assert result.exit_code == 0, result.output
    page = (tmp_path / "d.html").read_text()
    pairs = runner.invoke(app, ["diff", "b16.st", "f32.st", "--preset", "bf16", "--json"])
    compared = len(json.loads(pairs.stdout)["pairs"])
    # compared as values, as diff does: no pair out of tolerance (as another dtype, all were)
    assert f"<dd>{compared} pairs, 0 out of tolerance" in page


# --- what the pages say, read from the page's embedded figures and summary -----------------------


def _figures(path: Path) -> dict[str, Any]:
    """The page's figures, as embedded (the JSON plotly draws from)."""
    tag = '<script type="application/json" id="modeltap-figures">'
    text = path.read_text(encoding="utf-8").split(tag)[1].split("</script>")[0]
    return json.loads(text.replace("<\\/", "</"))


def _variants(path: Path) -> dict[str, Any]:
    tag = '<script type="application/json" id="modeltap-variants">'
    text = path.read_text(encoding="utf-8").split(tag)[1].split("</script>")[0]
    return json.loads(text.replace("<\\/", "</"))


def _summary(path: Path) -> dict[str, str]:
    """The page's summary: {label: value}."""
    import html
    import re

    pairs = re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", path.read_text(encoding="utf-8"))
    return {html.unescape(k): html.unescape(v) for k, v in pairs}


def _table(path: Path, title: str) -> list[list[str]]:
    """The cells of the plain table under the heading `title`."""
    import html
    import re

    page = path.read_text(encoding="utf-8")
    part = page.split(f">{title}</h2>")[1].split("</section>")[0]
    body = part.split("<tbody>")[1].split("</tbody>")[0]
    return [
        [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    ]


def test_diff_page_says_the_inputs_differ_and_which_setting(tmp_path) -> None:
    """Two dumps of one image through processors that differ in `resample` only: the page, like
    the text report, says the inputs differ (not that the first module diverged on its own)
    and names the setting, not a JSON blob."""
    from transformers import ViTImageProcessor

    from tests.fixtures.media import build_vit, write_image

    folder = tmp_path / "vit"
    build_vit(folder)
    before = ViTImageProcessor.from_pretrained(folder).resample
    image = write_image(tmp_path / "cat.png", 40, 30, seed=1)
    vit = ["--model-class", "ViTForImageClassification"]
    assert invoke("dump", folder, image, *vit, "-o", "before.st").exit_code == 0
    ViTImageProcessor(size={"height": 16, "width": 16}, resample=before + 1).save_pretrained(folder)
    assert invoke("dump", folder, image, *vit, "-o", "after.st").exit_code == 0
    changed = f"resample {before + 1} vs {before}"
    text = invoke("diff", "after.st", "before.st")
    assert text.exit_code == 1 and f"warning: inputs differs: {changed}\n" in text.stdout
    result = invoke("diff", "after.st", "before.st", "--html", "d.html", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["inputs_differ"] == ["inputs/pixel_values"]
    assert result.stderr.strip() == "wrote d.html"
    summary = _summary(tmp_path / "d.html")
    assert summary["verdict"] == "FAIL: inputs differ"
    assert summary["inputs differ"].startswith("inputs/pixel_values: the preprocessing changed")
    assert summary["first divergence"].endswith("(downstream of the differing inputs)")
    assert summary["inputs differs"] == changed
    assert _table(tmp_path / "d.html", "Metadata differences") == [["inputs", changed, "warning"]]
    strip = _figures(tmp_path / "d.html")["diff-strip"]
    notes = [n["text"] for n in strip["layout"]["annotations"]]
    assert "inputs differ: inputs/pixel_values" in notes


def _preset(name: str) -> dict[str, float]:
    from modeltap.config import tomllib

    text = (Path(modeltap.__file__).parent / "tolerances.toml").read_text()
    return tomllib.loads(text)[name]


def test_bf16_diff_page_draws_each_pairs_margin_to_its_whole_rule(tmp_path, bert_dir) -> None:
    """bf16 against float32 under the bf16 preset, a PASS: every pair's point sits below the
    line at 1, each computed here as max |a - b| / (atol + scaled_atol max|b| + rtol |b|) from
    the stored tensors; the rule drawn names every part of the preset; cosines carry the digits
    that tell 0.9999 from 0.999."""
    from safetensors.torch import load_file

    assert invoke("dump", bert_dir, "hello", "-o", "f32.st").exit_code == 0
    assert invoke("dump", bert_dir, "hello", "--dtype", "bfloat16", "-o", "b16.st").exit_code == 0
    result = invoke("diff", "b16.st", "f32.st", "--preset", "bf16", "--html", "d.html", "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == "wrote d.html"
    pairs = json.loads(result.stdout)["pairs"]
    p = _preset("bf16")
    a, b = load_file(tmp_path / "b16.st"), load_file(tmp_path / "f32.st")
    stored_a, stored_b = load_dump(tmp_path / "b16.st"), load_dump(tmp_path / "f32.st")
    expected, cosines = [], []
    for pair in pairs:
        x = a[stored_a.resolve(pair["key"])].double()
        y = b[stored_b.resolve(pair["other"])].double()
        limit = p["atol"] + p["scaled_atol"] * y.abs().max() + p["rtol"] * y.abs()
        expected.append(float(((x - y).abs() / limit).max()))
        cosines.append(float((x.flatten() @ y.flatten()) / (x.norm() * y.norm())))
    strip = _figures(tmp_path / "d.html")["diff-strip"]
    elementwise, cosine = strip["data"][0], strip["data"][1]
    drawn = elementwise["y"]
    for got, want in zip(drawn, expected, strict=True):
        assert (got is None) == (want == 0)
        assert got is None or got == pytest.approx(want, rel=1e-4)
    assert max(expected) < 1 and not any(t["name"] == "out of tolerance" for t in strip["data"])
    room = 1 - p["min_cosine"]
    for got, want in zip(cosine["y"], cosines, strict=True):
        assert got == pytest.approx((1 - want) / room, rel=2e-2, abs=1e-6)
    line = [s for s in strip["layout"]["shapes"] if s["yref"] == "y"]
    assert [(s["y0"], s["y1"]) for s in line] == [(1, 1)]
    rule = next(n["text"] for n in strip["layout"]["annotations"] if n["text"].startswith("limit"))
    for part in (f"{p['atol']:g}", f"{p['scaled_atol']:g}·max|b|", f"{p['rtol']:g}·|b|",
                 f"cosine ≥ {p['min_cosine']:g}"):  # fmt: skip
        assert part in rule, (part, rule)
    rows = _table(tmp_path / "d.html", "Pairs")
    for row, want in zip(rows, cosines, strict=True):
        shown = float(row[7])  # enough digits for 1 - cosine to three figures
        assert 1 - shown == pytest.approx(1 - want, rel=2e-2, abs=1e-9), (row[7], want)


def test_dump_page_axes_name_the_modules(bert_dir, tmp_path) -> None:
    """A BERT dump's x axes are labelled where each block (encoder.layer.N) and each module
    between blocks begins, at that key's index; the histogram heatmap's rows likewise."""
    assert invoke("dump", bert_dir, "hello world", "--hist", "-o", "b.st").exit_code == 0
    assert invoke("report", "b.st", "-o", "b.html").exit_code == 0
    keys = load_dump(tmp_path / "b.st").keys()
    layers = sorted({int(k.split(".")[2]) for k in keys if k.startswith("encoder.layer.")})
    assert len(layers) >= 2 and len(keys) > 24
    figures = _figures(tmp_path / "b.html")
    axis = figures["act-norm"]["layout"]["xaxis"]
    ticks = dict(zip(axis["ticktext"], axis["tickvals"], strict=True))
    for layer in layers:
        first = next(i for i, k in enumerate(keys) if k.startswith(f"encoder.layer.{layer}."))
        assert ticks[f"encoder.layer.{layer}"] == first
    assert ticks["embeddings"] == 0 and "pooler" in ticks
    rows = figures["hist-all"]["layout"]["yaxis"]
    assert rows.get("showticklabels", True) and "encoder.layer.0" in rows["ticktext"]
    assert rows["tickvals"][rows["ticktext"].index("encoder.layer.0")].startswith("encoder.layer.0")


def test_run_page_axes_fit_a_four_step_run_and_label_colours(tmp_path) -> None:
    """Steps 0, 50, 100, 150, norms within one decade: the step axis spans the recorded steps
    (each ticked), the colour bar has several ticks inside the data, labelled as the norms
    they stand for, and log axes label minor ticks in full."""
    import math

    from modeltap.record.index import RankIndex, RunIndex
    from modeltap.render.report import run_page

    steps = []
    for n, step in enumerate((0, 50, 100, 150)):
        keys = {f"layer.{i}": {"norm": 2.0 + i + n, "absmax": 1.0} for i in range(3)}
        steps.append({"step": step, "keys": keys, "updates": {"w": 1e-3 * (n + 1)}})
    page = run_page(RunIndex(tmp_path, {0: RankIndex(0, {"every": 50}, steps)}))
    heat = page.figures["run-norm-out"]
    axis = heat["layout"]["xaxis"]
    assert axis["range"] == [-25, 175] and axis["tickvals"] == [0, 50, 100, 150]
    bar = heat["data"][0]["colorbar"]
    low, high = math.log10(2.0), math.log10(2.0 + 2 + 3)
    assert len(bar["tickvals"]) >= 3
    assert all(low - 1e-9 <= t <= high + 1e-9 for t in bar["tickvals"])
    assert [float(t) for t in bar["ticktext"]] == pytest.approx([10**t for t in bar["tickvals"]])
    updates = page.figures["run-updates"]["layout"]
    assert updates["xaxis"]["range"] == [0, 150]
    assert updates["yaxis"]["type"] == "log" and updates["yaxis"]["minorloglabels"] == "complete"


def test_report_of_a_generate_dump_shows_every_step_and_its_tokens(gpt2_dir, tmp_path) -> None:
    """8 new tokens, tensors of steps 0 and 7 only: the page offers all 8 steps' statistics
    and a token table whose tokens are what transformers' greedy generate() chose."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = invoke("generate", gpt2_dir, "hello world", "--max-new-tokens", "8", "-o", "g.st")
    assert result.exit_code == 0, result.output
    assert invoke("report", "g.st", "-o", "g.html").stderr.strip() == "wrote g.html"
    model = AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    ids = AutoTokenizer.from_pretrained(gpt2_dir)("hello world", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    rows = _table(tmp_path / "g.html", "Tokens")
    assert [int(r[0]) for r in rows] == list(range(8))
    assert [int(r[2]) for r in rows] == new
    assert [r[8] for r in rows] == ["tensors"] + ["statistics"] * 6 + ["tensors"]
    steps = _variants(tmp_path / "g.html")["gen-step"]
    assert sorted(steps, key=int) == [str(s) for s in range(8)]
    stats = load_dump(tmp_path / "g.st").stats
    norm = steps["3"]["gen-norm"]["data"][0]["y"]
    step3 = [k.removeprefix("gen/step3/") for k in stats if k.startswith("gen/step3/")]
    assert norm[0] == pytest.approx(stats[f"gen/step3/{step3[0]}"].norm, rel=1e-6)


def test_report_reads_a_compare_generate_json(gpt2_dir, tmp_path) -> None:
    result = invoke("compare", gpt2_dir, "hello world", "--against", "fp32", "--generate", "4",
                    "--json")  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    (tmp_path / "cg.json").write_text(result.stdout)
    made = invoke("report", "cg.json", "-o", "cg.html")
    assert made.exit_code == 0, made.output
    assert made.stderr.strip() == "wrote cg.html"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    ids = AutoTokenizer.from_pretrained(gpt2_dir)("hello world", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    rows = _table(tmp_path / "cg.html", "Steps and tokens")
    assert [int(r[2]) for r in rows] == out[0, ids["input_ids"].shape[1] :].tolist()
    assert _summary(tmp_path / "cg.html")["verdict"] in ("PASS", "FAIL")


# --- --formats: the dump page's key x format heatmap, the diff page's columns, the run page ------


def _format_reference(path: Path, formats) -> dict[str, dict[str, dict]]:
    """key -> format -> figures, recomputed from the tensors stored in `path` with test_formats'
    reference quantizer."""
    from safetensors import safe_open

    from tests.fixtures.quant_reference import reference_figures

    with safe_open(str(path), "pt") as f:
        return {k: {n: reference_figures(f.get_tensor(k), n) for n in formats} for k in f.keys()}


def _threshold_steps(trace: dict[str, Any]) -> list[float]:
    """The SQNR values (dB) where a heatmap's colour scale changes colour abruptly."""
    stops = trace["colorscale"]
    return [
        stops[i][0] * trace["zmax"]
        for i in range(1, len(stops))
        if stops[i][0] == stops[i - 1][0] and stops[i][1] != stops[i - 1][1]
    ]


def test_dump_page_heatmap_of_sqnr_per_key_and_format(chromium, tmp_path) -> None:
    from modeltap.render.tree import FORMAT_BAD_DB, FORMAT_WARN_DB
    from tests.fixtures.format_runs import FORMATS, spiked_pair

    _, b = spiked_pair(tmp_path)
    result = invoke("report", b, "-o", "b.html")
    assert result.exit_code == 0, result.output
    dump = load_dump(b)
    stats = json.loads(dump.metadata["stats"])
    ref = _format_reference(b, FORMATS)
    heat = _figures(tmp_path / "b.html")["formats-sqnr"]["data"][0]
    assert heat["x"] == list(FORMATS)
    assert heat["y"] == dump.keys() and len(dump.keys()) > len(stats)  # the root: an alias
    for row, shown in enumerate(heat["y"]):
        key = dump.resolve(shown)
        for column, name in enumerate(FORMATS):
            cell = heat["z"][row][column]
            assert cell == stats[key]["formats"][name]["sqnr_db"]
            assert cell == pytest.approx(ref[key][name]["sqnr_db"], abs=1e-4)
            assert heat["text"][row][column] == f"{cell:.1f}"
    # Coloured as the tree is: abrupt changes at its two thresholds, the lowest band below 20 dB.
    assert _threshold_steps(heat) == pytest.approx([FORMAT_BAD_DB, FORMAT_WARN_DB])
    assert heat["zmin"] == 0
    page = OpenPage(chromium, tmp_path / "b.html")
    try:
        assert page.errors == []
        drawn = page.charts()["formats-sqnr"][0]
        assert drawn["z"] == heat["z"] and page.drawn("formats-sqnr") == 1
    finally:
        page.close()


def test_diff_page_shows_sqnr_a_to_b_and_the_keys_that_cross(tmp_path) -> None:
    from tests.fixtures.format_runs import FORMATS, spiked_pair

    b, a = spiked_pair(tmp_path)  # A, the candidate, has the spike
    result = runner.invoke(app, ["diff", str(a), str(b), "--html", "d.html"])
    assert result.exit_code == 1, result.output
    ref_a, ref_b = _format_reference(a, FORMATS), _format_reference(b, FORMATS)
    rows = _table(tmp_path / "d.html", "Pairs")
    crossed = []
    for cells in rows:
        key = cells[0]
        for i, name in enumerate(FORMATS):
            da, db = ref_a[key][name]["sqnr_db"], ref_b[key][name]["sqnr_db"]
            assert cells[9 + i] == f"{da:.1f} vs {db:.1f}"
            if (da < 30) > (db < 30) or (da < 20) > (db < 20):
                crossed.append([key, name, f"{da:.1f}", f"{db:.1f}", "bad" if da < 20 else "warn"])
    assert crossed
    table = _table(tmp_path / "d.html", "Low-precision formats: thresholds crossed")
    assert [r for r in table if r[-1] != "recovered"] == crossed


def test_run_page_shows_the_step_a_spiked_module_crosses(chromium, tmp_path) -> None:
    """Module `1` spiked from step 2: the run page's table says its int8 SQNR first falls below
    both thresholds at step 2, and each row and heatmap cell equals the figure recomputed from
    the step files' tensors."""
    from tests.fixtures.format_runs import spiked_run

    run = spiked_run(tmp_path / "run", 2)
    result = invoke("report", run, "-o", "run.html")
    assert result.exit_code == 0, result.output
    refs = [
        _format_reference(run / f"step{s:06d}.rank0.safetensors", ["int8"]) for s in range(5)
    ]
    first: dict[str, list] = {}
    for step, ref in enumerate(refs):
        for key, figures in ref.items():
            db = figures["int8"]["sqnr_db"]
            row = first.setdefault(key, [None, None, None, None])
            for i, limit in ((0, 30.0), (2, 20.0)):
                if row[i] is None and db is not None and db < limit:
                    row[i : i + 2] = [step, f"{db:.1f}"]
    expected = {k: r for k, r in first.items() if r[0] is not None}
    assert expected["1"][::2] == [2, 2]  # below both thresholds from the spike on
    table = _table(tmp_path / "run.html", "First step below a threshold")
    got = {r[1]: [int(r[3]), r[4], int(r[5]) if r[5] else None, r[6] or None] for r in table}
    assert all(r[0] == "0" and r[2] == "int8" for r in table)
    assert got == expected
    assert min(r[0] for r in expected.values()) == 2  # nothing crossed before the spike
    heat = _figures(tmp_path / "run.html")["run-formats-int8"]["data"][0]
    assert heat["x"] == list(range(5))
    for row, key in enumerate(heat["y"]):
        for column, step in enumerate(heat["x"]):
            want = refs[step][key]["int8"]["sqnr_db"]
            assert heat["z"][row][column] == pytest.approx(want, abs=1e-4), (key, step)
    page = OpenPage(chromium, tmp_path / "run.html")
    try:
        assert page.errors == [] and page.drawn("run-formats-int8") == 1
    finally:
        page.close()
