"""The facade's verbs over packages, each against what plain torch/transformers compute:
`modeltap.grads`, `modeltap.compare`, `modeltap.generate` and `modeltap.report`."""

from __future__ import annotations

import copy

import pytest
import torch

import modeltap
from modeltap.dump import load_dump


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3), torch.nn.Tanh()
    ).eval()


def test_grads_verb_stores_what_autograd_computes(tmp_path):
    """The gradient of sum(output) w.r.t. each selected module's output, and a weight's."""
    model = _mlp()
    x = torch.randn(2, 4)
    hidden = model[0](x)
    out = model[3](model[2](model[1](hidden)))
    want_hidden, want_weight = torch.autograd.grad(out.sum(), [hidden, model[2].weight])
    path = modeltap.grads(model, x, tmp_path / "g.safetensors", params=True)
    dump = load_dump(path)
    torch.testing.assert_close(dump["grad/0"], want_hidden, rtol=1e-5, atol=1e-7)
    weight_keys = [k for k in dump.stored if k.startswith("grad/") and k.endswith("2.weight")]
    assert weight_keys, sorted(dump.stored)
    torch.testing.assert_close(dump[weight_keys[0]], want_weight, rtol=1e-5, atol=1e-7)
    assert not any(k == "0" for k in dump.stored)  # gradients only
    import modeltap.grads as package

    assert package is modeltap.grads and package.GradSpec is not None


def test_compare_verb_names_the_nudged_module_and_passes_against_itself():
    model = _mlp()
    x = torch.randn(3, 4)
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        nudged[2].weight[0, 0] += 0.5
    report = modeltap.compare(model, nudged, x)
    assert not report.passed
    assert [m.name for m in report.origins] == ["2"]
    assert modeltap.compare(model, copy.deepcopy(model), x).passed
    from modeltap.compare import compare_models

    assert compare_models is modeltap.compare.compare_models


def test_compare_verb_takes_a_variant_name():
    model = _mlp()
    report = modeltap.compare(model, "bf16", torch.randn(3, 4))
    assert report.preset == "bf16"
    assert {m.name for m in report.modules} >= {"0", "2"}


def test_generate_verb_chooses_the_tokens_of_greedy_generate(tmp_path, gpt2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(gpt2_dir)
    prompt = "hello world"
    ids = tokenizer(prompt, return_tensors="pt")
    want = model.generate(**ids, max_new_tokens=5, do_sample=False, num_beams=1)
    want_new = want[0, ids["input_ids"].shape[1] :].tolist()
    done = modeltap.generate(model, tokenizer, prompt, tmp_path / "g.safetensors", max_new_tokens=5)
    assert done.new_ids[0] == want_new
    assert done.path is not None and done.path.is_file()
    assert modeltap.generate.step_view is not None


def test_report_verb_writes_a_page_naming_the_dumps_modules(tmp_path):
    pytest.importorskip("plotly")
    from collections import OrderedDict

    names = ["encoder_in", "squash_mid", "decoder_out"]
    layers = [torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    model = torch.nn.Sequential(OrderedDict(zip(names, layers, strict=True))).eval()
    path = modeltap.dump(model, torch.randn(2, 4), tmp_path / "d.safetensors")
    page = modeltap.report(path, tmp_path / "d.html")
    assert page == tmp_path / "d.html"
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    assert all(name in html for name in names)


def test_verbs_refuse_what_they_cannot_do_with_the_fix(tmp_path):
    from modeltap.errors import InputError

    model = _mlp()
    with pytest.raises(InputError, match="modeltap compare --against compile"):
        modeltap.compare(model, "compile", torch.randn(3, 4))
    with pytest.raises(InputError, match="one of sum"):
        modeltap.grads(model, torch.randn(2, 4), tmp_path / "g.safetensors", loss="l2")
    assert not (tmp_path / "g.safetensors").exists()
    pytest.importorskip("plotly")
    path = modeltap.dump(model, torch.randn(2, 4), tmp_path / "d.safetensors")
    with pytest.raises(InputError, match="out="):
        modeltap.report(path, tmp_path)
