"""The low-precision what-if figures (`--formats`) against references written from the formats'
specifications here: each element type's grid enumerated from its bit layout, round-to-nearest-even
on that grid in numpy, the scales of each recipe in float32 numpy arithmetic."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from modeltap.errors import InputError
from modeltap.stats.formats import E4M3 as E4M3_T
from modeltap.stats.formats import E5M2 as E5M2_T
from modeltap.stats.formats import FORMATS, check_formats, format_error, quantize, round_float_


def _grid(exp_bits: int, man_bits: int, bias: int, fmax: float) -> np.ndarray:
    """The non-negative values of a float format, in encoding order, up to fmax (no inf/NaN)."""
    values = []
    for e in range(2**exp_bits):
        for m in range(2**man_bits):
            if e == 0:
                v = (m / 2**man_bits) * 2.0 ** (1 - bias)
            else:
                v = (1 + m / 2**man_bits) * 2.0 ** (e - bias)
            if v <= fmax:
                values.append(v)
    return np.array(values, dtype=np.float64)


E4M3 = _grid(4, 3, 7, 448.0)
E5M2 = _grid(5, 2, 15, 57344.0)
E2M1 = _grid(2, 1, 1, 6.0)


def _round_grid(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Nearest grid value of |v| (ties to the even encoding), saturated to the largest, signed."""
    a = np.minimum(np.abs(v).astype(np.float64), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.copysign(np.where(pick_hi, grid[hi], grid[lo]), v)


def _round_int(v: np.ndarray, qmax: float) -> np.ndarray:
    return np.clip(np.round(v), -qmax, qmax)  # numpy rounds half to even


def _blocks(x: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    rows = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    pad = -rows.shape[1] % size
    return np.pad(rows, ((0, 0), (0, pad))).reshape(-1, size), rows.shape[1]


def _unblock(q: np.ndarray, x: np.ndarray, last: int) -> np.ndarray:
    return q.reshape(-1, last + (-last % q.shape[1]))[:, :last].reshape(x.shape)


def _f32(v: float) -> np.float32:
    return np.float32(v)


def _per_tensor(x: np.ndarray, fmax: float, rnd) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(x).max() if x.size else np.float32(0)
    s = np.float32(amax / _f32(fmax))
    if s == 0:
        return np.zeros_like(x), np.zeros_like(x)
    v = (x / s).astype(np.float32)
    return (rnd(v) * s).astype(np.float32), v


def _per_block(x: np.ndarray, size: int, scale_of, fmax: float, rnd):
    b, last = _blocks(x, size)
    scale = scale_of(b)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    v = (b / safe).astype(np.float32)
    q = np.where(scale > 0, rnd(v) * safe, 0).astype(np.float32)
    return _unblock(q, x, last), _unblock(v, x, last)


def _mx_scale(emax: int):
    def scale_of(b: np.ndarray) -> np.ndarray:
        out = []
        for amax in np.abs(b).max(axis=1):
            if amax == 0:
                out.append(0.0)
            else:
                k = min(max(math.frexp(float(amax))[1] - 1 - emax, -127), 127)
                out.append(2.0**k)
        return np.array(out, dtype=np.float32)[:, None]

    return scale_of


def reference(x: torch.Tensor, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(Q(x), the scaled values before rounding) from the recipes, with x's non-finite kept."""
    xa = x.float().numpy()
    finite = np.isfinite(xa)
    xc = np.where(finite, xa, 0).astype(np.float32)
    if fmt == "fp8_e4m3":
        q, v = _per_tensor(xc, 448.0, lambda v: _round_grid(v, E4M3))
    elif fmt == "fp8_e5m2":
        q, v = _per_tensor(xc, 57344.0, lambda v: _round_grid(v, E5M2))
    elif fmt == "int8":
        q, v = _per_tensor(xc, 127.0, lambda v: _round_int(v, 127))
    elif fmt == "int4":
        amax7 = lambda b: (np.abs(b).max(axis=1, keepdims=True) / _f32(7)).astype(np.float32)  # noqa: E731
        q, v = _per_block(xc, 32, amax7, 7.0, lambda v: _round_int(v, 7))
    elif fmt == "mxfp8":
        q, v = _per_block(xc, 32, _mx_scale(8), 448.0, lambda v: _round_grid(v, E4M3))
    elif fmt == "mxfp4":
        q, v = _per_block(xc, 32, _mx_scale(2), 6.0, lambda v: _round_grid(v, E2M1))
    else:
        amax = np.abs(xc).max() if xc.size else np.float32(0)
        g = np.float32(amax / _f32(448.0 * 6.0))
        g = g if g > 0 else np.float32(1)

        def scale_of(b: np.ndarray) -> np.ndarray:
            raw = (np.abs(b).max(axis=1, keepdims=True) / (_f32(6) * g)).astype(np.float32)
            return (_round_grid(raw, E4M3).astype(np.float32) * g).astype(np.float32)

        q, v = _per_block(xc, 16, scale_of, 6.0, lambda v: _round_grid(v, E2M1))
    return np.where(finite, q, xa), v


HALF_STEP = {"fp8_e4m3": 464.0, "fp8_e5m2": 61440.0, "mxfp8": 464.0, "mxfp4": 7.0,
             "nvfp4": 7.0, "int8": 127.5, "int4": 7.5}  # fmt: skip


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(31)
    outliers = torch.randn(16, 96, generator=g)
    outliers[:, 7] *= 300.0
    outliers[3, 50] = -2.0e4
    wide = torch.randn(9, 45, generator=g) * 10.0 ** torch.empty(9, 45).uniform_(-9, 1, generator=g)
    nans = torch.randn(5, 70, generator=g)
    nans[1, 3] = float("nan")
    nans[2, :] = float("nan")
    nans[4, 9] = float("inf")
    far = torch.randn(2, 48, generator=g)
    far[0] *= 1e8  # nvfp4: row 1's block scales round to 0 in E4M3, so the blocks decode to 0
    return {
        "far": far,
        "random": torch.randn(8, 128, generator=g),
        "outliers": outliers,
        "subnormal": wide,
        "tiny": torch.randn(3, 40, generator=g) * 1e-39,
        "zeros": torch.zeros(4, 33),
        "nan": nans,
        "vector": torch.randn(77, generator=g),
        "bf16": torch.randn(6, 64, generator=g).bfloat16(),
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", list(_tensors()))
def test_quantize_matches_the_specification(fmt: str, kind: str) -> None:
    x = _tensors()[kind]
    want, _ = reference(x, fmt)
    got = quantize(x, fmt)
    assert got.shape == x.shape and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=0, equal_nan=True)


def reference_figures(x: torch.Tensor, fmt: str) -> dict[str, float | None]:
    """rel_rmse, sqnr_db, underflow and clipped from `reference`, in float64 numpy."""
    q, v = reference(x, fmt)
    xa = x.float().numpy().astype(np.float64)
    finite = np.isfinite(xa)
    xf, qf, vf = xa[finite], q[finite].astype(np.float64), v[finite]
    nonzero = xf != 0
    norm = np.linalg.norm(xf)
    rel = float(np.linalg.norm(qf - xf) / norm) if norm else 0.0
    count = max(int(nonzero.sum()), 1)
    return {
        "rel_rmse": rel,
        "sqnr_db": -20 * math.log10(rel) if rel else None,
        "underflow": ((qf == 0) & nonzero).sum() / count,
        "clipped": (np.abs(vf) > HALF_STEP[fmt]).sum() / count,
    }


def assert_figures(got: dict, want: dict) -> None:
    assert got["rel_rmse"] == pytest.approx(want["rel_rmse"], rel=1e-5, abs=1e-12)
    if want["sqnr_db"] is None:
        assert got["sqnr_db"] is None
    else:
        assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], abs=1e-4)
    assert got["underflow"] == pytest.approx(want["underflow"], abs=1e-12)
    assert got["clipped"] == pytest.approx(want["clipped"], abs=1e-12)


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
