"""modeltap.generate and `modeltap generate`: each decoding step against an independent run.

The references are plain transformers code: `model.generate` for the tokens, and forwards with the
model's KV cache and this file's own hooks for every step's values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.dump import load_dump
from modeltap.generate import (
    Decoding,
    StepPlan,
    generate_model,
    generation_meta,
    split_step,
    step_key,
    step_view,
    steps_of,
)
from modeltap.loading import text_inputs
from tests.fixtures.hf import gpt2_tokenizer
from tests.fixtures.plain_outputs import assert_step_matches, plain_outputs

PROMPT = "hello world the quick"


def tiny_gpt2():  # noqa: ANN201
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def tiny_llama():  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tiny_decoder(name: str):  # noqa: ANN201
    """A tiny Mistral or Gemma (the Llama family's variations: sliding window, GeGLU, scaled
    embeddings)."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


def tiny_mixtral():  # noqa: ANN201
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=512, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return MixtralForCausalLM(config).eval()


def tiny_t5():  # noqa: ANN201
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=512, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return gpt2_tokenizer()


def _prompt(tok) -> object:  # noqa: ANN001
    return text_inputs(tok, [PROMPT])


def _reference_steps(model, inputs, new_ids: list[int]) -> list[dict[str, object]]:  # noqa: ANN001
    """Plain forwards over the prompt, then over each new token with the cache: what generate
    runs, written here without modeltap or generate."""
    from transformers import DynamicCache, EncoderDecoderCache

    steps = []
    ids = inputs.kwargs["input_ids"]
    if model.config.is_encoder_decoder:
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        encoded: list[object] = []
        start = model.config.decoder_start_token_id
        tokens = [start, *new_ids]

        def first() -> None:
            encoded.append(model.get_encoder()(input_ids=ids))
            model(
                encoder_outputs=encoded[0],
                decoder_input_ids=torch.tensor([[start]]),
                past_key_values=cache,
                use_cache=True,
            )

        steps.append(plain_outputs(model, first))
        for k in range(1, len(new_ids)):
            steps.append(
                plain_outputs(
                    model,
                    lambda k=k: model(
                        encoder_outputs=encoded[0],
                        decoder_input_ids=torch.tensor([[tokens[k]]]),
                        past_key_values=cache,
                        use_cache=True,
                    ),
                )
            )
        return steps
    cache = DynamicCache(config=model.config)
    mask = inputs.kwargs["attention_mask"]
    steps.append(
        plain_outputs(
            model, lambda: model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        )
    )
    for k in range(1, len(new_ids)):
        full_mask = torch.ones(1, ids.shape[1] + k, dtype=mask.dtype)
        steps.append(
            plain_outputs(
                model,
                lambda k=k, m=full_mask: model(
                    input_ids=torch.tensor([[new_ids[k - 1]]]),
                    attention_mask=m,
                    past_key_values=cache,
                ),
            )
        )
    return steps


@pytest.mark.parametrize(
    "build",
    [
        tiny_gpt2,
        tiny_llama,
        lambda: tiny_decoder("Mistral"),
        lambda: tiny_decoder("Gemma"),
        tiny_mixtral,
        tiny_t5,
    ],
    ids=["gpt2", "llama", "mistral", "gemma", "moe", "t5"],
)
def test_every_step_equals_a_plain_cached_forward(build, tok, tmp_path: Path) -> None:  # noqa: ANN001
    model = build()
    inputs = _prompt(tok)
    n = 5
    expected = model.generate(**inputs.kwargs, max_new_tokens=n, do_sample=False, num_beams=1)
    done = generate_model(
        model, inputs, tmp_path / "g.safetensors", tokenizer=tok,
        decoding=Decoding(max_new_tokens=n), plan=StepPlan("all"),
    )  # fmt: skip
    start = 1 if model.config.is_encoder_decoder else inputs.kwargs["input_ids"].shape[1]
    assert done.new_ids == expected[:, start:].tolist()
    dump = load_dump(done.path)
    assert steps_of(dump) == list(range(len(done.new_ids[0])))
    reference = _reference_steps(model, inputs, done.new_ids[0])
    for step, outputs in enumerate(reference):
        assert assert_step_matches(step_view(dump, step), outputs) > 5


def test_prefill_keys_and_values_equal_a_one_forward_dump(tok, tmp_path: Path) -> None:  # noqa: ANN001
    from modeltap.dumping import dump_model

    model = tiny_gpt2()
    inputs = _prompt(tok)
    one = load_dump(dump_model(model, inputs, tmp_path / "one.safetensors"))
    done = generate_model(model, inputs, tmp_path / "g.safetensors", tokenizer=tok)
    prefill = step_view(load_dump(done.path), 0)
    assert prefill.keys() == one.keys()
    for key in one.keys():
        torch.testing.assert_close(prefill[key], one[key], rtol=1e-5, atol=1e-6, msg=key)


def test_default_plan_keeps_the_prefill_and_the_last_step(tok, tmp_path: Path) -> None:  # noqa: ANN001
    model = tiny_gpt2()
    done = generate_model(
        model, _prompt(tok), tmp_path / "g.safetensors", tokenizer=tok,
        decoding=Decoding(max_new_tokens=4),
    )  # fmt: skip
    dump = load_dump(done.path)
    gen = generation_meta(dump)
    assert gen["full_steps"] == [0, 3] and gen["stop"] == "max_new_tokens"
    stored_steps = {split_step(k)[0] for k in dump.stored}
    assert stored_steps == {0, 3}
    middle = step_view(dump, 2)
    assert middle.stats_only and "transformer.h.1" in middle.keys()
    assert middle.stats_for("transformer.h.1") is not None
    # every step has statistics for the same keys
    assert step_view(dump, 1).keys() == step_view(dump, 3).keys()
    # the metadata's tokens and probabilities are the model's own
    scores = model.generate(
        **_prompt(tok).kwargs, max_new_tokens=4, do_sample=False, num_beams=1,
        return_dict_in_generate=True, output_logits=True,
    ).logits  # fmt: skip
    for step, logits in zip(gen["steps"], scores, strict=True):
        probs = torch.softmax(logits[0], -1)
        assert step["token"] == [int(probs.argmax())]
        assert step["p"][0] == pytest.approx(float(probs.max()), rel=1e-5)
        assert step["p_second"][0] <= step["p"][0]


