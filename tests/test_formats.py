"""The low-precision what-if figures (`--formats`) against references written from the formats'
specifications (tests/fixtures/quant_reference.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from modeltap.errors import InputError
from modeltap.stats.formats import E4M3 as E4M3_T
from modeltap.stats.formats import E5M2 as E5M2_T
from modeltap.stats.formats import FORMATS, check_formats, format_error, quantize, round_float_
from tests.fixtures.quant_reference import (
    E4M3,
    E5M2,
    assert_figures,
    reference,
    reference_figures,
)
from tests.fixtures.quant_reference import sample_tensors as _tensors


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", list(_tensors()))
def test_quantize_matches_the_specification(fmt: str, kind: str) -> None:
    x = _tensors()[kind]
    want, _ = reference(x, fmt)
    got = quantize(x, fmt)
    assert got.shape == x.shape and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["random", "outliers", "subnormal", "nan", "zeros", "bf16"])
def test_format_error_figures(fmt: str, kind: str) -> None:
    x = _tensors()[kind]
    assert_figures(format_error(x, fmt), reference_figures(x, fmt))


def test_outliers_clip_in_mx_and_underflow_in_int8() -> None:
    x = _tensors()["outliers"]
    assert format_error(x, "int8")["underflow"] > 0.5  # a 2e4 outlier: s = 157, randn -> 0
    assert format_error(x, "mxfp8")["clipped"] > 0  # OCP's scale leaves block maxima above 448
    assert format_error(x, "nvfp4")["sqnr_db"] > format_error(x, "mxfp4")["sqnr_db"]


def test_unknown_format_lists_the_known_ones() -> None:
    with pytest.raises(InputError, match="known formats: fp8_e4m3, fp8_e5m2, mxfp8"):
        check_formats(["int8", "fp6"])
    assert check_formats(["INT8", " mxfp4", "int8", ""]) == ["int8", "mxfp4"]


def _outlier_model(scale: float) -> torch.nn.Module:
    """Linear -> LayerNorm -> Linear (output row 7 scaled by `scale`) -> LayerNorm -> Linear."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 16),
    )
    with torch.no_grad():
        model[2].weight[7] *= scale
        model[2].bias[7] *= scale
    return model.eval()


def test_dump_figures_equal_the_reference_from_the_dumped_tensors(tmp_path) -> None:
    from safetensors import safe_open

    import modeltap

    x = torch.randn(4, 21, 32, generator=torch.Generator().manual_seed(3))
    path = modeltap.dump(_outlier_model(50.0), x, tmp_path / "d.safetensors", formats=FORMATS)
    stats = json.loads(safe_open(path, "pt").metadata()["stats"])
    with safe_open(path, "pt") as f:
        keys = list(f.keys())
        assert keys
        for key in keys:
            tensor = f.get_tensor(key)
            for fmt in FORMATS:
                assert_figures(stats[key]["formats"][fmt], reference_figures(tensor, fmt))


