"""dump and grads across the main model families, checked against transformers' own hidden states.

Each family is a tiny random model (tests/fixtures/architectures.py). modeltap dumps every module
and takes the gradients of the model's main output w.r.t. every module; the test then runs plain
transformers with `output_hidden_states=True` and checks, for each entry of hidden_states that is
exactly some block's output, that modeltap stored that very tensor, and that modeltap's gradient
there equals `torch.autograd.grad` of the same target w.r.t. that hidden state.

Where hidden_states[k] sits differs by family (the ALIGN table):
- Encoders (BERT, ViT, Wav2Vec2, CLIP's towers, BART, DETR's encoder): hidden_states[i + 1] is
  block i's output, the last block included. hidden_states[0] is what enters the first block:
  the embeddings module's output, or the norm after it (Wav2Vec2's encoder.layer_norm, CLIP
  vision's pre_layrnorm, BART's layernorm_embedding); DETR's encoder input (the flattened
  projected backbone features) and decoder input (zeros) are no module's output, not compared.
- Decoders with a final norm (Llama, GPT-2, Mixtral, T5's stacks, DETR's decoder): the last entry
  is the final norm's output, not the last block's: transformers replaces it. The last block's
  own output is in no entry, so it is not compared; the final norm's output is.
- Mamba appends after every block and has no embeddings entry: hidden_states[i] is block i's
  output, and the last entry is norm_f's.
- ModernBERT appends the final norm's output after the last block's; RecurrentGemma's first
  entry (the scaled embedding) is no module's output, not compared.

`test_every_key_and_repeated_call_equals_plain_hooks` then checks every key of every family, each
repeated call (`name@k`) included, against plain forward hooks written in the test.
Block outputs that are tuples are stored under `block:0` (modeltap's key naming).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from modeltap.capture import capture, flatten, split_key
from modeltap.cli import app
from modeltap.dumping import dump_model
from modeltap.errors import RunError
from modeltap.grads import GradSpec
from modeltap.loading import Inputs, add_decoder_inputs
from modeltap.selection import ROOT
from tests.fixtures.architectures import BUILDERS

runner = CliRunner()

# family -> {path of a hidden state in transformers' output: modeltap key of the same tensor}
ALIGN: dict[str, dict[str, str]] = {
    "bert": {  # encoder
        "hidden_states.0": "embeddings",
        "hidden_states.1": "encoder.layer.0",
        "hidden_states.2": "encoder.layer.1",
    },
    "llama": {  # decoder with cache, rotary; last entry is after the final RMSNorm
        "hidden_states.0": "embed_tokens",
        "hidden_states.1": "layers.0",
        "hidden_states.2": "norm",
    },
    "gpt2": {  # decoder with cache, learned positions; last entry is after ln_f
        "hidden_states.0": "drop",
        "hidden_states.1": "h.0",
        "hidden_states.2": "ln_f",
    },
    "mixtral": {  # mixture of experts
        "hidden_states.0": "embed_tokens",
        "hidden_states.1": "layers.0",
        "hidden_states.2": "norm",
    },
    "mamba": {  # state-space model
        "hidden_states.0": "layers.0",
        "hidden_states.1": "layers.1",
        "hidden_states.2": "norm_f",
    },
    "bart": {  # encoder-decoder without final norms
        "encoder_hidden_states.0": "encoder.layernorm_embedding",
        "encoder_hidden_states.1": "encoder.layers.0",
        "encoder_hidden_states.2": "encoder.layers.1",
        "decoder_hidden_states.0": "decoder.layernorm_embedding",
        "decoder_hidden_states.1": "decoder.layers.0",
        "decoder_hidden_states.2": "decoder.layers.1",
    },
    "t5": {  # encoder-decoder with final norms; blocks return tuples
        "encoder_hidden_states.0": "encoder.embed_tokens",
        "encoder_hidden_states.1": "encoder.block.0:0",
        "encoder_hidden_states.2": "encoder.final_layer_norm",
        "decoder_hidden_states.0": "decoder.embed_tokens",
        "decoder_hidden_states.1": "decoder.block.0:0",
        "decoder_hidden_states.2": "decoder.final_layer_norm",
    },
    "vit": {  # vision
        "hidden_states.0": "embeddings",
        "hidden_states.1": "layers.0",
        "hidden_states.2": "layers.1",
    },
    "wav2vec2": {  # audio
        "hidden_states.0": "encoder.layer_norm",
        "hidden_states.1": "encoder.layers.0",
        "hidden_states.2": "encoder.layers.1",
    },
    "clip": {  # two towers
        "text_model_output.hidden_states.0": "text_model.embeddings",
        "text_model_output.hidden_states.1": "text_model.encoder.layers.0",
        "text_model_output.hidden_states.2": "text_model.encoder.layers.1",
        "vision_model_output.hidden_states.0": "vision_model.pre_layrnorm",
        "vision_model_output.hidden_states.1": "vision_model.encoder.layers.0",
        "vision_model_output.hidden_states.2": "vision_model.encoder.layers.1",
    },
    "gemma3_text": {  # sliding and full attention layers, rotary_emb called once per type
        "hidden_states.0": "embed_tokens",
        "hidden_states.1": "layers.0",
        "hidden_states.2": "norm",
    },
    "modernbert": {  # local and global attention layers; appends the final norm's output
        "hidden_states.0": "embeddings",
        "hidden_states.1": "layers.0",
        "hidden_states.2": "layers.1",
        "hidden_states.3": "final_norm",
    },
    "recurrent_gemma": {  # the scaled embedding that enters the first block is no module's
        "hidden_states.1": "layers.0",
        "hidden_states.2": "final_norm",
    },
    "detr": {  # decodes from learned queries: no decoder_input_ids; decoder ends in a layernorm
        "encoder_hidden_states.1": "encoder.layers.0",
        "encoder_hidden_states.2": "encoder.layers.1",
        "decoder_hidden_states.1": "decoder.layers.0",
        "decoder_hidden_states.2": "decoder.layernorm",
    },
}


def read(path):
    """Every stored tensor of a dump, and its metadata, with safetensors alone."""
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
        meta = f.metadata()
    aliases = json.loads(meta.get("aliases", "{}"))
    return {**tensors, **{a: tensors[k] for a, k in aliases.items()}}, meta


@pytest.mark.parametrize("family", sorted(ALIGN))
def test_dump_and_grads_equal_transformers_hidden_states(family, tmp_path):
    model, kwargs = BUILDERS[family]()
    inputs = add_decoder_inputs(model, Inputs((), kwargs, {}))
    if family == "detr":  # the regression: DETR takes no decoder_input_ids
        assert inputs.kwargs.keys() == kwargs.keys()
    acts = dump_model(model, inputs, tmp_path / "a.safetensors")
    grads = dump_model(
        model, inputs, tmp_path / "g.safetensors", grads=GradSpec(), activations=False
    )
    stored, _ = read(acts)
    grad_stored, grad_meta = read(grads)
    target = json.loads(grad_meta["grad"])["target"]

    paths = list(ALIGN[family])
    # Two references, as modeltap runs: activations under no_grad, gradients with autograd on
    # (some kernels, T5's attention among them, round differently with autograd on).
    with torch.no_grad():
        plain = dict(flatten(model(**inputs.kwargs, output_hidden_states=True)))
    with torch.enable_grad():
        leaves = dict(flatten(model(**inputs.kwargs, output_hidden_states=True)))
    y = leaves[split_key(target)[2]]  # the output modeltap took gradients of
    expected_grads = torch.autograd.grad(
        y, [leaves[p] for p in paths], grad_outputs=torch.ones_like(y)
    )

    for path, g in zip(paths, expected_grads, strict=True):
        key = ALIGN[family][path]
        assert key in stored, (path, key)
        torch.testing.assert_close(stored[key], plain[path], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(grad_stored["grad/" + key], g, rtol=1e-5, atol=1e-6, msg=key)


# Models whose backward fails inside torch.autograd.grad: one line, exit 1, no file, and the fix.
BACKWARD_FAILURES = {
    "rwkv": ["--train-mode"],  # its state cache is written in place in eval mode only
    "reformer": ["training mode", "--train-mode"],  # reversible layers: backward in training only
}


def saved(family, folder):
    """`family`'s model saved to `folder`, and a tensor file with its inputs."""
    model, kwargs = BUILDERS[family]()
    model.save_pretrained(folder / family)
    save_file(kwargs, folder / f"{family}-inputs.safetensors")
    return folder / family, folder / f"{family}-inputs.safetensors"


