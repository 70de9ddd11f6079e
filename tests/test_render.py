import io
from pathlib import Path

import torch
from rich.console import Console

from modeltap.dump import load_dump
from modeltap.loading import Inputs
from modeltap.render import dump_heading, dump_table, fmt
from modeltap.run import dump_model

GOLDEN = Path(__file__).parent / "golden"


def render(renderable, width):
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


def check_golden(name, text, update):
    path = GOLDEN / name
    if update:
        path.write_text(text)
    assert text == path.read_text(), (
        f"render changed; review and rerun with --update-golden ({path})"
    )


def tiny_dump(bert_dir, tmp_path):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(bert_dir).eval()
    batch = dict(
        AutoTokenizer.from_pretrained(bert_dir)(
            ["hello world", "the lazy dog"], return_tensors="pt", padding=True
        )
    )
    inputs = Inputs((), batch, {"texts": ["hello world", "the lazy dog"]})
    meta = {"model": "tiny-bert", "dtype": "float32", "device": "cpu"}
    return load_dump(dump_model(model, inputs, tmp_path / "d.safetensors", metadata=meta))


def test_tree_at_80_columns(bert_dir, tmp_path, update_golden):
    dump = tiny_dump(bert_dir, tmp_path)
    text = render(dump_heading(dump), 80) + render(dump_table(dump, width=80), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    check_golden("tiny_bert_80.txt", text, update_golden)


def test_tree_at_140_columns_has_more(bert_dir, tmp_path, update_golden):
    dump = tiny_dump(bert_dir, tmp_path)
    text = render(dump_table(dump, width=140), 140)
    assert "same tensor as" in text and "dtype" in text
    check_golden("tiny_bert_140.txt", text, update_golden)


def test_nan_rows_are_red():
    from tests.fixtures.models import WithNaN

    torch.manual_seed(0)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = dump_model(
            WithNaN().eval(), Inputs((torch.randn(8, 4),), {}, {}), Path(folder) / "n.safetensors"
        )
        dump = load_dump(path)
        console = Console(
            file=io.StringIO(), width=80, force_terminal=True, color_system="standard"
        )
        console.print(dump_table(dump, width=80))
        out = console.file.getvalue()
    assert dump.stats["__root__"].nan > 0
    assert "\x1b[1;31m" in out  # bold red


def test_number_format_fits_eight_characters():
    for value in (0.0, 0.007522, 886.7178, -1.79e-4, 3.4e38, -12345.678, float("nan"), 1e-12):
        assert len(fmt(value)) <= 8, fmt(value)
    assert fmt(-1.79e-4) == "-1.79e-4" and fmt(886.7178) == "886.7"


def test_sparkline_is_log_scaled_and_marks_gaps_and_nonfinite() -> None:
    from modeltap.render import sparkline

    assert sparkline([1.0, 10.0, 100.0, None, float("nan"), 0.0]) == "▁▅█ !▁"
    assert sparkline([3.0, 3.0]) == "▁▁"
