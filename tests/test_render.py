import io
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.text import Text

from modeltap.dump import load_dump
from modeltap.loading import Inputs
from modeltap.render import dump_heading, dump_table, fmt
from modeltap.run import dump_model
from tests.fixtures.golden import same_render

GOLDEN = Path(__file__).parent / "golden"


def render(renderable, width):
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


def check_golden(name, text, update):
    path = GOLDEN / name
    if update:
        path.write_text(text)
    assert same_render(text, path.read_text()), (
        f"render changed; review and rerun with --update-golden ({path})\n{text}"
    )


def test_golden_comparison_tolerates_rounding_only():
    gold = "x   17.89   2.724   0   6%\n"
    assert same_render("x   17.90   2.724   0   6%\n", gold)
    assert not same_render("x   18.50   2.724   0   6%\n", gold)
    assert not same_render("y   17.89   2.724   0   6%\n", gold)


def test_mean_negligible_next_to_scale_shows_as_zero():
    # LayerNorm outputs have a mean of ~1e-9 that is pure rounding; it must not reach the table.
    assert fmt(8.94e-9, 2.724) == "~0" and fmt(5.96e-9, 2.724) == "~0"
    assert fmt(-1.79e-4, 2.724) == "-1.79e-4" and fmt(0.0, 2.724) == "0"
    assert fmt(1e-9) == "1.00e-9"


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


def test_every_width_from_80_lays_out_whole_numbers(bert_dir, tmp_path):
    # Where the wide columns do not fit (just above WIDE), the narrow ones do: Rich's table, which
    # would share out the width (and took 0.16 s for MiniLM), is only for narrower terminals.
    dump = tiny_dump(bert_dir, tmp_path)
    narrow = render(dump_table(dump, width=80), 80).splitlines()
    kinds = set()
    for width in range(80, 201, 4):
        table = dump_table(dump, width=width)
        assert isinstance(table, Text), width
        lines = render(table, width).splitlines()
        assert max(len(line) for line in lines) <= width
        kinds.add("dtype" in lines[0])
        if "dtype" not in lines[0]:
            assert [line.rstrip() for line in lines] == [line.rstrip() for line in narrow]
    assert kinds == {False, True}


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


def test_plain_weights_file_keeps_every_number_at_80_columns(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    name = "encoder.layer.11.attention.self.query.weight"
    save_file(
        {
            name: torch.randn(384, 384) * 0.05,
            "embeddings.word_embeddings.weight": torch.randn(50, 8),
        },
        tmp_path / "w.safetensors",
    )
    dump = load_dump(tmp_path / "w.safetensors")
    from modeltap.stats import tensor_stats

    dump.stats = {k: tensor_stats(dump[k]) for k in dump.stored}
    text = render(dump_table(dump, width=80), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    row = next(line for line in text.splitlines() if "query.weight" in line)
    # The name loses its start, never its end; no number is cut.
    assert row.split()[0].startswith("…") and row.split()[0].endswith("self.query.weight")
    assert row.split()[1] == "384×384" and "…" not in " ".join(row.split()[1:])
    norm = float(row.split()[2])
    assert norm == pytest.approx(float(torch.linalg.vector_norm(dump[name])), rel=1e-3)


def test_sparkline_is_log_scaled_and_marks_gaps_and_nonfinite() -> None:
    from modeltap.render import sparkline

    assert sparkline([1.0, 10.0, 100.0, None, float("nan"), 0.0]) == "▁▅█ !▁"
    assert sparkline([3.0, 3.0]) == "▁▁"