def test_bf16_tensors_are_measured_against_their_own_values(tmp_path) -> None:
    from safetensors import safe_open

    import modeltap

    model = _outlier_model(1.0).to(torch.bfloat16)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    path = modeltap.dump(model, x, tmp_path / "b.safetensors", formats=["fp8_e5m2", "nvfp4"])
    stats = json.loads(safe_open(path, "pt").metadata()["stats"])
    with safe_open(path, "pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
            assert tensor.dtype == torch.bfloat16
            for fmt in ("fp8_e5m2", "nvfp4"):
                assert_figures(stats[key]["formats"][fmt], reference_figures(tensor, fmt))


def _worst(entries: list[dict], fmt: str, figure: str) -> str:
    with_fmt = [e for e in entries if "formats" in e]
    pick = min if figure == "sqnr_db" else max
    return pick(with_fmt, key=lambda e: e["formats"][fmt][figure])["key"]


@pytest.mark.parametrize(
    ("scale", "fmt", "figure"),
    [
        (30.0, "int8", "sqnr_db"),  # the other channels rounded to a few steps of int8
        (1e5, "int8", "underflow"),  # ... or to zero
        (1e5, "fp8_e4m3", "underflow"),  # below e4m3's smallest subnormal after amax scaling
    ],
)
def test_a_planted_outlier_channel_is_the_worst(tmp_path, scale, fmt, figure) -> None:
    from modeltap.dump import load_dump
    from modeltap.render.tree import dump_json

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "o.safetensors"
    modeltap_dump(_outlier_model(scale), x, path, formats=[fmt], stats_only=True)
    entries = dump_json(load_dump(path))["tensors"]
    assert _worst(entries, fmt, figure) == "2"
    plain = tmp_path / "p.safetensors"
    modeltap_dump(_outlier_model(1.0), x, plain, formats=[fmt], stats_only=True)
    planted = next(e for e in entries if e["key"] == "2")["formats"][fmt][figure]
    unplanted = next(e for e in dump_json(load_dump(plain))["tensors"] if e["key"] == "2")
    if figure == "sqnr_db":
        assert planted < unplanted["formats"][fmt][figure] - 10
    else:
        assert planted > 0.2 and unplanted["formats"][fmt][figure] < 0.05


def modeltap_dump(*args, **kwargs):
    import modeltap

    return modeltap.dump(*args, **kwargs)


def test_minilm_dump_with_formats_through_the_cli(minilm_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from modeltap.cli import app

    out = tmp_path / "m.safetensors"
    args = ["dump", str(minilm_dir), "The cat sat on the mat.", "--formats", ",".join(FORMATS)]
    result = CliRunner().invoke(app, [*args, "--stats-only", "--json", "-o", str(out)])
    assert result.exit_code == 0, result.output
    tensors = json.loads(result.stdout)["tensors"]
    assert len(tensors) > 10
    for entry in tensors:
        assert set(entry["formats"]) == set(FORMATS)
        for figures in entry["formats"].values():
            assert set(figures) == {"rel_rmse", "sqnr_db", "underflow", "clipped"}
            assert 0 < figures["rel_rmse"] < 1
    # E4M3 keeps 3 mantissa bits: about 31 dB on any tensor amax scaling leaves in range
    assert all(e["formats"]["fp8_e4m3"]["sqnr_db"] > 25 for e in tensors)
    shown = CliRunner().invoke(app, ["show", str(out)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    header = next(line for line in shown.stdout.splitlines() if line.startswith("module"))
    words = header.split()
    assert words[words.index("dead") + 1 :][:7] == list(FORMATS)  # before "same tensor as"


def test_an_unknown_format_is_one_line_and_no_file(minilm_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from modeltap.cli import app

    out = tmp_path / "m.safetensors"
    args = ["dump", str(minilm_dir), "hi", "--formats", "int8,fp6", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "error: unknown format 'fp6'; known formats: fp8_e4m3, fp8_e5m2, mxfp8, mxfp4, nvfp4, "
        "int8, int4"
    ]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("element", "dtype"), [(E4M3_T, torch.float8_e4m3fn), (E5M2_T, torch.float8_e5m2)]
)
def test_the_fp8_rounding_is_torchs_float8_cast(element, dtype) -> None:
    g = torch.Generator().manual_seed(8)
    fmax = element[2]
    v = torch.randn(4096, generator=g) * 10.0 ** torch.empty(4096).uniform_(-6, 2.6, generator=g)
    v = v.clamp(-fmax, fmax)
    grid = torch.tensor(E4M3 if dtype == torch.float8_e4m3fn else E5M2, dtype=torch.float32)
    ties = (grid[1:] + grid[:-1]) / 2  # exactly half-way: the even one
    v = torch.cat([v, ties, -ties])
    assert torch.equal(round_float_(v.clone(), element), v.to(dtype).float())


def test_record_stores_the_figures_of_activations_and_gradients(tmp_path) -> None:
    from safetensors import safe_open

    import modeltap

    model = _outlier_model(30.0).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(6)
    fmts = ("int8", "mxfp8")
    with modeltap.record(model, tmp_path / "run", every=1, stats_only=False, formats=fmts) as rec:
        for _ in range(2):
            model(torch.randn(16, 32, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    path = tmp_path / "run" / "step000001.rank0.safetensors"
    stats = json.loads(safe_open(path, "pt").metadata()["stats"])
    with safe_open(path, "pt") as f:
        keys = [k for k in f.keys() if k in stats]
        assert any(k.startswith("grad/") for k in keys) and any("/" not in k for k in keys)
        for key in keys:
            tensor = f.get_tensor(key)
            for fmt in fmts:
                assert_figures(stats[key]["formats"][fmt], reference_figures(tensor, fmt))
    with pytest.raises(InputError, match="known formats"):
        modeltap.record(model, tmp_path / "bad", formats=["fp6"])


# The paths `format_errors` takes (stats/formats.py): on the CPU, cache-sized chunks and amax
# looked at; elsewhere one chunk, no wait, the formats' rows reduced together, torch's float8
# casts. Each must give the reference's figures, whichever the tensor.
def _extreme_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(32)
    huge = torch.randn(4, 64, generator=g)
    huge[1, 5] = 3e37  # squares past float32's range
    return {
        "tiny": torch.randn(3, 40, generator=g) * 1e-39,  # squares below float32's least
        "small": torch.randn(5, 96, generator=g) * 1e-25,
        "huge": huge,
        "span": torch.randn(9, 45, generator=g) * 10.0 ** torch.empty(9, 45).uniform_(-38, 30),
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", list(_extreme_tensors()))
def test_figures_of_extreme_magnitudes(fmt: str, kind: str) -> None:
    x = _extreme_tensors()[kind]
    assert_figures(format_error(x, fmt), reference_figures(x, fmt))


@pytest.mark.parametrize("kind", ["random", "outliers", "subnormal", "nan", "zeros", "bf16", "far"])
def test_the_device_path_gives_the_same_figures(monkeypatch, kind: str) -> None:
    from modeltap.stats import formats

    x = _tensors()[kind]
    on_host = formats.format_errors(x, FORMATS)
    monkeypatch.setattr(formats, "_on_host", lambda device: False)
    on_device = formats.format_errors(x, FORMATS)
    for fmt in FORMATS:
        assert_figures(on_device[fmt], reference_figures(x, fmt))
        assert_figures(on_device[fmt], on_host[fmt])
        np.testing.assert_array_equal(formats.quantize(x, fmt).numpy(), reference(x, fmt)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_many_chunks_add_up_to_the_whole(monkeypatch, dtype) -> None:
    from modeltap.stats import formats

    monkeypatch.setattr(formats, "_PER_THREAD", 96)  # chunks of 96 values (or 192): 3 rows each
    g = torch.Generator().manual_seed(33)
    x = (torch.randn(40, 32, generator=g) * torch.logspace(-3, 3, 40)[:, None]).to(dtype)
    x[7] = 0.0
    got = formats.format_errors(x, FORMATS, finite=True)
    for fmt in FORMATS:
        assert_figures(got[fmt], reference_figures(x, fmt))


@pytest.mark.parametrize("spare", [0, 1])
@pytest.mark.parametrize("stats_only", [True, False])
def test_large_tensors_get_the_same_figures_on_any_thread(tmp_path, monkeypatch, spare, stats_only):
    """A tensor of a MiB or more is measured off the model's thread (the writer's ring, or the
    stats-only workers), or on it when no core is spare: the figures equal the reference either
    way (the stored tensor, or the model's output recomputed here)."""
    from safetensors import safe_open

    import modeltap
    from modeltap.dump import pipeline, writer

    monkeypatch.setattr(pipeline, "spare_cores", lambda: spare)
    monkeypatch.setattr(writer, "spare_cores", lambda: spare)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU())
    x = torch.randn(4, 160, 64, generator=torch.Generator().manual_seed(5))  # 1.25 MiB outputs
    path = modeltap.dump(model, x, tmp_path / "d.safetensors", formats=("int8", "nvfp4"),
                         stats_only=stats_only)  # fmt: skip
    stats = json.loads(safe_open(path, "pt").metadata()["stats"])
    with torch.no_grad():
        outputs = {"0": model[0](x), "1": model(x)}
    for key, value in outputs.items():
        for fmt in ("int8", "nvfp4"):
            assert_figures(stats[key]["formats"][fmt], reference_figures(value, fmt))
