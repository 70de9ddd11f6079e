"""`modeltap generate` and `compare --generate` on speech: a tiny Whisper with its processor, on
words spoken by espeak-ng.

Whisper's `generate()` reads a decoder prompt of several tokens (start, language, task,
no-timestamps) in its first forward and returns the new tokens without that prompt and without
the EOS; with no language set it first runs a forward of its own to detect one. The references
here are plain transformers code: `model.generate` for the tokens, and forwards over the decoder
prompt and then each new token with the model's cache, seen by plain hooks
(tests/fixtures/plain_outputs.py).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.dump import load_dump
from modeltap.generate import Decoding, StepPlan, generate_model, step_view, steps_of
from modeltap.loading import Inputs
from tests.fixtures.media import build_whisper_generator, read_wav, tone, write_wav
from tests.fixtures.plain_outputs import assert_step_matches, plain_outputs

runner = CliRunner()
N = 6


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """'hello world' spoken by espeak-ng, at 16 kHz."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        reason = "espeak-ng and sox are not installed; scripts/setup.sh --browser installs them"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)  # CI runs setup.sh --browser: there the test must run
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("speech")
    spoken = folder / "spoken.wav"
    subprocess.run(["espeak-ng", "-w", str(spoken), "hello world"], check=True)
    wav = folder / "hello.wav"
    subprocess.run(["sox", str(spoken), "-r", "16000", "-b", "16", str(wav)], check=True)
    return wav


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    folder = tmp_path_factory.mktemp("models") / "whisper"
    model, processor = build_whisper_generator(folder)
    return folder, model, processor


