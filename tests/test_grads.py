"""Gradients against independent references: autograd.grad written here, finite differences, and
the exact Jacobian."""

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.dump import load_dump
from modeltap.dumping import dump_model
from modeltap.grads import GradSpec
from modeltap.loading import Inputs
from modeltap.selection import Selection

runner = CliRunner()


def grads(model, inputs, path, selection=None, **spec):
    return load_dump(
        dump_model(
            model,
            inputs,
            path,
            selection=selection,
            grads=GradSpec(**spec),
            activations=False,
        )
    )


def outputs_of(model, names, **kwargs):
    """Plain forward hooks, written here: the reference activations, still in the graph."""
    found = {}
    modules = dict(model.named_modules())
    handles = [
        modules[n].register_forward_hook(lambda m, a, o, n=n: found.__setitem__(n, o))
        for n in names
    ]
    try:
        result = model(**kwargs)
    finally:
        for h in handles:
            h.remove()
    return found, result


@pytest.fixture(scope="module")
def bert(bert_dir):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(bert_dir).eval()
    batch = dict(
        AutoTokenizer.from_pretrained(bert_dir)(
            ["hello world", "the quick brown fox"], return_tensors="pt", padding=True
        )
    )
    return model, Inputs((), batch, {"texts": ["hello world", "the quick brown fox"]})


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype).eval()


def test_match_autograd_grad_for_every_selected_module(bert, tmp_path):
    model, inputs = bert
    # (Not a LayerNorm output: with the fresh weight of 1, its sum is constant, its gradient 0.)
    target = "encoder.layer.1.intermediate"
    dump = grads(model, inputs, tmp_path / "g.safetensors", target=target)
    names = [
        "embeddings.word_embeddings",
        "embeddings.LayerNorm",
        "encoder.layer.0.attention.self.query",
        "encoder.layer.0.intermediate.dense",
        "encoder.layer.1.attention.output.dense",
    ]
    acts, _ = outputs_of(model, [*names, target], **inputs.kwargs)
    y = acts[target]
    ref = torch.autograd.grad(y, [acts[n] for n in names], grad_outputs=torch.ones_like(y))
    for name, g in zip(names, ref, strict=True):
        assert float(g.norm()) > 1e-4, name
        torch.testing.assert_close(dump[f"grad/{name}"], g, rtol=1e-5, atol=1e-8, msg=name)
    meta = json.loads(dump.metadata["grad"])
    assert meta["target"] == target and meta["grad_output"] == "ones"
    assert dump.metadata["kind"] == "gradients"
    # The target's own gradient is the seed; modules after it have no path and store nothing.
    assert torch.equal(dump[f"grad/{target}"], torch.ones_like(y))
    assert meta["no_path"]["pooler.dense"] == "no path"
    assert "grad/pooler.dense" not in dump
    assert all(not k.startswith("grad/pooler") for k in dump.stored)


def test_central_finite_differences_in_float64(tmp_path):
    model = mlp(torch.float64)
    x = torch.randn(2, 5, dtype=torch.float64)
    v = torch.randn(2, 3, dtype=torch.float64)
    torch.save(v, tmp_path / "v.pt")
    dump = grads(
        model,
        Inputs((x,), {}, {}),
        tmp_path / "g.safetensors",
        target="2",
        wrt=("0",),
        grad_output=str(tmp_path / "v.pt"),
    )
    got = dump["grad/0"]
    h0 = model[0](x).detach()
    eps = 1e-6
    fd = torch.zeros_like(h0)
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(7)):
        e = torch.zeros_like(h0)
        e[tuple(idx)] = eps
        up = (v * model[2](model[1](h0 + e))).sum()
        down = (v * model[2](model[1](h0 - e))).sum()
        fd[tuple(idx)] = (up - down) / (2 * eps)
    torch.testing.assert_close(got, fd, rtol=1e-7, atol=1e-9)


def test_jacobian_norm_estimate_matches_the_exact_jacobian(tmp_path):
    model = mlp(torch.float64)
    x = torch.randn(3, 5, dtype=torch.float64)
    h0 = model[0](x).detach()
    exact = torch.autograd.functional.jacobian(lambda h: model[2](model[1](h)), h0)
    exact_sq = float(exact.pow(2).sum())
    ses = []
    for k in (16, 256):
        dump = grads(
            model,
            Inputs((x,), {}, {}),
            tmp_path / f"j{k}.safetensors",
            target="2",
            wrt=("0",),
            jacobian_norm=k,
        )
        est = json.loads(dump.metadata["grad"])["jacobian"]["0"]
        assert est["probes"] == k and est["mode"] == "batched"
        assert abs(est["squared"] - exact_sq) <= 3 * est["squared_se"], (k, est, exact_sq)
        ses.append(est["squared_se"])
    assert ses[1] < ses[0] / 2  # the standard error shrinks like 1/sqrt(K)


