"""compare's quantized variants (--against fp8 ... int4-weight) and --bisect, against plain torch
models with the weights (and inputs) quantized in the test."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from torch import nn
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.compare import Options, compare_models, make_candidate, parse_against
from modeltap.compare.bisect import bisect
from modeltap.compare.quantize import (
    TORCHAO,
    TORCHAO_FORMATS,
    _quantize,
    quantized,
    torchao_quantizers,
)
from modeltap.config import Settings, accumulated_allowance, tolerance_values
from modeltap.diff import Tolerance
from modeltap.errors import InputError
from modeltap.loading import Inputs
from modeltap.stats.formats import quantize
from tests.fixtures.architectures import gpt2, llama
from tests.test_formats import _tensors, reference

MINILM = Path(__file__).resolve().parents[1] / "models" / "all-MiniLM-L6-v2"
# --against NAME: the weights' format and the inputs' (None: weights only), from the issue
RECIPES = {
    "fp8": ("fp8_e4m3", "fp8_e4m3"),
    "mxfp8": ("mxfp8", "mxfp8"),
    "nvfp4": ("nvfp4", "nvfp4"),
    "int8-weight": ("int8", None),
    "int4-weight": ("int4", None),
}
OUTLIER = "layers.0.self_attn.v_proj"
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="needs torchao (the quant extra: scripts/setup.sh installs it)",
)


def _plain(model: nn.Module, variant: str, keep: tuple[str, ...] = ()) -> nn.Module:
    """`model` copied with every Linear but `keep` quantized by hand: weights swapped, inputs
    quantized by a forward pre-hook."""
    weights, inputs = RECIPES[variant]
    plain = copy.deepcopy(model)
    for name, module in plain.named_modules():
        if not isinstance(module, nn.Linear) or name in keep:
            continue
        with torch.no_grad():
            module.weight.copy_(quantize(module.weight.float(), weights))
        if inputs is not None:
            module.register_forward_pre_hook(lambda m, args, f=inputs: (quantize(args[0], f),))
    return plain


@pytest.mark.parametrize("variant", ["int4-weight", "nvfp4"])
def test_gpt2_conv1d_is_quantized_along_its_input_features(variant: str) -> None:
    model, batch = gpt2()
    candidate = make_candidate(model, parse_against(variant), shared=True)
    weights, inputs = RECIPES[variant]
    plain = copy.deepcopy(model)
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert conv1d
    for name in conv1d:
        module = plain.get_submodule(name)
        # Conv1D computes x @ W + b with W [in, out]: a Linear's weight is W.T
        want = quantize(module.weight.t().float(), weights).t()
        assert torch.equal(candidate.get_submodule(name).weight, want), name
        with torch.no_grad():
            module.weight.copy_(want)
        if inputs is not None:
            module.register_forward_pre_hook(lambda m, args, f=inputs: (quantize(args[0], f),))
    torch.testing.assert_close(_out(candidate, batch), _out(plain, batch))


def _out(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).last_hidden_state


def _within(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> bool:
    """The bf16 preset's rule, written out: elementwise and cosine."""
    limit = tol.atol + tol.rtol * want.abs() + tol.scaled_atol * want.abs().max()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    return bool(((got - want).abs() <= limit).all()) and float(cosine) >= (tol.min_cosine or -1)


def _options() -> Options:
    s = Settings()
    values = tolerance_values(s, preset="bf16")
    return Options(
        tolerance=Tolerance(**{k: v for k, v in values.items() if k != "upcast"}),
        accumulated_scaled_atol=accumulated_allowance(s, "bf16"),
    )


def _outlier_llama(scale: float = 1000.0) -> tuple[nn.Module, dict]:
    model, batch = llama()
    if scale != 1:
        with torch.no_grad():
            model.get_submodule(OUTLIER).weight[3] *= scale
    return model, batch