@pytest.mark.parametrize("family", sorted(BACKWARD_FAILURES))
def test_backward_failure_is_one_line_naming_the_fix(family, tmp_path):
    model_dir, inputs = saved(family, tmp_path)
    result = runner.invoke(
        app, ["grads", str(model_dir), "--input-file", str(inputs), "-o", "g.safetensors"]
    )
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "backward failed" in lines[0]
    for hint in BACKWARD_FAILURES[family]:
        assert hint in lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "g.safetensors").exists()
    assert not list(tmp_path.glob(".*tmp"))


def test_any_backward_failure_is_a_run_error(tmp_path):
    class Refuses(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("no backward here\nsecond line")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return Refuses.apply(self.fc(x))

    with pytest.raises(RunError, match=r"Model's backward failed: no backward here \(") as info:
        dump_model(
            Model(),
            Inputs((torch.randn(2, 4),), {}, {}),
            tmp_path / "g.safetensors",
            grads=GradSpec(),
            activations=False,
        )
    assert info.value.exit_code == 1 and "second line" not in info.value.message
    assert not (tmp_path / "g.safetensors").exists()


def test_rwkv_takes_gradients_in_train_mode(tmp_path):
    """The fix the RWKV message names works, and gives transformers' own gradients."""
    model_dir, inputs = saved("rwkv", tmp_path)
    args = ["grads", str(model_dir), "--input-file", str(inputs), "--train-mode"]
    result = runner.invoke(app, [*args, "-o", "g.safetensors"])
    assert result.exit_code == 0, result.output
    grad_stored, _ = read(tmp_path / "g.safetensors")

    model, kwargs = BUILDERS["rwkv"]()
    out = model.train()(**kwargs, output_hidden_states=True)
    y, first = out.last_hidden_state, out.hidden_states[0]  # blocks.0's output
    (expected,) = torch.autograd.grad(y, [first], grad_outputs=torch.ones_like(y))
    torch.testing.assert_close(grad_stored["grad/blocks.0:0"], expected, rtol=1e-5, atol=1e-6)


def test_reformer_takes_gradients_with_train_mode(tmp_path):
    """The fix the Reformer message names works from the CLI, with transformers' own gradients."""
    # Training mode turns dropout on: without it (and with local attention only, whose result
    # does not depend on random hash rotations) the run is deterministic and comparable.
    model, kwargs = BUILDERS["reformer"]()
    config = model.config
    config.hidden_dropout_prob = config.local_attention_probs_dropout_prob = 0.0
    config.attn_layers = ["local", "local"]
    torch.manual_seed(0)
    model = type(model)(config)
    model.save_pretrained(tmp_path / "reformer")
    save_file(kwargs, tmp_path / "reformer-inputs.safetensors")
    model_dir, inputs = tmp_path / "reformer", tmp_path / "reformer-inputs.safetensors"
    args = ["grads", str(model_dir), "--input-file", str(inputs), "--train-mode"]
    # One element of the final LayerNorm: the sum of a LayerNorm output is constant, and its
    # gradient would be rounding noise.
    target = ["--target", "encoder.layer_norm", "--grad-output", "unit:1,3,5"]
    result = runner.invoke(app, [*args, *target, "-o", "g.safetensors"])
    assert result.exit_code == 0, result.output
    grad_stored, _ = read(tmp_path / "g.safetensors")

    model.train()
    seen = {}
    model.embeddings.register_forward_hook(lambda m, a, out: seen.setdefault("emb", out))
    model.encoder.layer_norm.register_forward_hook(lambda m, a, out: seen.setdefault("y", out))
    torch.manual_seed(0)
    model(**kwargs)
    y = seen["y"]
    unit = torch.zeros_like(y)
    unit[1, 3, 5] = 1.0
    (expected,) = torch.autograd.grad(y, [seen["emb"]], grad_outputs=unit)
    # The reversible backward recomputes the forward with multi-threaded sums: ~1e-6 apart.
    scale = float(expected.abs().max())
    torch.testing.assert_close(grad_stored["grad/embeddings"], expected, rtol=0, atol=1e-5 * scale)


def test_cli_dumps_detr_from_pixel_values_alone(tmp_path):
    model_dir, inputs = saved("detr", tmp_path)
    result = runner.invoke(
        app, ["dump", str(model_dir), "--input-file", str(inputs), "-o", "d.safetensors"]
    )
    assert result.exit_code == 0, result.output
    stored, meta = read(tmp_path / "d.safetensors")
    assert "decoder_input_ids" not in meta["inputs"]
    assert "decoder.layernorm" in stored


def plain_hook_values(model, kwargs):
    """Every module's output on every call, from plain forward hooks written here: `name` for its
    first call, `name@k` for the k-th after it, `name:path` for each tensor of a structured
    output (tuple index or field name, joined by dots); each cloned as its module returns."""
    values, calls = {}, {}

    def leaves(value, path):
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, dict):  # ModelOutput is an OrderedDict of its non-None fields
            for name, item in value.items():
                yield from leaves(item, f"{path}.{name}" if path else str(name))
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                yield from leaves(item, f"{path}.{index}" if path else str(index))

    def hook(name):
        def keep(module, args, output):
            k = calls.get(name, 0)
            calls[name] = k + 1
            head = name if k == 0 else f"{name}@{k}"
            for path, tensor in leaves(output, ""):
                values[f"{head}:{path}" if path else head] = tensor.detach().clone()

        return keep

    handles = [m.register_forward_hook(hook(n or ROOT)) for n, m in model.named_modules()]
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return values, {name: n for name, n in calls.items() if n > 1}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_key_and_repeated_call_equals_plain_hooks(family, tmp_path):
    """Every key of a dump and of a capture, each `@k` call included, holds what plain forward
    hooks see on that very call, in call order (Gemma3 and ModernBERT run `rotary_emb` once per
    layer type, with different frequencies; XLNet runs its dropouts several times)."""
    model, kwargs = BUILDERS[family]()
    inputs = add_decoder_inputs(model, Inputs((), kwargs, {}))
    want, repeated = plain_hook_values(model, inputs.kwargs)
    if family in ("gemma3_text", "modernbert"):
        assert repeated == {"rotary_emb": 2}
        # the two calls differ: a swap would show
        assert not torch.equal(want["rotary_emb:0"], want["rotary_emb@1:0"])
    dumped, meta = read(dump_model(model, inputs, tmp_path / "a.safetensors"))
    captured = capture(model, **inputs.kwargs, seed=0)
    assert set(dumped) == set(want) == set(captured.keys())
    # the order of the keys is the order of the calls
    assert json.loads(meta["order"]) == captured.keys()
    order = [k.partition(":")[0] for k in captured.keys()]
    for name, n in repeated.items():
        calls = [k for k in dict.fromkeys(order) if split_key(k)[0] == name]
        assert calls == [name] + [f"{name}@{k}" for k in range(1, n)], calls
    for key, value in want.items():
        torch.testing.assert_close(dumped[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(captured[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("family", ["xlnet", "recurrent_gemma"])
def test_models_without_a_position_limit_dump_from_the_cli(family, tmp_path):
    """XLNet's max_position_embeddings is -1 and RecurrentGemma has none: no length limit."""
    model_dir, inputs = saved(family, tmp_path)
    result = runner.invoke(
        app, ["dump", str(model_dir), "--input-file", str(inputs), "-o", "d.safetensors"]
    )
    assert result.exit_code == 0, result.output
    stored, _ = read(tmp_path / "d.safetensors")
    model, kwargs = BUILDERS[family]()
    want, _ = plain_hook_values(model, kwargs)
    for key, value in want.items():
        torch.testing.assert_close(stored[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_compiled_stats_only_dump_equals_the_eager_one(family, tmp_path):
    """`dump --compile --stats-only` takes the statistics inside the graph, for every family: the
    eager stats-only dump's keys, order, aliases and skipped values, statistics within the compile
    preset. Gemma3 runs `rotary_emb` twice with different values, in another order compiled (its
    calls are matched by their statistics: numbered as compiled, the two swap); T5 reuses its
    dropouts, XLNet returns mems, Reformer breaks into graphs."""
    from modeltap.capture.compile import CompileBackend
    from modeltap.config import tolerance_preset

    model, kwargs = BUILDERS[family]()
    inputs = add_decoder_inputs(model, Inputs((), kwargs, {}))
    metas = []
    for name, backend in (("eager", None), ("compiled", CompileBackend("aot_eager"))):
        path = dump_model(model, inputs, tmp_path / name, stats_only=True, backend=backend)
        with safe_open(str(path), "pt") as f:
            metas.append(f.metadata())
    eager, compiled = metas
    assert json.loads(compiled["backend_details"])["statistics"] == "in the graph"
    for field in ("order", "aliases", "skipped"):
        assert json.loads(compiled[field]) == json.loads(eager[field]), field
    want, got = json.loads(eager["stats"]), json.loads(compiled["stats"])
    assert list(got) == list(want)
    exact = ("shape", "dtype", "numel", "nan", "inf", "units", "dead")
    tol = tolerance_preset("compile")
    for key, w in want.items():
        assert {f: got[key].get(f) for f in exact} == {f: w.get(f) for f in exact}, key
        for field in ("mean", "std", "norm", "min", "max"):
            if field in w:
                torch.testing.assert_close(got[key][field], w[field], **tol, msg=(key, field))