def test_jacobian_falls_back_to_a_loop_where_vmap_cannot(tmp_path, monkeypatch):
    real = torch.autograd.grad

    def no_batching(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("vmap: no batching rule")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", no_batching)
    model = mlp(torch.float64)
    x = torch.randn(3, 5, dtype=torch.float64)
    dump = grads(
        model, Inputs((x,), {}, {}), tmp_path / "j.safetensors", target="2", jacobian_norm=64
    )
    est = json.loads(dump.metadata["grad"])["jacobian"]["0"]
    h0 = model[0](x).detach()
    exact = torch.autograd.functional.jacobian(lambda h: model[2](model[1](h)), h0)
    assert est["mode"] == "loop"
    assert abs(est["squared"] - float(exact.pow(2).sum())) <= 3 * est["squared_se"]


def test_unit_grad_output_is_one_element(bert, tmp_path):
    model, inputs = bert
    dump = grads(
        model,
        inputs,
        tmp_path / "g.safetensors",
        target="encoder.layer.1.output",
        wrt=("embeddings.LayerNorm",),
        grad_output="unit:1,2,5",
    )
    acts, _ = outputs_of(model, ["embeddings.LayerNorm", "encoder.layer.1.output"], **inputs.kwargs)
    (ref,) = torch.autograd.grad(
        acts["encoder.layer.1.output"][1, 2, 5], acts["embeddings.LayerNorm"]
    )
    assert float(ref.norm()) > 1e-2
    torch.testing.assert_close(dump["grad/embeddings.LayerNorm"], ref, rtol=1e-5, atol=1e-7)


def test_state_restored_and_no_grad_left(bert, tmp_path):
    model, inputs = bert
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    model.embeddings.word_embeddings.weight.requires_grad_(False)
    try:
        dump = grads(
            model, inputs, tmp_path / "g.safetensors", target="encoder.layer.0.output", params=True
        )
        assert "grad/embeddings.word_embeddings.weight" in dump  # frozen, yet asked for
        assert not model.embeddings.word_embeddings.weight.requires_grad
    finally:
        model.embeddings.word_embeddings.weight.requires_grad_(True)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_parameter_gradients_match_and_tied_weights_once(gpt2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    batch = dict(
        AutoTokenizer.from_pretrained(gpt2_dir)(["hello world again"], return_tensors="pt")
    )
    dump = grads(model, Inputs((), batch, {}), tmp_path / "g.safetensors", loss="lm", params=True)
    meta = json.loads(dump.metadata["grad"])
    assert meta["target"] == "loss:lm"
    # The reference: transformers' own causal LM loss, differentiated by autograd.
    loss = model(**batch, labels=batch["input_ids"]).loss
    assert meta["loss_info"]["value"] == pytest.approx(float(loss.detach()), rel=1e-5)
    names = [n for n, _ in model.named_parameters()]
    ref = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
    for name, g in zip(names, ref, strict=True):
        torch.testing.assert_close(dump[f"grad/{name}"], g, rtol=1e-4, atol=1e-6, msg=name)
    tied = [k for k in meta["params"] if k in ("lm_head.weight", "transformer.wte.weight")]
    assert tied == ["transformer.wte.weight"]
    assert all(p.grad is None for p in model.parameters())


def test_frozen_model_still_gives_activation_gradients(bert_dir, tmp_path):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(bert_dir).eval().requires_grad_(False)
    batch = dict(AutoTokenizer.from_pretrained(bert_dir)(["hello world"], return_tensors="pt"))
    spec = {"target": "encoder.layer.1.intermediate", "wrt": ("embeddings.word_embeddings",)}
    frozen = grads(model, Inputs((), batch, {}), tmp_path / "f.safetensors", **spec)
    model.requires_grad_(True)
    trainable = grads(model, Inputs((), batch, {}), tmp_path / "t.safetensors", **spec)
    key = "grad/embeddings.word_embeddings"
    torch.testing.assert_close(frozen[key], trainable[key])
    assert float(frozen[key].norm()) > 0


def test_mlm_loss_masks_seeded_tokens(bert_dir, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bert_dir)
    model = AutoModelForMaskedLM.from_pretrained(bert_dir).eval()
    batch = dict(tok(["the quick brown fox jumps"], return_tensors="pt"))
    path = dump_model(
        model,
        Inputs((), batch, {}),
        tmp_path / "m.safetensors",
        selection=Selection(depth=2),
        grads=GradSpec(loss="mlm"),
        activations=False,
        mask_token_id=tok.mask_token_id,
        special_ids=tuple(tok.all_special_ids),
    )
    meta = json.loads(load_dump(path).metadata["grad"])
    (positions,) = meta["loss_info"]["masked_positions"]
    assert positions and 0 not in positions  # [CLS] is never masked
    ids = batch["input_ids"].clone()
    labels = torch.full_like(ids, -100)
    labels[0, positions] = ids[0, positions]
    ids[0, positions] = tok.mask_token_id
    ref = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=labels).loss
    assert meta["loss_info"]["value"] == pytest.approx(float(ref.detach()), rel=1e-5)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_errors_exit_2_without_a_file(bert_dir, tmp_path):
    cases = [
        (["--target", "encoder.layr.1.output"], "did you mean 'encoder.layer.1.output'"),
        (["--target", "encoder.layer.0", "--wrt", "encoder.layer.1"], "no gradient path"),
        (["--loss", "lm"], "needs a causal LM"),
        (["--target", "encoder.layer.0", "--grad-output", "unit:0,0"], "not an index"),
        (["--target", "encoder.layer.0", "--loss", "lm"], "drop --target or --loss"),
        (["--target", "encoder.layer.0", "--wrt", "embedings"], "did you mean 'embeddings'"),
        (["--target", "__root__"], "names no single tensor"),
    ]
    for extra, message in cases:
        result = invoke("grads", bert_dir, "hello", *extra, "-o", "g.safetensors")
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.stderr, (extra, result.stderr)
        assert "Traceback" not in result.output
        assert not (tmp_path / "g.safetensors").exists()
        assert not list(tmp_path.glob(".*tmp"))


def test_non_float_target_is_an_error(tmp_path):
    class Argmax(nn.Module):
        def forward(self, x):
            return x.argmax(-1)

    model = nn.Sequential(nn.Linear(4, 4), Argmax())
    with pytest.raises(Exception, match="int64, not float"):
        grads(model, Inputs((torch.randn(2, 4),), {}, {}), tmp_path / "g.safetensors", target="1")
    assert not (tmp_path / "g.safetensors").exists()


def test_cli_grads_reads_model_and_text_from_modeltap_toml(bert_dir, tmp_path):
    (tmp_path / "modeltap.toml").write_text(
        f'model = "{bert_dir}"\ntexts = ["hello world"]\n[grads]\ndepth = 3\n'
    )
    result = invoke("grads", "--target", "encoder.layer.1.output")
    assert result.exit_code == 0, result.output
    assert "gradients of encoder.layer.1.output" in result.stdout
    assert "no path" in result.stdout
    dump = load_dump(tmp_path / f"{bert_dir.name}.grads.safetensors")
    assert "grad/encoder.layer.0" in dump


def test_dump_with_grads_holds_both_and_show_renders_them(bert_dir, tmp_path):
    result = invoke(
        "dump",
        bert_dir,
        "hello world",
        "--grads",
        "--target",
        "encoder.layer.0.intermediate",
        "-o",
        "both.safetensors",
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert any(t["key"] == "encoder.layer.1" for t in report["tensors"])
    grads_ = {t["key"]: t for t in report["gradients"]["tensors"]}
    assert grads_["encoder.layer.1"]["no_path"] == "no path"
    assert grads_["embeddings"]["norm"] > 0
    dump = load_dump(tmp_path / "both.safetensors")
    assert dump.metadata["kind"] == "activations+gradients"
    assert "encoder.layer.1" in dump and "grad/embeddings" in dump
    shown = invoke("show", tmp_path / "both.safetensors")
    assert shown.exit_code == 0 and "gradients of encoder.layer.0.intermediate" in shown.stdout


def test_minilm_target_layer5_wrt_word_embeddings(minilm_dir, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    result = invoke(
        "grads",
        minilm_dir,
        "hello world",
        "--target",
        "encoder.layer.5.output",
        "--wrt",
        "embeddings.word_embeddings",
        "-o",
        "m.safetensors",
    )
    assert result.exit_code == 0, result.output
    got = load_dump(tmp_path / "m.safetensors")["grad/embeddings.word_embeddings"]
    # Reference: feed the word embeddings as inputs_embeds and differentiate the last hidden state.
    model = AutoModel.from_pretrained(minilm_dir).eval()
    batch = AutoTokenizer.from_pretrained(minilm_dir)(["hello world"], return_tensors="pt")
    x = model.embeddings.word_embeddings(batch["input_ids"]).detach().requires_grad_()
    out = model(
        inputs_embeds=x,
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
        output_hidden_states=True,
    )
    y = out.hidden_states[6]
    (ref,) = torch.autograd.grad(y, x, grad_outputs=torch.ones_like(y))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_every_metadata_key_written_is_documented(bert, tmp_path):
    from modeltap.dump import METADATA_KEYS

    model, inputs = bert
    path = dump_model(
        model, inputs, tmp_path / "b.safetensors", grads=GradSpec(target="encoder.layer.0")
    )
    assert set(load_dump(path).metadata) <= set(METADATA_KEYS)


def test_grad_spec_is_what_the_settings_ask_for():
    import dataclasses

    from modeltap.config import Settings

    # every field of the spec is a setting with the same default: nothing restated differently
    assert GradSpec.from_settings(Settings()) == GradSpec()
    assert {f.name for f in dataclasses.fields(GradSpec)} <= set(Settings.__dataclass_fields__)
    s = Settings(target="encoder", wrt=["a", "b"], loss="sum", grad_output="randn", params=True)
    s.jacobian_norm, s.probes, s.vanishing, s.exploding = 3, "gaussian", 1e-9, 1e2
    assert GradSpec.from_settings(s) == GradSpec(
        target="encoder",
        wrt=("a", "b"),
        loss="sum",
        grad_output="randn",
        params=True,
        jacobian_norm=3,
        probes="gaussian",
        vanishing=1e-9,
        exploding=1e2,
    )