@pytest.mark.parametrize("variant", list(RECIPES))
def test_variant_weights_and_output_equal_plain_torch(variant: str) -> None:
    model, batch = llama()
    candidate = make_candidate(model, parse_against(variant), shared=True)
    weights, _ = RECIPES[variant]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears
    for name in linears:
        want = quantize(model.get_submodule(name).weight.float(), weights)
        assert torch.equal(candidate.get_submodule(name).weight, want), name
    assert not any(torch.equal(model.get_submodule(n).weight, want) for n in linears[:1])
    torch.testing.assert_close(_out(candidate, batch), _out(_plain(model, variant), batch))
    # the reference is left as it was
    torch.testing.assert_close(_out(model, batch), _out(llama()[0], batch), rtol=0, atol=0)


def _bisect(model: nn.Module, batch: dict, tmp_path: Path, variant: str = "int8-weight"):
    candidate = make_candidate(model, parse_against(variant), shared=True)
    inputs = Inputs((), {**batch, "use_cache": False}, "ids")
    modules = [n or "__root__" for n, _ in model.named_modules()]
    report = compare_models(model, candidate, inputs, modules, tmp_path, options=_options())
    return report, bisect(model, candidate, inputs, report, _options())


def test_bisect_keeps_the_planted_outlier(tmp_path: Path) -> None:
    model, batch = _outlier_llama()
    report, found = _bisect(model, batch, tmp_path)
    tol = _options().accumulated(_options().tolerance)
    reference = _out(model, batch)
    assert not report.passed
    assert not _within(_out(_plain(model, "int8-weight"), batch), reference, tol)
    assert found.kept == [OUTLIER] and found.passed
    # with only that module kept, the model passes: run by hand
    assert _within(_out(_plain(model, "int8-weight", keep=(OUTLIER,)), batch), reference, tol)
    assert found.curve[0].passed is False and found.curve[-1].passed
    weights = model.get_submodule(OUTLIER).weight.numel()
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert found.kept_parameters == sum(model.get_submodule(n).weight.numel() for n in found.kept)
    assert found.share == pytest.approx(found.kept_parameters / total)
    assert weights <= found.kept_parameters


def test_bisect_without_outlier_keeps_little(tmp_path: Path) -> None:
    model, batch = _outlier_llama(scale=1)
    _, found = _bisect(model, batch, tmp_path)
    assert found.passed and len(found.kept) <= 1


def test_no_linear_has_nothing_to_quantize() -> None:
    model = nn.Sequential(nn.Conv1d(2, 2, 1), nn.ReLU())
    with pytest.raises(InputError, match="nothing to quantize"):
        make_candidate(model, parse_against("int8-weight"), shared=True)


def test_unknown_variant_lists_the_known_ones() -> None:
    with pytest.raises(InputError) as info:
        parse_against("int3-weight")
    assert "int8-weight" in str(info.value) or "int4-weight" in str(info.value)


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["compare", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.skipif(not MINILM.is_dir(), reason="needs models/all-MiniLM-L6-v2")
def test_minilm_int8_weight_through_the_cli(tmp_path: Path) -> None:
    out, html = tmp_path / "keep.toml", tmp_path / "page.html"
    code, stdout, _ = _cli(
        str(MINILM), "The cat sat on the mat.", "--against", "int8-weight", "--json",
        "--bisect", "--bisect-out", str(out), "--html", str(html),
    )  # fmt: skip
    report = json.loads(stdout)
    assert report["candidate"]["variant"] == "int8-weight"
    assert report["candidate"]["quantization"] == "emulated"
    found = report["bisect"]
    assert code == (0 if found["passed"] else 1)
    assert tomllib.loads(out.read_text())["modules_to_not_convert"] == (
        found["modules_to_not_convert"]
    )
    assert found["curve"][0]["kept"] == 0 and not found["curve"][0]["passed"]
    assert found["kept_parameters"] == sum(
        int(torch.tensor(_shape(n)).prod()) for n in found["modules_to_not_convert"]
    )
    page = html.read_text()
    assert "compare-bisect" in page
    assert all(name in page for name in found["modules_to_not_convert"])


def _shape(name: str) -> list[int]:
    """A MiniLM Linear's weight shape, from its config: hidden 384, intermediate 1536."""
    if name.endswith("intermediate.dense"):
        return [1536, 384]
    if name.endswith("output.dense") and ".attention." not in name:
        return [384, 1536]
    return [384, 384]


@pytest.mark.skipif(not MINILM.is_dir(), reason="needs models/all-MiniLM-L6-v2")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--against", "int3-weight"], "int8-weight"),
        (["--against", "bf16", "--bisect"], "quantized variant"),
        (["--against", "int8-weight", "--bisect-out", "x.toml"], "add --bisect"),
        (["--against", "int8-weight", "--bisect", "--bisect-out", "x.yaml"], ".toml or a .json"),
    ],
)
def test_bad_requests_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    args = [a.replace("x.", str(tmp_path / "x.")) for a in args]
    code, stdout, stderr = _cli(str(MINILM), "hello", *args)
    assert code == 2 and stdout == ""
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and message in stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not MINILM.is_dir(), reason="needs models/all-MiniLM-L6-v2")
def test_bisect_on_a_passing_compare_keeps_nothing() -> None:
    code, stdout, _ = _cli(
        str(MINILM), "hello", "--against", "int8-weight", "--bisect", "--preset", "tf32",
        "--atol", "1",
    )
    assert code == 0
    assert "bisect: nothing needs keeping" in stdout and "\nthe output is within" in stdout