def test_steps_option_and_stats_only(tok, tmp_path: Path) -> None:  # noqa: ANN001
    model = tiny_gpt2()
    plan = StepPlan.parse("1,3-4")
    done = generate_model(
        model, _prompt(tok), tmp_path / "g.safetensors", decoding=Decoding(max_new_tokens=6),
        plan=plan,
    )  # fmt: skip
    dump = load_dump(done.path)
    assert {split_step(k)[0] for k in dump.stored} == {1, 3, 4}
    assert not dump.stats_only
    done = generate_model(
        model, _prompt(tok), tmp_path / "s.safetensors", decoding=Decoding(max_new_tokens=3),
        plan=StepPlan("none"),
    )  # fmt: skip
    dump = load_dump(done.path)
    assert dump.stats_only and not dump.stored
    assert len([k for k in dump.stats if k.startswith("gen/step2/")]) > 10


def test_eos_stops_early_with_a_complete_file(tok, tmp_path: Path) -> None:  # noqa: ANN001
    model = tiny_gpt2()
    first = generate_model(
        model, _prompt(tok), tmp_path / "a.safetensors", decoding=Decoding(max_new_tokens=8)
    )
    # make the token chosen at step 2 the end of text: decoding stops after 3 tokens
    eos = first.new_ids[0][2]
    assert eos not in first.new_ids[0][:2]
    model.generation_config.eos_token_id = eos
    done = generate_model(
        model, _prompt(tok), tmp_path / "b.safetensors", decoding=Decoding(max_new_tokens=8)
    )
    assert done.new_ids == [first.new_ids[0][:3]] and done.stop == "eos"
    dump = load_dump(done.path)
    assert generation_meta(dump)["full_steps"] == [0, 2]
    assert steps_of(dump) == [0, 1, 2]
    assert step_view(dump, 2)["lm_head"].shape[1] == 1


def test_sampling_with_a_seed_is_generate_with_that_seed(tok, tmp_path: Path) -> None:  # noqa: ANN001
    model = tiny_gpt2()
    decoding = Decoding(max_new_tokens=6, do_sample=True, seed=3, top_k=50, temperature=2.0)
    done = generate_model(model, _prompt(tok), tmp_path / "g.safetensors", decoding=decoding)
    torch.manual_seed(3)
    expected = model.generate(
        **_prompt(tok).kwargs, max_new_tokens=6, do_sample=True, top_k=50, temperature=2.0
    )
    assert done.new_ids == expected[:, len(done.prompt_ids[0]) :].tolist()


def test_kv_stores_each_steps_new_positions(tok, tmp_path: Path) -> None:  # noqa: ANN001
    from transformers import DynamicCache

    model = tiny_gpt2()
    inputs = _prompt(tok)
    done = generate_model(
        model, inputs, tmp_path / "g.safetensors", decoding=Decoding(max_new_tokens=3),
        plan=StepPlan("all"), kv=True,
    )  # fmt: skip
    dump = load_dump(done.path)
    cache = DynamicCache(config=model.config)
    ids = torch.cat([inputs.kwargs["input_ids"], torch.tensor([done.new_ids[0][:2]])], 1)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    length = inputs.kwargs["input_ids"].shape[1]
    for layer in range(2):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        for step, (lo, hi) in enumerate([(0, length), (length, length + 1), (length + 1, None)]):
            view = step_view(dump, step)
            torch.testing.assert_close(view[f"cache:{layer}.key"], keys[..., lo:hi, :])
            torch.testing.assert_close(view[f"cache:{layer}.value"], values[..., lo:hi, :])


def test_interrupted_generation_leaves_nothing(tok, tmp_path: Path) -> None:  # noqa: ANN001
    model = tiny_gpt2()
    calls = []

    def interrupt(module, args, output) -> None:  # noqa: ANN001
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    handle = model.transformer.h[1].register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            generate_model(model, _prompt(tok), tmp_path / "g.safetensors")
    finally:
        handle.remove()
    assert list(tmp_path.iterdir()) == []
    # the model is as before: no hook of modeltap left on it
    assert not model._forward_pre_hooks and not model.transformer.h[0]._forward_hooks


def test_step_keys() -> None:
    assert step_key(12, "encoder.layer.0:0") == "gen/step12/encoder.layer.0:0"
    assert split_step("gen/step12/encoder.layer.0:0") == (12, "encoder.layer.0:0")
    assert split_step("encoder.layer.0") is None
    assert StepPlan.parse("0,5-7").steps == {0, 5, 6, 7}


runner = CliRunner()