def _features(processor, wav: Path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    samples, rate = read_wav(wav)
    return dict(processor.feature_extractor([samples], sampling_rate=rate, return_tensors="pt"))


def _prompt_ids(processor, *tokens: str) -> list[int]:  # noqa: ANN001
    return [processor.tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _reference_steps(model, features, prompt: list[int], new_ids: list[int]) -> list[dict]:  # noqa: ANN001
    """The encoder, then the decoder over its whole prompt (step 0), then over each new token with
    the cache (step k reads token k - 1): written here without modeltap or generate."""
    from transformers import DynamicCache, EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    encoded: list[object] = []

    def prefill() -> None:
        encoded.append(model.get_encoder()(input_features=features["input_features"]))
        model(encoder_outputs=encoded[0], decoder_input_ids=torch.tensor([prompt]), cache=cache)

    def step(token: int) -> None:
        ids = torch.tensor([[token]])
        model(encoder_outputs=encoded[0], decoder_input_ids=ids, cache=cache)

    steps = [plain_outputs(model, prefill)]
    for k in range(1, len(new_ids)):
        steps.append(plain_outputs(model, lambda k=k: step(new_ids[k - 1])))
    return steps


def _generate(model, features, path: Path, **options) -> object:  # noqa: ANN001, ANN003
    inputs = Inputs((), dict(features), {"files": []})
    return generate_model(model, inputs, path, plan=StepPlan("all"), **options)


def test_every_step_after_the_decoder_prompt_equals_a_plain_cached_forward(
    whisper, speech: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    _, model, processor = whisper
    features = _features(processor, speech)
    with torch.no_grad():
        expected = model.generate(**features, max_new_tokens=N)  # without the prompt
    done = _generate(
        model, features, tmp_path / "g.st", tokenizer=processor.tokenizer,
        decoding=Decoding(max_new_tokens=N),
    )  # fmt: skip
    prompt = _prompt_ids(
        processor, "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"
    )
    assert done.decoder_prompt_ids == [prompt]
    assert done.new_ids == expected.tolist() and len(done.new_ids[0]) == N
    assert done.texts == processor.batch_decode(expected, skip_special_tokens=True)
    assert done.forwards == N and done.unstored_forwards == 0 and done.stop == "max_new_tokens"
    dump = load_dump(done.path)
    assert steps_of(dump) == list(range(N))
    reference = _reference_steps(model, features, prompt, done.new_ids[0])
    for step, outputs in enumerate(reference):
        view = step_view(dump, step)
        assert assert_step_matches(view, outputs) > 20
        # the decoder read the whole prompt at step 0, one token after
        assert view["model.decoder.embed_tokens"].shape[1] == (len(prompt) if step == 0 else 1)
        # the step's recorded choice is its own logits' likeliest token, with its probability
        probs = torch.softmax(outputs["__root__"][0, -1], dim=-1)
        chosen = done.steps[step]
        assert chosen["token"] == [int(probs.argmax())] == [done.new_ids[0][step]]
        assert chosen["p"][0] == pytest.approx(float(probs.max()), rel=1e-5)
        second = torch.topk(probs, 2).indices[1]
        assert chosen["second"] == [int(second)]
        assert chosen["p_second"][0] == pytest.approx(float(probs[second]), rel=1e-5)


def test_language_detection_is_a_forward_outside_the_steps(speech: Path, tmp_path: Path) -> None:
    model, processor = build_whisper_generator(tmp_path / "whisper", language=None)
    features = _features(processor, speech)
    with torch.no_grad():
        expected = model.generate(**features, max_new_tokens=N)
    seen = []
    handle = model.register_forward_pre_hook(lambda *a: seen.append(1))
    try:
        done = _generate(
            model, features, tmp_path / "g.st", tokenizer=processor.tokenizer,
            decoding=Decoding(max_new_tokens=N),
        )  # fmt: skip
    finally:
        handle.remove()
    assert len(seen) == N + 1  # the detection, then the decoding loop
    assert done.unstored_forwards == 1 and done.forwards == N
    assert done.new_ids == expected.tolist()
    (prompt,) = done.decoder_prompt_ids
    languages = model.generation_config.lang_to_id.values()
    assert len(prompt) == 3 and prompt[1] in languages  # start, detected language, no timestamps
    dump = load_dump(done.path)
    assert steps_of(dump) == list(range(N))
    # step 0 holds the generation's own encoder and prefill, each once: nothing of the detection
    step0 = step_view(dump, 0)
    assert not [k for k in step0.keys() if "#" in k.partition(":")[0]]
    reference = _reference_steps(model, features, prompt, done.new_ids[0])
    for step, outputs in enumerate(reference):
        assert assert_step_matches(step_view(dump, step), outputs) > 20


def test_eos_is_the_last_steps_token_though_whisper_returns_without_it(
    speech: Path, tmp_path: Path
) -> None:
    model, processor = build_whisper_generator(tmp_path / "whisper")
    features = _features(processor, speech)
    free = _generate(model, features, tmp_path / "free.st", decoding=Decoding(max_new_tokens=N))
    row = free.new_ids[0]
    at = next(k for k in range(1, N) if row[k] not in row[:k])  # a first choice, as the EOS
    model.generation_config.eos_token_id = row[at]
    with torch.no_grad():
        expected = model.generate(**features, max_new_tokens=N)
    assert expected.tolist() == [row[:at]]  # Whisper drops the EOS
    done = _generate(
        model, features, tmp_path / "g.st", tokenizer=processor.tokenizer,
        decoding=Decoding(max_new_tokens=N),
    )  # fmt: skip
    assert done.new_ids == [row[: at + 1]] and done.stop == "eos"
    assert done.forwards == at + 1 and steps_of(load_dump(done.path)) == list(range(at + 1))
    assert done.steps[-1]["token"] == [row[at]]


def test_sampling_with_a_seed_samples_as_whisper_does_with_a_temperature(
    whisper, speech: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    """Whisper's generate takes do_sample from its temperature: --do-sample alone still samples."""
    _, model, processor = whisper
    features = _features(processor, speech)
    done = _generate(
        model, features, tmp_path / "g.st", decoding=Decoding(N, do_sample=True, seed=3)
    )
    torch.manual_seed(3)
    with torch.no_grad():
        expected = model.generate(**features, max_new_tokens=N, do_sample=True, temperature=1.0)
        greedy = model.generate(**features, max_new_tokens=N)
    assert done.new_ids == expected.tolist() != greedy.tolist()


def test_cli_generate_on_a_recording(whisper, speech: Path) -> None:  # noqa: ANN001
    folder, model, processor = whisper
    args = ["generate", str(folder), str(speech), "--max-new-tokens", str(N), "-o", "g.st"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        expected = model.generate(**_features(processor, speech), max_new_tokens=N)
    meta = json.loads(load_dump("g.st").metadata["generate"])
    assert meta["new_ids"] == expected.tolist()
    assert meta["text"] == processor.batch_decode(expected, skip_special_tokens=True)
    assert len(meta["decoder_prompt_ids"][0]) == 4 and meta["unstored_forwards"] == 0
    assert json.loads(load_dump("g.st").metadata["inputs"])["files"][0]["file"] == "hello.wav"


def test_cli_audio_with_a_model_without_a_processor(tmp_path: Path) -> None:
    model, _ = build_whisper_generator(tmp_path / "whisper")
    bare = tmp_path / "bare"
    model.save_pretrained(bare)  # the weights and configs, no feature extractor or tokenizer
    wav = write_wav(tmp_path / "tone.wav", tone(16000, 0.5), 16000)
    result = runner.invoke(app, ["generate", str(bare), str(wav), "-o", "g.st"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "--processor" in lines[0]
    assert not Path("g.st").exists()


def test_cli_compare_generate_against_bf16_on_a_recording(whisper, speech: Path) -> None:  # noqa: ANN001
    folder, model, processor = whisper
    args = ["compare", str(folder), str(speech), "--generate", "3", "--against", "bf16", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["candidate"]["dtype"] == "bfloat16"
    with torch.no_grad():
        expected = model.generate(**_features(processor, speech), max_new_tokens=3)
    assert data["reference_ids"] == expected.tolist()
    assert [s["step"] for s in data["steps"]["steps"]] == [0, 1, 2]
    assert all(s["by"] == "tensors" for s in data["steps"]["steps"])


def test_compare_generation_names_the_faulted_decoder_layer(
    whisper, speech: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    from modeltap.compare.generate import compare_generation

    _, model, processor = whisper
    inputs = Inputs((), _features(processor, speech), {"files": []})
    candidate = copy.deepcopy(model)
    with torch.no_grad():
        candidate.model.decoder.layers[1].fc2.weight.mul_(3.0)
    result = compare_generation(
        model, candidate, inputs, tmp_path, decoding=Decoding(max_new_tokens=3),
        tokenizer=processor.tokenizer,
    )  # fmt: skip
    assert not result.passed
    assert result.steps.first_divergence.step == 0
    assert result.attributed_step is not None
    origins = [m.name for m in result.attribution.origins]
    assert origins and origins[0] == "model.decoder.layers.1.fc2", origins


def test_a_second_decoding_loop_is_refused(speech: Path, tmp_path: Path) -> None:
    """Long-form or fallback decoding runs the loop again from an empty cache: its forwards can't
    be numbered after the first loop's, and nothing is written."""
    from modeltap.errors import InputError

    model, processor = build_whisper_generator(tmp_path / "whisper")
    once = model.generate
    model.generate = lambda *args, **kwargs: (once(*args, **kwargs), once(*args, **kwargs))[1]
    with pytest.raises(InputError, match=r"ran its decoding loop again \(step 3 ends at decoder"):
        _generate(model, _features(processor, speech), tmp_path / "g.st", decoding=Decoding(3))
    assert list(tmp_path.glob("g.st*")) == []


def test_cli_new_tokens_past_the_decoders_positions(whisper, speech: Path) -> None:  # noqa: ANN001
    folder, model, _ = whisper
    limit = model.config.max_target_positions
    args = ["generate", str(folder), str(speech), "-o", "g.st", "--max-new-tokens", str(limit)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    # (the espeak recording is longer than the tiny Whisper's 1 s window: a note says so)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and f"at most {limit - 1} new ones fit" in lines[0], result.output
    assert not Path("g.st").exists()