@needs_torchao
@pytest.mark.parametrize("fmt", TORCHAO_FORMATS)
# "tiny" (amax ~1e-39) left out: torchao's MX scale floor is 2^-126, the spec's 2^-127
@pytest.mark.parametrize("kind", [k for k in _tensors() if k != "tiny"])
def test_torchao_quantizers_equal_the_specification_and_the_emulation(fmt: str, kind: str) -> None:
    x = _tensors()[kind].float()
    got = _quantize(x, fmt, TORCHAO)
    want, _ = reference(x, fmt)
    np.testing.assert_array_equal(got.numpy(), want)
    torch.testing.assert_close(got, quantize(x, fmt), rtol=0, atol=0, equal_nan=True)


@needs_torchao
def test_fp8_and_mxfp8_run_through_torchao_the_others_emulated() -> None:
    model, _ = llama()
    engines = {
        v: quantized(make_candidate(model, parse_against(v), shared=True)).engine
        for v in RECIPES
    }
    assert engines == {
        "fp8": "torchao",
        "mxfp8": "torchao",
        "nvfp4": "emulated",
        "int8-weight": "emulated",
        "int4-weight": "emulated",
    }


@pytest.fixture
def no_torchao(monkeypatch: pytest.MonkeyPatch):
    """torchao made unimportable: every `import torchao...` raises ImportError."""
    torchao_quantizers.cache_clear()
    for name in [n for n in sys.modules if n.split(".")[0] == "torchao"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    yield
    torchao_quantizers.cache_clear()


@pytest.mark.usefixtures("no_torchao")
@pytest.mark.parametrize("variant", ["fp8", "mxfp8"])
def test_without_torchao_the_variant_is_emulated(variant: str) -> None:
    assert torchao_quantizers() is None
    model, batch = llama()
    candidate = make_candidate(model, parse_against(variant), shared=True)
    assert quantized(candidate).engine == "emulated"
    torch.testing.assert_close(_out(candidate, batch), _out(_plain(model, variant), batch))


@pytest.mark.skipif(not MINILM.is_dir(), reason="needs models/all-MiniLM-L6-v2")
@pytest.mark.parametrize("torchao", [pytest.param(True, marks=needs_torchao), False])
def test_the_report_says_which_quantizer_ran(torchao: bool, request, tmp_path: Path) -> None:
    if not torchao:
        request.getfixturevalue("no_torchao")
    html = tmp_path / "page.html"
    args = [str(MINILM), "The cat sat on the mat.", "--against", "fp8"]
    _, stdout, _ = _cli(*args, "--json", "--html", str(html))
    engine = "torchao" if torchao else "emulated"
    assert json.loads(stdout)["candidate"]["quantization"] == engine
    assert f"quantization {engine}" in html.read_text()
    _, text, _ = _cli(*args)
    assert f"candidate fp8 (float32, cpu, {engine})" in text