def test_cli_generate_and_show(gpt2_dir: Path) -> None:
    result = runner.invoke(
        app, ["generate", str(gpt2_dir), PROMPT, "--max-new-tokens", "4", "-o", "g.safetensors"]
    )
    assert result.exit_code == 0, result.output
    assert "generated (4 tokens)" in result.output
    assert "stopped by max_new_tokens" in result.output
    shown = runner.invoke(app, ["show", "g.safetensors"])
    assert shown.exit_code == 0 and "prompt: 'hello world the quick'" in shown.output
    tree = runner.invoke(app, ["show", "g.safetensors", "--step", "2"])
    assert tree.exit_code == 0 and "decoding step 2" in tree.output
    assert "transformer" in tree.output and "statistics only" in tree.output
    as_json = runner.invoke(app, ["show", "g.safetensors", "--json"])
    assert json.loads(as_json.output)["generate"]["stop"] == "max_new_tokens"
    missing = runner.invoke(app, ["show", "g.safetensors", "--step", "9"])
    assert missing.exit_code == 2 and "no step 9" in missing.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens is 0; give 1 or more"),
        (["--max-new-tokens", "-3"], "--max-new-tokens is -3"),
        (["--model-class", "AutoModel"], "--model-class AutoModelForCausalLM"),
        (["--temperature", "0.7"], "add --do-sample"),
        (["--full", "--steps", "1"], "give one of --full and --steps"),
        (["--steps", "3-1"], "rising range"),
    ],
)
def test_cli_bad_input_is_one_line(gpt2_dir: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["generate", str(gpt2_dir), PROMPT, "-o", "g.safetensors", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not Path("g.safetensors").exists()


def test_cli_prompt_longer_than_the_positions(gpt2_dir: Path) -> None:
    result = runner.invoke(app, ["generate", str(gpt2_dir), "hello " * 70, "-o", "g.safetensors"])
    assert result.exit_code == 2, result.output
    assert "64 positions" in result.output and "shorten the prompt" in result.output


def test_help_reads_well_at_80_columns() -> None:
    result = runner.invoke(app, ["generate", "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert "<bool>" not in result.stdout and "…" not in result.stdout
    assert "[default: AutoModelForCausalLM" in " ".join(result.stdout.split())


# diff of two generation dumps, compare --generate ------------------------------------------


def _faulted(gpt2_dir: Path, folder: Path, position: int) -> Path:
    """The tiny GPT-2 with one row of its position embedding replaced: a fault that only the
    forward at that position sees, i.e. only from some decoding step on."""
    import shutil

    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.transformer.wpe.weight[position] = torch.randn(32, generator=generator) * 2
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (gpt2_dir / name).is_file():
            shutil.copy(gpt2_dir / name, folder / name)
    return folder


def _prompt_length(tok) -> int:  # noqa: ANN001
    return _prompt(tok).kwargs["input_ids"].shape[1]


def test_diff_of_two_generations(gpt2_dir: Path, tok, tmp_path: Path) -> None:  # noqa: ANN001
    length = _prompt_length(tok)
    faulted = _faulted(gpt2_dir, tmp_path / "faulted", length + 2)
    for name, model in (("a", gpt2_dir), ("b", gpt2_dir), ("f", faulted)):
        result = runner.invoke(
            app, ["generate", str(model), PROMPT, "--max-new-tokens", "6", "-o", f"{name}.st"]
        )
        assert result.exit_code == 0, result.output
    same = runner.invoke(app, ["diff", "a.st", "b.st"])
    assert same.exit_code == 0, same.output
    assert "tokens agree at every common step" in same.output
    report = runner.invoke(app, ["diff", "f.st", "a.st", "--json"])
    assert report.exit_code == 1, report.output
    data = json.loads(report.stdout)
    # the fault is at the position step 3 reads: steps 0-2 agree, step 3 is the first to differ,
    # on its statistics (the default keeps tensors of steps 0 and 5 only)
    assert data["first_divergence"] == {"step": 3, "key": "transformer.wpe"}
    assert [s["failed"] == 0 for s in data["steps"]][:3] == [True, True, True]
    assert data["steps"][3]["by"] == "statistics"
    # independently: where the two models' own greedy generations part
    from transformers import GPT2LMHeadModel

    ids = _prompt(tok).kwargs
    new = [
        GPT2LMHeadModel.from_pretrained(m).generate(**ids, max_new_tokens=6, do_sample=False)[
            0, length:
        ]
        for m in (faulted, gpt2_dir)
    ]
    split = next(i for i, (x, y) in enumerate(zip(*new, strict=True)) if x != y)
    assert data["token_split"]["step"] == split
    import modeltap  # the library verb takes generation dumps too

    verb = modeltap.diff("f.st", "a.st")
    assert not verb.passed and verb.split is not None and verb.split.step == split
    assert modeltap.diff("a.st", "b.st").passed
    plain = runner.invoke(app, ["dump", str(gpt2_dir), PROMPT, "-o", "one.st"])
    assert plain.exit_code == 0
    mixed = runner.invoke(app, ["diff", "a.st", "one.st"])
    assert mixed.exit_code == 2 and "is not a generation dump" in mixed.output


def _first_departure(reference, candidate, ids: dict, new: list[int]) -> int:  # noqa: ANN001
    """Independently: one forward of each model over the prompt and the reference's tokens; the
    first position (as a step) where their likeliest next tokens differ."""
    full = torch.cat([ids["input_ids"], torch.tensor([new[:-1]])], 1)
    with torch.no_grad():
        a = reference(input_ids=full).logits[0, ids["input_ids"].shape[1] - 1 :].argmax(-1)
        b = candidate(input_ids=full).logits[0, ids["input_ids"].shape[1] - 1 :].argmax(-1)
    return int((a != b).nonzero()[0])


def test_compare_generate_names_the_step_and_the_layer(
    gpt2_dir: Path,
    tok,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    from transformers import GPT2LMHeadModel

    length = _prompt_length(tok)
    faulted = _faulted(gpt2_dir, tmp_path / "faulted", length + 2)
    args = ["compare", str(gpt2_dir), str(faulted), PROMPT, "--generate", "6", "--json"]
    result = runner.invoke(app, [*args, "--out-dir", "cmp"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    reference, candidate = (GPT2LMHeadModel.from_pretrained(m) for m in (gpt2_dir, faulted))
    ids = _prompt(tok).kwargs
    new = reference.generate(**ids, max_new_tokens=6, do_sample=False)[0, length:].tolist()
    assert data["reference_ids"] == [new]
    expected = _first_departure(reference, candidate, ids, new)
    assert expected == 3  # the fault is seen from step 3 on, and there it changes the token
    assert data["departure"]["step"] == expected
    assert data["attributed_step"] == expected
    assert data["origins"][0]["module"] == "transformer.wpe"
    assert data["steps"]["first_divergence"] == {"step": 3, "key": "transformer.wpe"}
    free = candidate.generate(**ids, max_new_tokens=6, do_sample=False)[0, length:].tolist()
    assert data["candidate_ids"] == [free]
    assert {p.name for p in Path("cmp").iterdir()} == {
        "candidate.gen.safetensors",
        "reference.gen.safetensors",
        "report.json",
    }
    text = runner.invoke(app, args[:-1])
    assert "tokens agree up to step 3" in text.output
    assert "origin at step 3: transformer.wpe" in text.output


def test_compare_generate_of_identical_models_passes(gpt2_dir: Path) -> None:
    result = runner.invoke(
        app, ["compare", str(gpt2_dir), PROMPT, "--generate", "4", "--against", "fp32"]
    )
    assert result.exit_code == 0, result.output
    assert "tokens agree at every step" in result.output and "origin" not in result.output


def test_compare_generate_refuses_sampling_without_a_seed(gpt2_dir: Path) -> None:
    args = ["compare", str(gpt2_dir), PROMPT, "--generate", "4", "--against", "bf16"]
    result = runner.invoke(app, [*args, "--do-sample"])
    assert result.exit_code == 2 and "needs --seed N" in result.output
    seeded = runner.invoke(app, [*args, "--do-sample", "--seed", "1", "--preset", "exact"])
    assert seeded.exit_code in (0, 1), seeded.output
    assert "against the reference: 4 steps" in seeded.output


def test_cli_new_tokens_past_the_positions(gpt2_dir: Path, tok) -> None:  # noqa: ANN001
    room = 64 - _prompt_length(tok)
    args = ["generate", str(gpt2_dir), PROMPT, "-o", "g.safetensors", "--max-new-tokens"]
    result = runner.invoke(app, [*args, str(room + 1)])
    assert result.exit_code == 2, result.output
    assert f"at most {room} new ones fit" in result.output
    assert not Path("g.safetensors").exists()


def test_compare_generation_of_an_encoder_decoder(tmp_path: Path, tok) -> None:  # noqa: ANN001
    import copy

    from modeltap.compare.generate import compare_generation

    reference = tiny_t5()
    same = compare_generation(
        reference, copy.deepcopy(reference), _prompt(tok), tmp_path,
        decoding=Decoding(max_new_tokens=4),
    )  # fmt: skip
    assert same.passed and same.attribution is None
    candidate = copy.deepcopy(reference)
    with torch.no_grad():
        candidate.decoder.block[1].layer[2].DenseReluDense.wo.weight.mul_(3.0)
    result = compare_generation(
        reference, candidate, _prompt(tok), tmp_path, decoding=Decoding(max_new_tokens=4)
    )
    assert not result.passed
    # the decoder's feed-forward changes every step, the prefill first
    assert result.steps.first_divergence.step == 0
    assert result.attributed_step is not None
    origins = [m.name for m in result.attribution.origins]
    assert origins and origins[0] == "decoder.block.1.layer.2.DenseReluDense.wo", origins
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "candidate.gen.safetensors",
        "reference.gen.safetensors",
    ]


def test_chat_prompts_go_through_the_template(tok) -> None:  # noqa: ANN001
    from modeltap.errors import InputError
    from modeltap.generate import prompt_inputs

    model = tiny_gpt2()
    with pytest.raises(InputError, match="no chat template"):
        prompt_inputs(model, tok, ["hello"], chat=True)
    tok.chat_template = (
        "{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %} the{% endif %}"
    )
    try:
        inputs = prompt_inputs(model, tok, ["hello world"], chat=True)
    finally:
        tok.chat_template = None
    expected = tok("<|endoftext|>hello world the", add_special_tokens=False)["input_ids"]
    assert inputs.kwargs["input_ids"].tolist() == [expected]
    assert inputs.description["texts"] == ["hello world"]


def test_generate_under_offload_equals_the_plain_run(gpt2_dir: Path) -> None:
    """accelerate places the model on the CPU and the disk; the steps are the same."""
    from safetensors import safe_open

    with safe_open(str(gpt2_dir / "model.safetensors"), "pt") as f:
        total = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    args = ["generate", str(gpt2_dir), PROMPT, "--max-new-tokens", "4", "--full"]
    plain = runner.invoke(app, [*args, "-o", "plain.st"])
    assert plain.exit_code == 0, plain.output
    placed = runner.invoke(
        app,
        [*args, "-o", "placed.st", "--device-map", "auto", "--max-memory",
         f"cpu={total // 2}", "--offload-folder", "off"],
    )  # fmt: skip
    assert placed.exit_code == 0, placed.output
    a, b = load_dump("plain.st"), load_dump("placed.st")
    assert "disk" in json.loads(b.metadata["device_map"]).values()
    assert generation_meta(a)["new_ids"] == generation_meta(b)["new_ids"]
    assert a.keys() == b.keys() and len(a.stored) > 50
    for key in a.stored:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7, msg=key)


def test_compare_generate_against_bf16_compares_across_dtypes(gpt2_dir: Path) -> None:
    args = ["compare", str(gpt2_dir), PROMPT, "--generate", "4", "--against", "bf16", "--json"]
    result = runner.invoke(app, args)
    data = json.loads(result.stdout)
    assert data["candidate"]["dtype"] == "bfloat16"
    # each bfloat16 tensor compared with its float32 reference, not refused as another dtype
    assert all(s["by"] == "tensors" and s["failed"] == 0 for s in data["steps"]["steps"])
    assert result.exit_code == 0, result.output


def test_prefill_logits_of_every_position_only_when_captured(tok, tmp_path: Path) -> None:  # noqa: ANN001
    from modeltap.selection import Selection

    model = tiny_gpt2()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape[1]))
    try:
        generate_model(
            model, _prompt(tok), tmp_path / "a.st", decoding=Decoding(max_new_tokens=2),
            selection=Selection(include=("transformer.h.0",)),
        )  # fmt: skip
        blocks_only = list(seen)
        seen.clear()
        generate_model(model, _prompt(tok), tmp_path / "b.st", decoding=Decoding(max_new_tokens=2))
    finally:
        handle.remove()
    assert blocks_only == [1, 1]  # generate's own economy: the last position only
    assert seen == [_prompt_length(tok), 1]


def test_cli_ctrl_c_mid_generation_leaves_nothing(gpt2_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    from modeltap.dump import DumpWriter

    calls = []
    original = DumpWriter.tensor

    def interrupted(self, key, tensor, **kwargs) -> None:  # noqa: ANN001
        calls.append(key)
        if key.startswith("gen/step2/"):
            raise KeyboardInterrupt
        original(self, key, tensor, **kwargs)

    monkeypatch.setattr(DumpWriter, "tensor", interrupted)
    result = runner.invoke(app, ["generate", str(gpt2_dir), PROMPT, "-o", "g.safetensors"])
    assert result.exit_code == 130 and "nothing was written" in result.output
    assert list(Path().iterdir()) == []


def test_sampling_options_without_generate_are_refused(gpt2_dir: Path) -> None:
    args = ["compare", str(gpt2_dir), PROMPT, "--against", "bf16", "--do-sample"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --do-sample can't apply without --generate; add --generate N or drop --do-sample"
    )


def test_compare_generate_judges_steps_with_the_accumulated_allowance(
    gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's outputs are cumulative errors: compare --generate widens the preset for
    accumulated rounding as compare does (the fp32 preset's accumulated_scaled_atol)."""
    from modeltap.config import read_preset
    from modeltap.diff import generations as generation_diff

    seen = {}

    original = generation_diff.diff_generations

    def spy(*args, **kwargs):
        seen["tolerance"] = kwargs["tolerance"]
        return original(*args, **kwargs)

    monkeypatch.setattr(generation_diff, "diff_generations", spy)  # imported where it is used
    result = runner.invoke(
        app, ["compare", str(gpt2_dir), PROMPT, "--generate", "3", "--against", "attn:eager"]
    )
    assert result.exit_code == 0, result.output
    allowance = read_preset("fp32")["accumulated_scaled_atol"]
    assert seen["tolerance"].scaled_atol == allowance > 0


def test_image_conditioned_generation_equals_generate_on_the_processors_inputs(
    tmp_path: Path,
) -> None:
    """`modeltap generate VLM image.png "text"`: the files and the text through the model's own
    processor, then generate: tokens and the prefill's values as transformers' own calls give."""
    from PIL import Image
    from transformers import LlavaForConditionalGeneration

    from tests.fixtures.media import build_llava, write_image

    folder = tmp_path / "llava"
    _, processor = build_llava(folder)
    image = write_image(tmp_path / "cat.png", 24, 20, seed=3)
    out = tmp_path / "vlm.gen.safetensors"
    args = ["generate", str(folder), str(image), "<image> describe", "--max-new-tokens", "3"]
    result = runner.invoke(app, [*args, "-o", str(out), "--full"])
    assert result.exit_code == 0, result.output

    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    inputs = processor(
        images=[Image.open(image).convert("RGB")], text=["<image> describe"], return_tensors="pt"
    )
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    meta = json.loads(load_dump(out).metadata["generate"])
    prompt = inputs["input_ids"].shape[1]
    assert meta["new_ids"] == expected[:, prompt:].tolist()
    # the prefill saw the image: the vision tower's output equals a plain forward of it
    seen = {}

    def keep(module, args, output) -> None:
        seen.setdefault("vision", output.last_hidden_state)

    hook = model.model.vision_tower.register_forward_hook(keep)
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    stored = load_dump(out)["gen/step0/model.vision_tower:last_hidden_state"]  # an alias
    torch.testing.assert_close(stored, seen["vision"], rtol=0, atol=0)


def test_processor_without_files_is_refused(gpt2_dir: Path) -> None:
    result = runner.invoke(app, ["generate", str(gpt2_dir), PROMPT, "--processor", "x"])
    assert result.exit_code == 2 and "--processor takes image or audio FILEs" in result.output



# compare --generate --against compile / export ---------------------------------------------


def _layer_faulted(gpt2_dir: Path, folder: Path) -> Path:
    """The tiny GPT-2 with its second block's MLP output weights 5% off: an error from step 0."""
    from transformers import GPT2LMHeadModel

    folder = _faulted(gpt2_dir, folder, 0)  # copies the tokenizer; position 0's row put back:
    model = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight.mul_(1.05)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("backend", ["export", "compile"])
def test_compare_generate_against_a_backend_names_the_step_and_the_layer(
    gpt2_dir: Path,
    tok,  # noqa: ANN001
    tmp_path: Path,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The candidate checkpoint's blocks compiled or exported each on its own: a fault seen from
    step 3 on (a position embedding row) is found at step 3, and one inside the second block
    (replayed through its compiled or exported graph) at step 0 in that block."""
    from torch._dynamo.utils import counters
    from transformers import GPT2LMHeadModel

    from modeltap.compare import backends

    torch._dynamo.reset()  # other tests' compiled code: not this test's recompile limit
    counters.clear()
    exports = []
    export_call = backends._export_call

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        exports.append(args[1])
        return export_call(*args, **kwargs)

    monkeypatch.setattr(backends, "_export_call", counted)
    length = _prompt_length(tok)
    late = _faulted(gpt2_dir, tmp_path / "late", length + 2)
    base = ["compare", str(gpt2_dir), "--generate", "6", "--against", backend, "--json"]
    result = runner.invoke(app, [*base[:2], str(late), PROMPT, *base[2:], "--depth", "3"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert "without the KV cache" in data["note"] and f"depth 3 {backend}" in data["note"]
    ids = _prompt(tok).kwargs
    reference = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    new = reference.generate(**ids, max_new_tokens=6, do_sample=False)[0, length:].tolist()
    assert data["reference_ids"] == [new]
    assert data["departure"]["step"] == data["attributed_step"] == 3
    assert data["origins"][0]["module"] == "transformer.wpe"
    if backend == "export":  # one graph per block, exported at the prefill's length, serves
        # every longer step (no cache: each a whole sequence) and the attribution's forward
        assert exports == ["transformer.h.0", "transformer.h.1"]
    else:
        assert counters["stats"]["unique_graphs"] >= 2
    layer = _layer_faulted(gpt2_dir, tmp_path / "layer")
    result = runner.invoke(app, [*base[:2], str(layer), PROMPT, *base[2:], "--depth", "3"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["steps"]["first_divergence"]["step"] == 0
    assert data["attributed_step"] == 0
    assert [o["module"] for o in data["origins"]] == ["transformer.h.1"]


def test_compare_generate_against_export_of_the_same_model_passes(gpt2_dir: Path) -> None:
    args = ["compare", str(gpt2_dir), PROMPT, "--generate", "4", "--against", "export"]
    result = runner.invoke(app, [*args, "--depth", "3"])
    assert result.exit_code == 0, result.output
    assert "tokens agree at every step" in result.output
    assert "exported each on its own" in " ".join(result.output.split())
    missing = runner.invoke(app, args)
    assert missing.exit_code == 2
    assert "--against export replays at one depth: give --depth N" in missing.output


def test_an_exported_module_takes_every_length_and_equals_the_module() -> None:
    """A Llama layer behind `exported_module`: each call's output equals the layer's own; a
    length of 1 (fixed by export) and a longer one take two graphs, later lengths reuse the
    dynamic one; the graphs are torch.export's, not the layer."""
    from modeltap.compare.backends import exported_module

    model = tiny_llama()
    layer = model.model.layers[0]
    stand_in = exported_module(layer, "model.layers.0")
    assert list(stand_in.children()) == [stand_in.graphs] and len(stand_in.graphs) == 0
    ran = []
    for length in (1, 4, 9, 1):
        if length == 9:  # two graphs made: from now on, a call of the layer itself would fail
            for graph in stand_in.graphs:
                graph.register_forward_hook(lambda g, a, out: ran.append(g))
            layer.forward = None
        hidden = torch.randn(1, length, 32)
        positions = torch.arange(length)[None]
        rotary = model.model.rotary_emb(hidden, positions)
        kwargs = {"position_embeddings": rotary, "position_ids": positions}
        with torch.no_grad():
            expected = model.model.layers[0].__class__.forward(layer, hidden, **kwargs)
            got = stand_in(hidden, **kwargs)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert len(stand_in.graphs) == 2 and ran == [stand_in.graphs[1], stand_in.graphs[0]]
    assert all(type(g).__name__ != type(layer).__name__ for g in stand_in.graphs)
    from transformers import DynamicCache

    from modeltap.errors import RunError

    with pytest.raises(RunError, match="called with a DynamicCache.*use_cache=False"):
        stand_in(hidden, cache=DynamicCache(), **kwargs)
    stand_in.train()  # an exported graph's train() raises; the stand-in's doesn't
    assert stand_in.training and not stand_in.graphs[0].training


def test_an_exported_module_takes_each_dtype_in_a_graph_of_its_own() -> None:
    from modeltap.compare.backends import exported_module

    stand_in = exported_module(torch.nn.GELU(), "act")
    for dtype in (torch.float32, torch.float64, torch.float32):
        x = torch.randn(3, 5, dtype=dtype)
        torch.testing.assert_close(stand_in(x), torch.nn.functional.gelu(x), rtol=0, atol=0)
    assert len(stand_in.graphs) == 2


# what the generation config says: beam search, sampling, length (#29 item 6) ---------------


def _beams_reference(model, inputs, n: int):  # noqa: ANN001, ANN202
    """Plain transformers: `model.generate` with the model's own generation config, its raw
    logits of every step (every beam's row) and which row chose each returned token."""
    with torch.no_grad():
        return model.generate(
            **inputs.kwargs, max_new_tokens=n, return_dict_in_generate=True, output_logits=True
        )


@pytest.mark.parametrize("build", [tiny_llama, tiny_t5], ids=["llama", "t5"])
def test_beam_search_from_the_generation_config_is_what_generate_runs(
    build, tok, tmp_path: Path  # noqa: ANN001
) -> None:
    """num_beams: 3 in the generation config: tokens equal `model.generate()`'s (before, modeltap
    passed num_beams=1 and ran greedy), each step's forward holds every beam (batch x 3 rows, as
    generate computes them), and each step's token names the row that chose it."""
    from modeltap.generate import prompt_inputs

    model = build()
    model.generation_config.num_beams = 3
    model.generation_config.length_penalty = 0.5
    prompts = ["hello world the quick", "the"]
    inputs = prompt_inputs(model, tok, prompts if build is tiny_llama else prompts[:1])
    n = 5
    expected = _beams_reference(model, inputs, n)
    done = generate_model(
        model, inputs, tmp_path / "g.st", tokenizer=tok, decoding=Decoding(max_new_tokens=n),
        plan=StepPlan("all"),
    )  # fmt: skip
    start = expected.sequences.shape[1] - len(expected.logits)
    start = 1 if model.config.is_encoder_decoder else inputs.kwargs["input_ids"].shape[1]
    assert done.new_ids == expected.sequences[:, start:].tolist()
    greedy = model.generate(**inputs.kwargs, max_new_tokens=n, num_beams=1)
    assert greedy[:, start:].tolist() != done.new_ids  # beam search chose other tokens
    dump = load_dump(done.path)
    gen = generation_meta(dump)
    assert gen["decoding"]["num_beams"] == 3 and gen["num_beams"] == 3
    rows = inputs.kwargs["input_ids"].shape[0] * 3
    assert steps_of(dump) == list(range(len(expected.logits)))
    for step, logits in enumerate(expected.logits):
        view = step_view(dump, step)
        captured = view["__root__:logits"][:, -1]
        assert captured.shape[0] == rows
        torch.testing.assert_close(captured, logits, rtol=1e-5, atol=1e-6)
    for entry in gen["steps"]:
        step = entry["step"]
        assert entry["beam"] == expected.beam_indices[:, step].tolist()
        for row, (token, beam) in enumerate(zip(entry["token"], entry["beam"], strict=True)):
            assert token == expected.sequences[row, start + step]
            probs = torch.softmax(expected.logits[step][beam], -1)
            assert entry["p"][row] == pytest.approx(float(probs[token]), rel=1e-5)


def test_cli_honours_the_generation_config_and_num_beams_overrides_it(
    gpt2_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint whose generation_config.json says num_beams: 3 and max_new_tokens: 6:
    `modeltap generate` gives `model.generate()`'s tokens; --num-beams 1 gives greedy's."""
    import shutil

    from transformers import AutoTokenizer, GPT2LMHeadModel

    folder = tmp_path / "beams"
    shutil.copytree(gpt2_dir, folder)
    model = GPT2LMHeadModel.from_pretrained(folder)
    model.generation_config.num_beams = 3
    model.generation_config.max_new_tokens = 6
    model.generation_config.save_pretrained(folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder)([PROMPT], return_tensors="pt")
    length = ids["input_ids"].shape[1]
    with torch.no_grad():
        expected = model.generate(**ids)[:, length:].tolist()
        greedy = model.generate(**ids, num_beams=1)[:, length:].tolist()
    assert len(expected[0]) == 6 and expected != greedy
    result = runner.invoke(app, ["generate", str(folder), PROMPT, "-o", "b.st"])
    assert result.exit_code == 0, result.output
    words = " ".join(result.output.split())
    assert "beam search (3 beams" in words and "step token p beam runner-up p tensors" in words
    assert generation_meta(load_dump("b.st"))["new_ids"] == expected
    one = runner.invoke(app, ["generate", str(folder), PROMPT, "-o", "g.st", "--num-beams", "1"])
    assert one.exit_code == 0, one.output
    assert "greedy" in one.output
    assert generation_meta(load_dump("g.st"))["new_ids"] == greedy
    # compare --generate forces one sequence per prompt: beam search is refused, not ignored
    args = ["compare", str(folder), PROMPT, "--generate", "3", "--against", "fp32"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2, refused.output
    assert "pass --num-beams 1" in refused.output and "Traceback" not in refused.output
    forced = runner.invoke(app, [*args, "--num-beams", "1"])
    assert forced.exit_code == 0, forced.output


def test_sampling_and_length_from_the_generation_config_are_what_generate_runs(
    tok, tmp_path: Path  # noqa: ANN001
) -> None:
    """do_sample/top_k/temperature, max_new_tokens and repetition_penalty in the generation
    config: the tokens are `torch.manual_seed(seed); model.generate()`'s (before: greedy, and 20
    new tokens)."""
    model = tiny_gpt2()
    config = model.generation_config
    config.do_sample, config.top_k, config.temperature = True, 20, 1.5
    config.max_new_tokens, config.repetition_penalty = 7, 1.3
    inputs = _prompt(tok)
    length = inputs.kwargs["input_ids"].shape[1]
    done = generate_model(model, inputs, tmp_path / "s.st", decoding=Decoding(seed=5))
    torch.manual_seed(5)
    with torch.no_grad():
        expected = model.generate(**inputs.kwargs)[:, length:].tolist()
    assert len(expected[0]) == 7 and done.new_ids == expected
    assert done.meta["decoding"]["do_sample"] is True
    # a config's max_length (no max_new_tokens) bounds the prompt and the new tokens together
    config.do_sample, config.max_new_tokens, config.max_length = False, None, length + 4
    done = generate_model(model, inputs, tmp_path / "l.st")
    with torch.no_grad():
        assert done.new_ids == model.generate(**inputs.kwargs)[:, length:].tolist()
    assert len(done.new_ids[0]) == 4


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search (penalty_alpha)"),
        ({"num_beams": 4, "num_beam_groups": 2}, "pass --num-beams 1"),
        ({"prompt_lookup_num_tokens": 3}, "unset prompt_lookup_num_tokens"),
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2"),
    ],
    ids=["contrastive", "group-beams", "assisted", "sequences"],
)
def test_cli_refuses_generation_config_settings_it_cant_record(
    gpt2_dir: Path, tmp_path: Path, settings: dict, message: str
) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(gpt2_dir, folder)
    config = {"bos_token_id": 0, "eos_token_id": 0, **settings}  # as published, unvalidated
    (folder / "generation_config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["generate", str(folder), PROMPT, "-o", "g.st"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "generation_config.json" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not Path("g.st").exists()


# compare --generate: a flip at a near tie is not a defect (#29 item 7) ---------------------


def _tied_llamas(tmp_path: Path, tok, reference: float, candidate: float, fault: bool = False):  # noqa: ANN001, ANN202
    """Two tiny Llamas (same seed) whose LM head row of token b is row a times (1 + delta): with
    a small delta b's logit lies within |delta * logit_a| of a's wherever a is chosen, and the
    candidate's delta above zero makes it choose b there (the reference's below keeps a).
    `fault`: the candidate's second MLP also has one output row 50% off."""
    folders = []
    for name, delta in (("reference", reference), ("candidate", candidate)):
        model = tiny_llama()
        with torch.no_grad():
            first = model.generate(**_prompt(tok).kwargs, max_new_tokens=1, do_sample=False)
            a = int(first[0, -1])
            b = (a + 1) % model.config.vocab_size
            model.lm_head.weight[b] = model.lm_head.weight[a] * (1 + delta)
            if fault and name == "candidate":
                model.model.layers[1].mlp.down_proj.weight[3] *= 1.5
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        folders.append(tmp_path / name)
    return folders, a, b


def _logits_at_step0(folder: Path, tok) -> torch.Tensor:  # noqa: ANN001
    """The prefill's logits at every prompt position (step 0 chooses from the last)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(**_prompt(tok).kwargs).logits[0].double()


def test_compare_generate_passes_a_flip_at_a_near_tie_with_a_warning(
    tmp_path: Path, tok  # noqa: ANN001
) -> None:
    """Every step within the fp32 preset, and at step 0 the candidate's likeliest token is
    another than the reference's, the two logits 4e-5 * |logit| apart: within what the preset
    lets two logits move, so a warning naming the step and the margin, exit 0 (before: FAIL)."""
    from modeltap.config import read_preset

    (ref, cand), a, b = _tied_llamas(tmp_path, tok, -2e-5, 2e-5)
    args = ["compare", str(ref), str(cand), PROMPT, "--generate", "4"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"] and data["steps"]["first_divergence"] is None
    flip = data["departure"]
    assert (flip["step"], flip["reference"], flip["candidate"]) == (0, a, b)
    # independently: the margins from plain forwards, the allowance from the preset's numbers
    prefill = _logits_at_step0(ref, tok)
    ref_logits, cand_logits = prefill[-1], _logits_at_step0(cand, tok)[-1]
    margin = float(ref_logits[a] - ref_logits[b])
    shift = margin + float(cand_logits[b] - cand_logits[a])
    preset = read_preset("fp32")
    scale = float(prefill.abs().max())  # of the step's whole tensor, as the step is judged
    allowance = sum(
        preset["atol"] + preset["rtol"] * abs(float(ref_logits[t]))
        + preset["accumulated_scaled_atol"] * scale
        for t in (a, b)
    )  # fmt: skip
    assert 0 < margin and shift < allowance
    assert flip["logit_margin"] == pytest.approx(margin, rel=1e-3)
    assert flip["shift"] == pytest.approx(shift, rel=1e-3)
    assert flip["allowance"] == pytest.approx(allowance, rel=1e-6)
    assert flip["within_precision"] and data["ties"] == [{"step": 0, "row": 0}]
    assert data["attribution"] is None
    text = runner.invoke(app, args)
    assert text.exit_code == 0, text.output
    assert text.output.startswith("PASS")
    assert f"warning: step 0 is a near tie: the reference's logits part {a} and {b} by" in (
        " ".join(text.output.split())
    )
    assert "origin" not in text.output


def test_compare_generate_fails_a_flip_beyond_the_presets_allowance(
    tmp_path: Path, tok  # noqa: ANN001
) -> None:
    """The same flip with the two logits 5% of a logit apart, beyond the preset: FAIL, even
    though the steps compared (the first block only) are all within tolerance."""
    (ref, cand), a, b = _tied_llamas(tmp_path, tok, -0.05, 0.05)
    args = ["compare", str(ref), str(cand), PROMPT, "--generate", "4", "--include"]
    result = runner.invoke(app, [*args, "model.layers.0", "--json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["steps"]["first_divergence"] is None and not data["passed"]
    flip = data["departure"]
    ref_logits = _logits_at_step0(ref, tok)[-1]
    assert flip["logit_margin"] == pytest.approx(float(ref_logits[a] - ref_logits[b]), rel=1e-3)
    assert flip["shift"] > flip["allowance"] and not flip["within_precision"]
    assert data["ties"] == [] and data["attributed_step"] == 0
    text = runner.invoke(app, [*args, "model.layers.0"])
    assert text.exit_code == 1 and text.output.startswith("FAIL")
    assert "beyond the" in text.output and "warning" not in text.output


def test_compare_generate_still_fails_a_real_fault_next_to_a_near_tie(
    tmp_path: Path, tok  # noqa: ANN001
) -> None:
    """A near tie and a module beyond tolerance: FAIL naming the module (the tie is warned)."""
    (ref, cand), _, _ = _tied_llamas(tmp_path, tok, -2e-5, 2e-5, fault=True)
    args = ["compare", str(ref), str(cand), PROMPT, "--generate", "4", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["steps"]["first_divergence"]["key"] == "model.layers.1.mlp.down_proj"
    assert data["origins"][0]["module"] == "model.layers.1.mlp.down_proj"
    assert data["ties"] == [{"step": 0, "row": 0}]


def test_cli_num_beams_below_one_is_one_line(gpt2_dir: Path) -> None:
    args = ["generate", str(gpt2_dir), PROMPT, "-o", "g.st", "--num-beams", "0"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "error: --num-beams is 0; give 1 or more"
    assert not Path("g.st").exists()


def test_beam_search_rows_that_end_early_are_padding(tok, tmp_path: Path) -> None:  # noqa: ANN001
    """A prompt whose best beam ends with EOS before the other's: its later tokens are
    generate's padding, with no row (-1) and no probability; the table still renders."""
    from modeltap.generate import prompt_inputs
    from modeltap.render.generation import generation_table

    model = tiny_llama()
    model.generation_config.num_beams = 3
    inputs = prompt_inputs(model, tok, ["hello world the quick", "the"])
    first = _beams_reference(model, inputs, 5)
    start = inputs.kwargs["input_ids"].shape[1]
    model.generation_config.eos_token_id = int(first.sequences[1, start + 1])  # row 1's 2nd
    expected = _beams_reference(model, inputs, 5)
    done = generate_model(
        model, inputs, tmp_path / "g.st", tokenizer=tok, decoding=Decoding(max_new_tokens=5)
    )
    assert done.new_ids == expected.sequences[:, start:].tolist()
    ends = expected.beam_indices[1].tolist().index(-1)  # row 1's sequence ends before the last
    assert 0 < ends < len(done.steps)
    for entry in done.steps[ends:]:
        assert entry["beam"][1] == -1 and entry["p"][1] is None
    assert entry["beam"][0] >= 0 and entry["p"][0] is not None
    generation_table(done.meta, row=1)  # renders the padding as blanks


def test_ops_at_each_step_equal_a_plain_forwards_attention_weights(tok, tmp_path: Path) -> None:  # noqa: ANN001
    """generate --ops: the eager attention's softmax of each step equals output_attentions of a
    plain forward over the prompt and the tokens chosen before that step."""
    import modeltap

    model = tiny_llama()
    model.config._attn_implementation = "eager"
    module = "model.layers.1.self_attn"
    done = modeltap.generate(model, tok, PROMPT, tmp_path / "g.safetensors", max_new_tokens=3,
                             include=[module], steps="0-2", ops=True)
    dump = load_dump(done.path)
    ops = json.loads(dump.metadata["ops"])
    prompt = text_inputs(tok, [PROMPT]).kwargs["input_ids"]
    for step in range(3):
        (softmax,) = [k for k in ops if k.startswith(f"gen/step{step}/{module}/")
                      and k.endswith(".softmax")]
        assert "modeling_llama.py" in ops[softmax]["source"]
        ids = torch.cat([prompt, torch.tensor([done.new_ids[0][:step]], dtype=torch.long)], 1)
        with torch.no_grad():
            weights = model(ids, output_attentions=True).attentions[1]
        want = weights if step == 0 else weights[:, :, -1:, :]
        torch.testing.assert_close(dump[softmax], want, rtol=1e-5, atol=1e-6)
    # each step's ops are keyed as one forward's (no module@N), the decode steps' alike
    names = [{k.split("/", 2)[2] for k in ops if k.startswith(f"gen/step{s}/")} for s in range(3)]
    assert names[1] == names[2] and not any("@" in k for k in ops)


def test_formats_of_every_step_equal_the_reference_on_the_stored_tensors(tok, tmp_path: Path) -> None:  # noqa: ANN001, E501
    from safetensors import safe_open

    import modeltap
    from tests.fixtures.quant_reference import assert_figures, reference_figures

    fmts = ("int8", "mxfp8", "nvfp4")
    done = modeltap.generate(tiny_gpt2(), tok, PROMPT, tmp_path / "g.safetensors",
                             max_new_tokens=2, depth=2, steps="0-1", formats=fmts)
    with safe_open(done.path, "pt") as f:
        stats = json.loads(f.metadata()["stats"])
        keys = [k for k in f.keys() if k.startswith("gen/step") and k in stats]
        assert {k.split("/")[1] for k in keys} == {"step0", "step1"}
        for key in keys:
            tensor = f.get_tensor(key)
            if not tensor.is_floating_point():
                continue
            for fmt in fmts:
                assert_figures(stats[key]["formats"][fmt], reference_figures(tensor, fmt))


def test_cli_generate_ops_and_formats(gpt2_dir: Path) -> None:
    r = runner.invoke(app, ["generate", str(gpt2_dir), PROMPT, "--max-new-tokens", "2",
                            "--include", "transformer.h.0.attn", "--ops", "--formats", "int8",
                            "-o", "g.safetensors"])
    assert r.exit_code == 0, r.output
    dump = load_dump("g.safetensors")
    ops = json.loads(dump.metadata["ops"])
    assert any(k.startswith("gen/step1/transformer.h.0.attn/op") for k in ops)
    assert json.loads(dump.metadata["formats"]) == ["int8"]
    r = runner.invoke(app, ["generate", str(gpt2_dir), PROMPT, "--formats", "fp6",
                            "-o", "bad.safetensors"])
    assert r.exit_code == 2 and "known formats" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not Path("bad.safetensors").exists()
