import io
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.text import Text

from modeltap.dump import load_dump
from modeltap.dumping import dump_model
from modeltap.loading import Inputs
from modeltap.render import dump_heading, dump_table, fmt
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


# -- `modeltap show DIR`: a recorded run ----------------------------------------------------


def _pieces_in_order(name: str, shown: str) -> bool:
    """Whether `shown` (pieces joined by `…`) could be a shortening of `name`."""
    pieces = shown.split("…")
    if not name.startswith(pieces[0]) or not name.endswith(pieces[-1]):
        return False
    at = len(pieces[0])
    for piece in pieces[1:-1]:
        found = name.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return at <= len(name) - len(pieces[-1])


class _Lora(torch.nn.Module):
    """peft's LoRA layout: base_layer, lora_A.default, lora_B.default."""

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = torch.nn.Linear(4, 4).requires_grad_(False)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class _LoraLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.Module()
        self.attention.self = torch.nn.Module()
        self.attention.self.query, self.attention.self.value = _Lora(), _Lora()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention.self.query(x) + self.attention.self.value(x)


class _LoraModel(torch.nn.Module):
    """`base_model.model.encoder.layer.N.attention.self.query.lora_A.default.weight`: names
    that differ only in the layer index, far from both ends."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.base_model = torch.nn.Module()
        self.base_model.model = torch.nn.Module()
        self.base_model.model.encoder = torch.nn.Module()
        self.base_model.model.encoder.layer = torch.nn.ModuleList(
            [_LoraLayer() for _ in range(layers)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.base_model.model.encoder.layer:
            x = torch.tanh(layer(x))
        return x


def _train(model: torch.nn.Module, folder: Path, steps: int, before=None, **options) -> None:
    import modeltap

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    with modeltap.record(model, folder, **options) as rec:
        for step in range(steps):
            if before is not None:
                before(step)
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step()


@pytest.mark.parametrize("width", [80, 100])
def test_show_run_keeps_parameters_of_different_layers_apart(tmp_path, width):
    from modeltap.record import read_run
    from modeltap.render import run_table

    torch.manual_seed(0)
    model = _LoraModel(12)
    _train(model, tmp_path / "run", 2, every=1)
    text = render(run_table(read_run(tmp_path / "run"), 0, width=width), width)
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    table = lines[next(i for i, x in enumerate(lines) if x.startswith("parameter")) + 1 :]
    shown = [line.split()[0] for line in table if line.strip()]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(shown) == len(names) == 48
    for name, label in zip(names, shown, strict=True):
        # Each row reads as its own parameter and as no other (`layer.1` is not `layer.10`).
        assert _pieces_in_order(name, label), (name, label)
        readers = [n for n in names if _pieces_in_order(n, label) and _whole(n, label)]
        assert readers == [name], (label, readers)


def _whole(name: str, shown: str) -> bool:
    """The middle pieces of `shown` are whole dotted names of `name`."""
    middles = shown.split("…")[1:-1]
    return all(f".{m}." in f".{name}." for m in middles)


def test_fit_apart_tells_names_apart_that_differ_only_in_a_middle_index():
    from modeltap.render.run_tables import _fit_apart

    names = [f"model.encoder.block.{i}.layer.0.SelfAttention.q.weight" for i in (1, 10, 11, 2)]
    shown = _fit_apart(names, 24)
    assert len(set(shown)) == 4 and all(len(s) <= 24 for s in shown)
    for name, label in zip(names, shown, strict=True):
        assert label.endswith("…q.weight") and f"block.{name.split('.')[3]}…" in label
        assert [n for n in names if _pieces_in_order(n, label) and _whole(n, label)] == [name]


def test_show_run_says_that_another_rank_tripped(tmp_path, monkeypatch):
    """A DDP run whose rank 1 tripped: rank 0's default view says so and how to see it."""
    from typer.testing import CliRunner

    from modeltap.cli import app
    from modeltap.record import NonFiniteError, dist

    for rank in (0, 1):
        monkeypatch.setattr(dist, "rank_info", lambda rank=rank: dist.RankInfo(rank, 2, "gloo"))
        torch.manual_seed(0)
        model = _LoraModel(2)

        def poison(step, model=model, rank=rank):
            value = model.base_model.model.encoder.layer[1].attention.self.value.base_layer
            value.bias.data[0] = float("nan") if rank == 1 and step == 2 else 0.0

        if rank == 0:
            _train(model, tmp_path / "run", 4, before=poison, every=1, on_nonfinite="dump")
            continue
        with pytest.raises(NonFiniteError):
            _train(model, tmp_path / "run", 4, before=poison, every=1, on_nonfinite="dump")
    result = CliRunner().invoke(app, ["show", str(tmp_path / "run")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "rank 0 of 2" in result.output
    module = "base_model.model.encoder.layer.1.attention.self.value.base_layer"
    assert f"rank 1 tripped: step 2 forward, module '{module}'" in result.output
    assert f"'{module}' (show --rank 1 shows it)" in result.output
    result = CliRunner().invoke(app, ["show", str(tmp_path / "run"), "--rank", "1"])
    assert "rank 1 of 2" in result.output and "tripwire: step 2 forward" in result.output
    assert "rank 0 tripped" not in result.output
