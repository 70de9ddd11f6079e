"""compare's replay: a selected child inside its replayed parent stands in with the reference
child's output on the input the parent now hands it, so the parent's own error reaches the
parent's output and the child's own error does not (#32's catastrophic cancellation in bf16,
with the activation an nn.GELU module)."""

from __future__ import annotations

import html
import inspect
import json
import re

import pytest
import torch
import transformers
from torch.nn import functional as F  # noqa: N812
from typer.testing import CliRunner

import modeltap
from modeltap.cli import app
from modeltap.compare import Options, compare_models, make_candidate, parse_against
from modeltap.diff import Tolerance
from modeltap.loading import Inputs
from modeltap.selection import Selection, select_modules
from tests.fixtures.cancelling import CancellingBlock, HoldsCancel, build

runner = CliRunner()
transformers.logging.get_verbosity()  # its log handler takes this sys.stderr, not a runner's
BF16 = Tolerance(atol=1e-5, rtol=1.6e-2)  # torch.testing's for bf16


def _line_of(text: str, obj: object) -> str:
    lines, start = inspect.getsourcelines(obj)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return f"{inspect.getsourcefile(obj)}:{start + index}"


def _compare(model, x, tmp_path):
    candidate = make_candidate(model, parse_against("bf16"), shared=True)
    modules = select_modules(model, Selection())
    report = compare_models(
        model, candidate, Inputs((x,), {}, {}), modules, tmp_path, options=Options(tolerance=BF16)
    )
    return report, {m.name: m for m in report.modules}


@pytest.mark.parametrize("tail", [False, True], ids=["gelu-last", "linear-after-gelu"])
def test_the_block_that_cancels_is_the_origin_not_its_children(tail, tmp_path) -> None:
    model, x = build(lambda: CancellingBlock(tail))
    report, by_name = _compare(model, x, tmp_path)
    assert report.origins[0].name == "block", [(m.name, m.local_error) for m in report.origins]
    assert by_name["block"].replay == "short_circuit"
    # The block's local error as the rule computes it, in plain torch: its own code in bf16 from
    # its reference input, its Linear's reference output cast to bf16 (the Linear gets exactly
    # what its own replay gets), the GELU (and the tail) in float32 on what the block hands them.
    block = model.block
    with torch.no_grad():
        x_block = torch.tanh(model.inp(x))
        want = block(x_block)
        h = block.fc(x_block).bfloat16()
        back = (h + 4096.0) - 4096.0
        got = F.gelu(back.float()).bfloat16()
        if tail:
            got = block.tail(got.float()).bfloat16()
    expected = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    assert expected > 0.1  # catastrophic
    assert by_name["block"].local_error == pytest.approx(expected, rel=1e-3)
    for child in ("block.fc", "block.act", *(("block.tail",) if tail else ())):
        assert by_name[child].local_error < expected / 10, child

    found = modeltap.compare(model, "bf16", x, ops=True)
    assert found.origins[0].name == "block"
    worst = found.op_blame.worst
    lines = [_line_of(t, CancellingBlock.forward) for t in ("h + 4096.0", "big - 4096.0")]
    assert worst is not None and worst.source in lines
    assert found.op_blame.path() == "block > op02.sub"
    assert found.to_json()["ops"]["path"] == "block > op02.sub"


def test_an_error_in_the_child_still_names_the_child(tmp_path) -> None:
    """The block's own code (`* 2`) is exact in bf16: its child `cancel` is the origin, and the
    block, which hands the child exactly what the child's own replay gets, is not."""
    model, x = build(HoldsCancel)
    report, by_name = _compare(model, x, tmp_path)
    assert report.origins[0].name == "block.cancel"
    assert not by_name["block"].origin and by_name["block"].verdict == "via_child"
    with torch.no_grad():
        h = model.block.fc(torch.tanh(model.inp(x)))
        want = model.block.cancel(h) * 2
        got = model.block.cancel(h).bfloat16() * 2  # the child's reference output, cast
    expected = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    assert by_name["block"].local_error == pytest.approx(expected, rel=1e-3)
    assert by_name["block"].local_error < by_name["block.cancel"].local_error / 10

    found = modeltap.compare(model, "bf16", x, ops=True)
    assert found.op_blame.path() == "block.cancel > op01.sub"


def _cancelling_intermediate(self, hidden_states: torch.Tensor) -> torch.Tensor:
    h = self.dense(hidden_states)
    big = h + 4096.0
    back = big - 4096.0
    return self.intermediate_act_fn(back)


def test_the_cli_names_the_block_and_the_line_in_a_transformers_model(
    bert_dir, monkeypatch, tmp_path
):
    """BertIntermediate with the cancellation between its Linear and its GELUActivation module:
    `compare --against bf16 --ops` names an intermediate and the line, in text, JSON and HTML."""
    from transformers.models.bert import modeling_bert

    monkeypatch.setattr(modeling_bert.BertIntermediate, "forward", _cancelling_intermediate)
    args = ["compare", str(bert_dir), "hello world", "--against", "bf16", "--ops"]
    r = runner.invoke(app, [*args, "--json", "--html", str(tmp_path / "c.html")])
    assert r.exit_code == 1, r.output
    report = json.loads(r.stdout)
    origin = report["origins"][0]["module"]
    assert origin.startswith("encoder.layer.") and origin.endswith(".intermediate"), origin
    lines = [_line_of(t, _cancelling_intermediate) for t in ("h + 4096.0", "big - 4096.0")]
    ops = report["ops"]
    assert ops["module"] == origin and ops["op"]["source"] in lines
    assert ops["path"] == f"{origin} > op02.sub"
    text = " ".join(runner.invoke(app, args).output.split())
    assert f"op: {origin} > op02.sub" in text and f"at {ops['op']['source']}" in text

    page = (tmp_path / "c.html").read_text()
    assert html.escape(f"{origin} > op02.sub at {ops['op']['source']}") in page  # the summary
    assert f"Ops inside {origin}" in page
    ops_table = page.split(f"Ops inside {origin}")[1].split("</table>")[0]
    rows = re.findall(r'<tr class="([^"]*)">(.*?)</tr>', ops_table, re.S)
    cells = [re.findall(r"<td>(.*?)</td>", row) for _, row in rows]
    assert [c[0] for c in cells] == [o["key"].rpartition("/")[2] for o in ops["ops"]]
    assert [c[2] for c in cells] == [html.escape(o["source"]) for o in ops["ops"]]
    assert [cls for cls, _ in rows].count("bad") == 1
    assert cells[[cls for cls, _ in rows].index("bad")][0] == "op02.sub"
