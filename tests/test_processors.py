"""Images and audio through the model's processor (loading/processors.py, dump/grads FILE args).

Each model is tiny and random, saved offline with a real processor. The expected values come from
the test's own `processor(...)` + `model(...)` with hooks written here (fixtures/media.py), on
images read with Pillow and WAVs read with the standard library's `wave`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.errors import InputError
from modeltap.loading.audio import resample
from modeltap.loading.processors import Kind, classify, sort_inputs
from tests.fixtures.media import (
    build_clip,
    build_convnext,
    build_detr,
    build_llava,
    build_vit,
    build_whisper,
    hooked_forward,
    read_wav,
    tone,
    write_image,
    write_wav,
)

runner = CliRunner()
CLASSIFIER = ("--model-class", "AutoModelForImageClassification")


@pytest.fixture(autouse=True)
def _quiet_transformers():
    # Without torchvision every image processor load warns that it falls back to Pillow.
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


def dump(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["dump", *args])
    return result.exit_code, result.output


def stored(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def assert_same_as_plain(
    path: Path, folder: Path, inputs: dict, *, at_least: int, auto: str = "AutoModel"
) -> None:
    """Every module output of a plain forward equals the dump's tensor of that key."""
    model = getattr(transformers, auto).from_pretrained(folder).eval()
    expected = hooked_forward(model, **inputs)
    tensors, _ = stored(path)
    common = [k for k in expected if k in tensors]
    assert len(common) >= at_least, sorted(tensors)[:20]
    for key in common:
        torch.testing.assert_close(tensors[key], expected[key], rtol=0, atol=0, msg=key)


# --- telling files apart ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "TIFF"])
def test_images_are_told_by_content_not_name(tmp_path, fmt):
    path = write_image(tmp_path / "picture.dat", 8, 8, format=fmt)
    assert classify(path) is Kind.image


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_audio_is_told_by_content(tmp_path, fmt):
    import soundfile

    if fmt not in soundfile.available_formats():
        pytest.skip(f"this libsndfile does not write {fmt}")
    path = tmp_path / "sound.bin"
    soundfile.write(str(path), np.zeros(800, dtype=np.float32), 8000, format=fmt)
    assert classify(path) is Kind.audio


def test_positionals_sort_into_text_image_audio(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_image(tmp_path / "cat.png", 8, 8)
    write_wav(tmp_path / "hi.wav", tone(8000, 0.1), 8000)
    (tmp_path / "notes").write_text("a file named like a sentence")
    media = sort_inputs(["cat.png", "a cat", "hi.wav"], texts=["notes"])
    assert media.texts == ["notes", "a cat"]
    assert media.images == [Path("cat.png")] and media.audio == [Path("hi.wav")]


# --- dumps equal a plain processor + forward ---------------------------------------------------


def test_vit_two_images_of_two_sizes_as_one_batch(tmp_path):
    folder = tmp_path / "vit"
    _, processor = build_vit(folder)
    a = write_image(tmp_path / "a.png", 40, 30, seed=1)
    b = write_image(tmp_path / "b.jpg", 20, 52, seed=2, quality=90)
    out = tmp_path / "vit.safetensors"
    code, output = dump(str(folder), str(a), str(b), "-o", str(out), *CLASSIFIER)
    assert code == 0, output
    images = [Image.open(p).convert("RGB") for p in (a, b)]
    inputs = processor(images=images, return_tensors="pt")
    assert_same_as_plain(out, folder, dict(inputs), at_least=5, auto=CLASSIFIER[1])
    _, meta = stored(out)
    described = json.loads(meta["inputs"])
    assert described["tensors"] == {"pixel_values": [2, 3, 16, 16]}
    assert [f["file"] for f in described["files"]] == ["a.png", "b.jpg"]
    assert described["processor"].startswith("ViTImageProcessor")


def test_convnext_turns_an_image_by_its_exif_orientation(tmp_path):
    folder = tmp_path / "convnext"
    _, processor = build_convnext(folder)
    path = tmp_path / "sideways.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    write_image(path, 48, 24, seed=3, exif=exif, quality=95)
    out = tmp_path / "convnext.safetensors"
    code, output = dump(str(folder), str(path), "-o", str(out), *CLASSIFIER)
    assert code == 0, output
    upright = Image.open(path).convert("RGB").transpose(Image.Transpose.ROTATE_270)
    assert upright.size == (24, 48)
    inputs = processor(images=[upright], return_tensors="pt")
    assert_same_as_plain(out, folder, dict(inputs), at_least=5, auto=CLASSIFIER[1])


def test_detr_pads_images_of_two_sizes_with_a_pixel_mask(tmp_path):
    folder = tmp_path / "detr"
    _, processor = build_detr(folder)
    a = write_image(tmp_path / "wide.png", 60, 30, seed=4)
    b = write_image(tmp_path / "tall.png", 30, 45, seed=5)
    out = tmp_path / "detr.safetensors"
    code, output = dump(str(folder), str(a), str(b), "-o", str(out))
    assert code == 0, output
    images = [Image.open(p).convert("RGB") for p in (a, b)]
    inputs = processor(images=images, return_tensors="pt")
    assert set(inputs) == {"pixel_values", "pixel_mask"}
    assert_same_as_plain(out, folder, dict(inputs), at_least=10)


def test_clip_runs_an_image_and_texts_through_one_processor_call(tmp_path):
    folder = tmp_path / "clip"
    _, processor = build_clip(folder)
    image = write_image(tmp_path / "cat.png", 30, 20, seed=6)
    out = tmp_path / "clip.safetensors"
    code, output = dump(str(folder), str(image), "hello world", "the lazy dog", "-o", str(out))
    assert code == 0, output
    inputs = processor(
        text=["hello world", "the lazy dog"],
        images=[Image.open(image).convert("RGB")],
        return_tensors="pt",
        padding=True,
    )
    assert_same_as_plain(out, folder, dict(inputs), at_least=10)
    _, meta = stored(out)
    described = json.loads(meta["inputs"])
    assert described["texts"] == ["hello world", "the lazy dog"]
    assert set(described["tensors"]) == {"input_ids", "attention_mask", "pixel_values"}


def test_whisper_wav_at_the_extractor_rate_with_the_decoder_start(tmp_path):
    folder = tmp_path / "whisper"
    _, extractor = build_whisper(folder)
    wav = write_wav(tmp_path / "hi.wav", tone(16000, 0.6), 16000)
    out = tmp_path / "whisper.safetensors"
    code, output = dump(str(folder), str(wav), "-o", str(out))
    assert code == 0, output
    samples, rate = read_wav(wav)
    inputs = dict(extractor([samples], sampling_rate=rate, return_tensors="pt"))
    inputs["decoder_input_ids"] = torch.tensor([[1]])
    assert_same_as_plain(out, folder, inputs, at_least=10)


def test_whisper_8khz_stereo_is_mixed_down_and_resampled_with_a_note(tmp_path):
    folder = tmp_path / "whisper"
    _, extractor = build_whisper(folder)
    left = tone(8000, 0.5, freq=300)
    stereo = np.stack([left, left], axis=1)
    wav = write_wav(tmp_path / "low.wav", stereo, 8000)
    out = tmp_path / "whisper.safetensors"
    code, output = dump(str(folder), str(wav), "-o", str(out))
    assert code == 0, output
    _, meta = stored(out)
    (entry,) = json.loads(meta["inputs"])["files"]
    assert entry["note"] == "2 channels mixed down to mono; resampled from 8000 Hz to 16000 Hz"
    # The same tone made at 16 kHz directly: the log-mel features of the resampled one agree
    # (windowed-sinc interpolation of a 300 Hz sine is exact to ~1e-4 away from the ends).
    direct = tone(16000, 0.5, freq=300).astype(np.float32) / 32768
    feats = extractor([direct], sampling_rate=16000, return_tensors="pt")["input_features"]
    model = transformers.AutoModel.from_pretrained(folder).eval()
    seen = hooked_forward(model, input_features=feats, decoder_input_ids=torch.tensor([[1]]))
    tensors, _ = stored(out)
    torch.testing.assert_close(tensors["encoder.conv1"], seen["encoder.conv1"], atol=2e-2, rtol=0)


def test_resample_matches_the_tone_made_at_the_new_rate():
    low = np.sin(2 * np.pi * 440 * np.arange(8000) / 8000).astype(np.float32)
    high = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    got = resample(low, 8000, 16000)
    assert got.shape == (16000,) and got.dtype == np.float32
    assert np.abs(got[200:-200] - high[200:-200]).max() < 2e-3
    down = resample(high.astype(np.float32), 16000, 11025)
    assert down.shape == (11025,)
    expected = np.sin(2 * np.pi * 440 * np.arange(11025) / 11025)
    assert np.abs(down[200:-200] - expected[200:-200]).max() < 2e-3


@pytest.mark.parametrize(("orig", "new"), [(8000, 16000), (44100, 16000), (16000, 11025)])
def test_resample_is_the_windowed_sinc_sum_sample_by_sample(orig, new):
    # y[n] = sum_k x[k] * s * sinc(s * (k - n / r)) * cos^2(pi s (k - n / r) / 12) over the 6 zero
    # crossings each side, s = 0.99 min(orig, new) / orig, r = new / orig: torchaudio's defaults,
    # summed here one output sample at a time in float64 instead of as modeltap's strided conv.
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    got = resample(x, orig, new)
    g = np.gcd(orig, new)
    o, n_ = orig // g, new // g
    s = 0.99 * min(o, n_) / o
    k = np.arange(len(x))
    expected = np.empty(len(got))
    for n in range(len(got)):
        t = np.clip((k - n * o / n_) * s, -6, 6)
        window = np.cos(np.pi * t / 12) ** 2
        expected[n] = np.sum(x * s * np.sinc(t) * window)
    assert len(got) == -(-len(x) * n_ // o)
    np.testing.assert_allclose(got, expected, atol=1e-4)  # float32 kernel and sums


def test_whisper_on_speech_spoken_by_espeak(tmp_path):
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        reason = "espeak-ng and sox are not installed; scripts/setup.sh --browser installs them"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)  # CI runs setup.sh --browser: there the test must run
        pytest.skip(reason)
    folder = tmp_path / "whisper"
    _, extractor = build_whisper(folder)
    spoken = tmp_path / "spoken.wav"
    subprocess.run(["espeak-ng", "-w", str(spoken), "hello"], check=True, capture_output=True)
    wav = tmp_path / "hello.wav"
    subprocess.run(["sox", str(spoken), "-r", "16000", "-b", "16", str(wav)], check=True)
    out = tmp_path / "speech.safetensors"
    code, output = dump(str(folder), str(wav), "-o", str(out))
    assert code == 0, output
    samples, rate = read_wav(wav)
    assert rate == 16000 and np.abs(samples).max() > 0.05
    inputs = dict(extractor([samples], sampling_rate=rate, return_tensors="pt"))
    inputs["decoder_input_ids"] = torch.tensor([[1]])
    assert_same_as_plain(out, folder, inputs, at_least=10)


# --- bad input: one line, exit 2, before the model loads -------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the weights fails the test: these errors must come before it."""
    import modeltap.loading
    import modeltap.loading.hf

    def boom(*_a, **_k):
        raise AssertionError("the model was loaded before the input was checked")

    # the package's lazy name first: resolved after the patch below, it would keep `boom`
    monkeypatch.setattr(modeltap.loading, "load_model", boom, raising=False)
    monkeypatch.setattr(modeltap.loading.hf, "load_model", boom)


def refused(*args: str) -> str:
    code, output = dump(*args)
    assert code == 2, output
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    return lines[0]


@pytest.fixture(scope="module")
def vit_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "vit"
    build_vit(folder)
    return folder


@pytest.fixture(scope="module")
def whisper_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "whisper"
    build_whisper(folder)
    return folder


def test_corrupt_image(tmp_path, vit_folder, no_model_load):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    line = refused(str(vit_folder), str(bad), "-o", str(tmp_path / "x.safetensors"))
    assert "can't read image" in line and "bad.png" in line
    assert not (tmp_path / "x.safetensors").exists()


def test_truncated_jpeg(tmp_path, vit_folder, no_model_load):
    whole = write_image(tmp_path / "whole.jpg", 64, 64, quality=95)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    line = refused(str(vit_folder), str(cut))
    assert "can't read image" in line and "cut.jpg" in line


def test_zero_length_wav(tmp_path, whisper_folder, no_model_load):
    empty = write_wav(tmp_path / "empty.wav", np.zeros(0, dtype=np.int16), 16000)
    line = refused(str(whisper_folder), str(empty))
    assert "has no samples" in line


def test_corrupt_wav(tmp_path, whisper_folder, no_model_load):
    good = write_wav(tmp_path / "good.wav", tone(16000, 0.2), 16000)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(good.read_bytes()[:12] + b"\x00" * 30)
    line = refused(str(whisper_folder), str(bad))
    assert "can't read audio" in line and "bad.wav" in line


def test_image_given_to_a_text_only_model(tmp_path, no_model_load):
    from tests.fixtures.hf import build_bert

    folder = build_bert(tmp_path / "bert")
    image = write_image(tmp_path / "cat.png", 8, 8)
    line = refused(str(folder), str(image))
    assert "takes no images" in line and "--processor" in line


def test_audio_given_to_an_image_processor(tmp_path, vit_folder, no_model_load):
    wav = write_wav(tmp_path / "hi.wav", tone(16000, 0.1), 16000)
    line = refused(str(vit_folder), str(wav))
    assert "takes no audio" in line


def test_audio_given_to_a_text_only_processor(tmp_path, vit_folder, no_model_load):
    from tests.fixtures.hf import build_bert

    bert = build_bert(tmp_path / "bert")
    wav = write_wav(tmp_path / "hi.wav", tone(16000, 0.1), 16000)
    line = refused(str(vit_folder), "--processor", str(bert), str(wav))
    assert "takes no audio" in line


def test_unsupported_format(tmp_path, vit_folder, no_model_load):
    gif = tmp_path / "anim.gif"
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    line = refused(str(vit_folder), str(gif))
    assert "not a supported image" in line and "--text" in line


def test_tensor_file_given_as_a_positional(tmp_path, vit_folder, no_model_load):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros(3))
    line = refused(str(vit_folder), str(npy))
    assert f"--input-file {npy}" in line


def test_processor_not_found_offline(tmp_path, no_model_load, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bare = tmp_path / "bare"
    build_vit(bare)
    (bare / "preprocessor_config.json").unlink()
    image = write_image(tmp_path / "cat.png", 8, 8)
    line = refused(str(bare), str(image))
    assert "no processor for" in line and "--processor" in line


def test_missing_pillow_names_the_extra(tmp_path, vit_folder, no_model_load, monkeypatch):
    image = write_image(tmp_path / "cat.png", 8, 8)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    line = refused(str(vit_folder), str(image))
    assert "pip install 'modeltap[vision]'" in line


def test_missing_soundfile_names_the_extra(tmp_path, whisper_folder, no_model_load, monkeypatch):
    wav = write_wav(tmp_path / "hi.wav", tone(16000, 0.1), 16000)
    monkeypatch.setitem(sys.modules, "soundfile", None)
    line = refused(str(whisper_folder), str(wav))
    assert "pip install 'modeltap[audio]'" in line


def test_missing_image_option_file(tmp_path, vit_folder):
    line = refused(str(vit_folder), "--image", str(tmp_path / "nope.png"))
    assert "no file" in line and "--image" in line


def test_images_a_processor_cannot_batch_name_their_sizes(tmp_path, no_model_load):
    from transformers import ViTImageProcessor

    folder = tmp_path / "vit"
    build_vit(folder)
    ViTImageProcessor(do_resize=False).save_pretrained(folder)
    a = write_image(tmp_path / "a.png", 16, 16)
    b = write_image(tmp_path / "b.png", 24, 16)
    line = refused(str(folder), str(a), str(b))
    assert "can't batch images of sizes 16x16, 24x16" in line


def test_recordings_of_two_lengths_pad_where_the_extractor_would_not(tmp_path):
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    folder = tmp_path / "w2v"
    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        conv_dim=(16,),
        conv_stride=(5,),
        conv_kernel=(10,),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
    )
    Wav2Vec2Model(config).save_pretrained(folder)
    extractor = Wav2Vec2FeatureExtractor(return_attention_mask=True)
    extractor.save_pretrained(folder)
    a = write_wav(tmp_path / "a.wav", tone(16000, 0.1), 16000)
    b = write_wav(tmp_path / "b.wav", tone(16000, 0.2, freq=220), 16000)
    out = tmp_path / "w2v.safetensors"
    code, output = dump(str(folder), str(a), str(b), "-o", str(out))
    assert code == 0, output
    waves = [read_wav(p)[0] for p in (a, b)]
    inputs = extractor(waves, sampling_rate=16000, padding=True, return_tensors="pt")
    assert inputs["input_values"].shape == (2, 3200)
    assert_same_as_plain(out, folder, dict(inputs), at_least=5)


# --- the processed inputs in the dump, and diff's "inputs differ" --------------------------


def test_processed_inputs_are_stored_first_with_the_processor(tmp_path):
    folder = tmp_path / "clip"
    _, processor = build_clip(folder)
    image = write_image(tmp_path / "cat.png", 30, 20, seed=6)
    out = tmp_path / "clip.safetensors"
    code, output = dump(str(folder), str(image), "hello world", "-o", str(out))
    assert code == 0, output
    expected = processor(
        text=["hello world"], images=[Image.open(image).convert("RGB")], return_tensors="pt"
    )
    tensors, meta = stored(out)
    for name in ("input_ids", "attention_mask", "pixel_values"):
        torch.testing.assert_close(tensors[f"inputs/{name}"], expected[name], rtol=0, atol=0)
    order = json.loads(meta["order"])
    assert {k for k in order[:3]} == {
        "inputs/input_ids",
        "inputs/attention_mask",
        "inputs/pixel_values",
    }
    described = json.loads(meta["inputs"])
    assert described["processor"] == "CLIPProcessor"
    assert len(described["processor_sha256"]) == 64
    import hashlib

    assert described["files"] == [
        {
            "file": "cat.png",
            "kind": "image",
            "sha256": hashlib.sha256(image.read_bytes()).hexdigest(),
        }
    ]
    stats_out = tmp_path / "stats.safetensors"
    code, output = dump(
        str(folder), str(image), "hello world", "-o", str(stats_out), "--stats-only"
    )
    assert code == 0, output
    assert not any(k.startswith("inputs/") for k in json.loads(stored(stats_out)[1]["order"]))


def test_diff_names_preprocessing_drift_before_any_module(tmp_path):
    from transformers import ViTImageProcessor

    folder = tmp_path / "vit"
    build_vit(folder)
    image = write_image(tmp_path / "cat.png", 40, 30, seed=1)
    before, after = tmp_path / "before.safetensors", tmp_path / "after.safetensors"
    # ViTModel, the classifier's base, has a pooler the checkpoint lacks (not what is compared)
    base = ("--allow-missing-weights",)
    assert dump(str(folder), str(image), *base, "-o", str(before))[0] == 0
    # the upgrade that changes a default: another resampling filter, same model
    ViTImageProcessor(size={"height": 16, "width": 16}, resample=3).save_pretrained(folder)
    assert dump(str(folder), str(image), *base, "-o", str(after))[0] == 0
    result = runner.invoke(app, ["diff", str(after), str(before)])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("FAIL"))
    assert lines[verdict].startswith("FAIL: inputs differ")
    assert lines[verdict + 1].startswith("inputs differ: inputs/pixel_values")
    assert "first divergence: embeddings" in result.output
    report = json.loads(runner.invoke(app, ["diff", str(after), str(before), "--json"]).output)
    assert report["inputs_differ"] == ["inputs/pixel_values"]
    assert report["first_divergence"] != "inputs/pixel_values"
    same = runner.invoke(app, ["diff", str(before), str(before), "--json"])
    assert same.exit_code == 0 and json.loads(same.output)["inputs_differ"] == []


# --- gradients w.r.t. the processor's output ---------------------------------------------------


def test_grads_wrt_pixel_values_equal_autograd_on_the_processed_image(tmp_path):
    folder = tmp_path / "vit"
    _, processor = build_vit(folder)
    a = write_image(tmp_path / "a.png", 40, 30, seed=1)
    b = write_image(tmp_path / "b.png", 24, 24, seed=2)
    out = tmp_path / "vit.grads.safetensors"
    result = runner.invoke(
        app,
        [
            "grads",
            str(folder),
            str(a),
            str(b),
            "--target",
            "layernorm",
            "--wrt",
            "pixel_values",
            "--allow-missing-weights",  # ViTModel's pooler, after the target
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    model = transformers.AutoModel.from_pretrained(folder).eval()
    images = [Image.open(p).convert("RGB") for p in (a, b)]
    x = processor(images=images, return_tensors="pt")["pixel_values"].requires_grad_()
    (expected,) = torch.autograd.grad(model(pixel_values=x).last_hidden_state.sum(), x)
    tensors, meta = stored(out)
    torch.testing.assert_close(tensors["grad/inputs/pixel_values"], expected, rtol=1e-5, atol=1e-7)
    assert [k for k in tensors if k.startswith("grad/")] == ["grad/inputs/pixel_values"]
    grad = json.loads(meta["grad"])
    assert grad["keys"] == ["inputs/pixel_values"] and grad["no_path"] == {}
    stats = json.loads(meta["stats"])["grad/inputs/pixel_values"]
    assert stats["norm"] == pytest.approx(float(expected.norm()), rel=1e-5)


def test_grads_wrt_input_features_beside_a_module(tmp_path):
    folder = tmp_path / "whisper"
    _, extractor = build_whisper(folder)
    wav = write_wav(tmp_path / "hi.wav", tone(16000, 0.6), 16000)
    out = tmp_path / "whisper.grads.safetensors"
    args = ["grads", str(folder), str(wav), "--target", "encoder.layer_norm"]
    result = runner.invoke(
        app, [*args, "--wrt", "input_features", "--wrt", "encoder.conv1", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    model = transformers.AutoModel.from_pretrained(folder).eval()
    samples, rate = read_wav(wav)
    x = extractor([samples], sampling_rate=rate, return_tensors="pt")["input_features"]
    x.requires_grad_()
    seen = {}
    handle = model.encoder.conv1.register_forward_hook(lambda m, i, o: seen.setdefault("c", o))
    y = model.encoder(input_features=x).last_hidden_state
    handle.remove()
    gx, gc = torch.autograd.grad(y.sum(), [x, seen["c"]])
    tensors, _ = stored(out)
    torch.testing.assert_close(tensors["grad/inputs/input_features"], gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(tensors["grad/encoder.conv1"], gc, rtol=1e-5, atol=1e-7)


def test_grads_wrt_token_ids_is_refused(tmp_path):
    folder = tmp_path / "clip"
    build_clip(folder)
    image = write_image(tmp_path / "cat.png", 30, 20)
    result = runner.invoke(
        app, ["grads", str(folder), str(image), "hello world", "--wrt", "input_ids"]
    )
    assert result.exit_code == 2, result.output
    assert "--wrt input_ids: int64 inputs take no gradient" in result.output


def test_compare_runs_both_checkpoints_on_the_processed_image(tmp_path):
    folder = tmp_path / "vit"
    _, processor = build_vit(folder)
    image = write_image(tmp_path / "cat.png", 40, 30, seed=1)
    work = tmp_path / "work"
    result = runner.invoke(
        app,
        ["compare", str(folder), str(folder), str(image), "--out-dir", str(work), *CLASSIFIER],
    )
    assert result.exit_code == 0, result.output
    expected = processor(images=[Image.open(image).convert("RGB")], return_tensors="pt")
    # both sides run on the same processed tensors (one processor call): the reference dump
    # equals the plain forward on the test's own processor output
    reference = work / "reference.safetensors"
    assert_same_as_plain(reference, folder, dict(expected), at_least=5, auto=CLASSIFIER[1])


# --- folders, and inputs for scripts -----------------------------------------------------------


def test_images_dir_is_one_batch_by_name_with_a_limit(tmp_path):
    folder = tmp_path / "vit"
    _, processor = build_vit(folder)
    photos = tmp_path / "photos"
    photos.mkdir()
    for i, (w, h) in enumerate([(20, 30), (40, 20), (16, 16)]):
        write_image(photos / f"{i}.png", w, h, seed=i)
    (photos / "README.txt").write_text("not a picture")
    out = tmp_path / "dir.safetensors"
    args = [str(folder), "--images-dir", str(photos), "--batch", "2", *CLASSIFIER]
    code, output = dump(*args, "-o", str(out))
    assert code == 0, output
    images = [Image.open(photos / f"{i}.png").convert("RGB") for i in (0, 1)]
    inputs = processor(images=images, return_tensors="pt")
    assert_same_as_plain(out, folder, dict(inputs), at_least=5, auto=CLASSIFIER[1])
    files = json.loads(stored(out)[1]["inputs"])["files"]
    assert [f["file"] for f in files] == ["0.png", "1.png"]


def test_folder_with_no_usable_files(tmp_path, vit_folder, no_model_load):
    empty = tmp_path / "docs"
    empty.mkdir()
    (empty / "notes.txt").write_text("nothing to see")
    line = refused(str(vit_folder), "--images-dir", str(empty))
    assert "no image files" in line and "docs" in line
    line = refused(str(vit_folder), "--audio-dir", str(tmp_path / "missing"))
    assert "no folder" in line and "--audio-dir" in line
    assert "--batch/--limit counts the files" in refused(str(vit_folder), "hello", "--limit", "2")
    assert "--batch/--limit counts the files" in refused(str(vit_folder), "hello", "--batch", "2")


def test_inputs_from_builds_forward_kwargs_for_a_script(tmp_path):
    import modeltap

    folder = tmp_path / "clip"
    model, processor = build_clip(folder)
    image = write_image(tmp_path / "cat.png", 30, 20, seed=6)
    inputs = modeltap.inputs_from(folder, image, "hello world")
    expected = processor(
        text=["hello world"], images=[Image.open(image).convert("RGB")], return_tensors="pt"
    )
    assert set(inputs.kwargs) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(inputs.kwargs[name], value, rtol=0, atol=0)
    with torch.no_grad():
        out = model(**inputs.kwargs)
    assert out.logits_per_image.shape == (1, 1)


# --- vision-language models: image + text through one call, --chat ----------------------------


def test_llava_chat_turn_with_an_image(tmp_path):
    folder = tmp_path / "llava"
    _, processor = build_llava(folder)
    image = write_image(tmp_path / "cat.png", 30, 20, seed=7)
    out = tmp_path / "llava.safetensors"
    code, output = dump(str(folder), "--image", str(image), "hello world", "--chat", "-o", str(out))
    assert code == 0, output
    turn = [{"type": "image"}, {"type": "text", "text": "hello world"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": turn}], add_generation_prompt=True
    )
    assert prompt == "user: <image>hello world | assistant:"
    inputs = processor(text=prompt, images=[Image.open(image).convert("RGB")], return_tensors="pt")
    assert_same_as_plain(out, folder, dict(inputs), at_least=20)
    described = json.loads(stored(out)[1]["inputs"])
    assert described["texts"] == ["hello world"] and described["chat_prompt"] == prompt


def test_llava_without_chat_names_the_fix(tmp_path, no_model_load):
    folder = tmp_path / "llava"
    build_llava(folder)
    image = write_image(tmp_path / "cat.png", 30, 20)
    line = refused(str(folder), str(image), "hello world")
    assert "add --chat" in line
    line = refused(str(folder), str(image), "one", "two", "--chat")
    assert "--chat makes one user turn; give one TEXT (got 2)" in line


def test_chat_with_a_processor_without_template(tmp_path, vit_folder, no_model_load):
    from tests.fixtures.hf import build_bert

    bert = build_bert(tmp_path / "bert")
    line = refused(str(bert), "hello world", "--chat")
    assert "has no chat template; drop --chat" in line


def test_heading_names_the_files_and_the_processor_and_no_decoder_start_is_stored(tmp_path):
    folder = tmp_path / "whisper"
    build_whisper(folder)
    wav = write_wav(tmp_path / "hi.wav", tone(16000, 0.2), 16000)
    out = tmp_path / "w.safetensors"
    code, output = dump(str(folder), str(wav), "-o", str(out), "--depth", "1")
    assert code == 0, output
    from modeltap.dump import load_dump
    from modeltap.render import dump_heading

    heading = dump_heading(load_dump(out)).plain
    assert "inputs: hi.wav via WhisperProcessor" in heading
    tensors, meta = stored(out)
    assert [k for k in tensors if k.startswith("inputs/")] == ["inputs/input_features"]
    assert json.loads(meta["inputs"])["decoder_input_ids"] == "decoder start token 1"


def test_a_folder_given_as_a_positional_names_the_dir_options(tmp_path, vit_folder, no_model_load):
    photos = tmp_path / "photos"
    photos.mkdir()
    line = refused(str(vit_folder), str(photos))
    assert f"--images-dir {photos}" in line


def test_a_text_file_starting_like_a_bitmap_is_not_an_image(tmp_path):
    notes = tmp_path / "notes"
    notes.write_text("BMW and other car makers")
    with pytest.raises(InputError, match="not a supported image"):
        classify(notes)


# --- #29: inputs a model or a file can't take, named before anything is written -------------


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "clip"
    build_clip(folder)
    return folder


def test_clip_given_text_only_names_the_image_it_needs(tmp_path, clip_folder):
    # The model itself can't run on text alone: its forward fails inside the vision tower.
    model = transformers.AutoModel.from_pretrained(clip_folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(clip_folder)
    with pytest.raises(AttributeError, match="NoneType"):
        model(**tok(["a cat"], return_tensors="pt"))
    out = tmp_path / "clip.safetensors"
    line = refused(str(clip_folder), "a cat", "-o", str(out))
    assert "CLIPModel" in line and "an image" in line and 'cat.jpg "a cat"' in line, line
    assert "--model-class CLIPTextModel" in line
    assert not out.exists()
    result = runner.invoke(app, ["compare", str(clip_folder), "a cat", "--against", "bf16"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "an image" in line and "modeltap compare MODEL cat.jpg" in line


def test_clip_given_an_image_only_names_the_text_it_needs(tmp_path, clip_folder):
    image = write_image(tmp_path / "cat.png", 20, 20)
    line = refused(str(clip_folder), str(image), "-o", str(tmp_path / "x.safetensors"))
    assert "got no text" in line and "--model-class CLIPVisionModel" in line
    assert not (tmp_path / "x.safetensors").exists()


def test_a_model_that_merely_accepts_an_image_runs_on_text_alone(tmp_path):
    """Llava takes pixel_values but does not need them: text alone is not refused."""
    from modeltap.loading import Inputs, check_paired_inputs

    model, processor = build_llava(tmp_path / "llava")
    batch = dict(processor.tokenizer(["hello"], return_tensors="pt"))
    model(**batch)  # the plain model runs on it
    check_paired_inputs(model, Inputs((), batch, {}))


def test_a_missing_file_named_like_one_is_an_error_naming_it(tmp_path, vit_folder, no_model_load):
    for name in ("media/missing.jpg", "missing.wav", "frames.mp4"):
        line = refused(str(vit_folder), name, "-o", str(tmp_path / "x.safetensors"))
        assert f"no file '{name}'" in line and f"--text '{name}'" in line, line
    assert not (tmp_path / "x.safetensors").exists()
    # sentences that mention a file, and names that exist, are what they were
    media = sort_inputs(["a photo of cat.jpg", "cat.jpg is lost", "notes"])
    assert media.texts == ["a photo of cat.jpg", "cat.jpg is lost", "notes"]


def _truncated_wav(tmp_path: Path) -> Path:
    whole = write_wav(tmp_path / "whole.wav", tone(16000, 53576 / 16000), 16000)
    cut = tmp_path / "cut.wav"
    cut.write_bytes(whole.read_bytes()[: 44 + 1478 * 2])
    return cut


def test_a_truncated_wav_is_refused(tmp_path, whisper_folder, no_model_load):
    cut = _truncated_wav(tmp_path)
    with wave.open(str(cut)) as w:  # the standard library reads the header's count
        assert w.getnframes() == 53576
        assert len(w.readframes(w.getnframes())) == 1478 * 2
    out = tmp_path / "x.safetensors"
    line = refused(str(whisper_folder), str(cut), "-o", str(out))
    assert "truncated" in line and "53576" in line and "1478" in line and "cut.wav" in line
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["MP3", "FLAC", "WAV"])
def test_a_truncated_compressed_file_is_refused_and_a_whole_one_is_not(
    tmp_path, whisper_folder, fmt
):
    import soundfile

    if fmt not in soundfile.available_formats():
        pytest.skip(f"this libsndfile does not write {fmt}")
    t = np.arange(16000 * 3) / 16000
    whole = tmp_path / f"whole.{fmt.lower()}"
    soundfile.write(str(whole), 0.3 * np.sin(2 * np.pi * 440 * t), 16000, format=fmt)
    cut = tmp_path / f"cut.{fmt.lower()}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 3])
    line = refused(str(whisper_folder), str(cut), "-o", str(tmp_path / "x.safetensors"))
    assert "truncated" in line or "can't read audio" in line, line
    assert not (tmp_path / "x.safetensors").exists()
    code, output = dump(str(whisper_folder), str(whole), "--depth", "0", "-o", "whole.safetensors")
    assert code == 0, output


def test_audio_longer_than_the_extractor_window_says_so(tmp_path, whisper_folder):
    _, extractor = build_whisper(tmp_path / "again")
    assert extractor.n_samples == 16000  # the tiny Whisper's window: 1 s
    wav = write_wav(tmp_path / "long.wav", tone(16000, 2.5), 16000)
    out = tmp_path / "w.safetensors"
    result = runner.invoke(app, ["dump", str(whisper_folder), str(wav), "-o", str(out)])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "window" in line]
    assert len(notes) == 1 and "long.wav is 2.5 s" in notes[0] and "first 1 s" in notes[0]
    tensors, meta = stored(out)
    (entry,) = json.loads(meta["inputs"])["files"]
    assert entry["seconds"] == 2.5 and entry["window_s"] == 1.0 and "window" in entry["note"]
    # what ran is the first second: the extractor on those samples alone gives the same features
    samples, rate = read_wav(wav)
    first = extractor([samples[:16000]], sampling_rate=rate, return_tensors="pt")
    torch.testing.assert_close(tensors["inputs/input_features"], first["input_features"])


def test_audio_within_the_window_has_no_note(tmp_path, whisper_folder):
    wav = write_wav(tmp_path / "short.wav", tone(16000, 0.5), 16000)
    result = runner.invoke(app, ["dump", str(whisper_folder), str(wav), "-o", "s.safetensors"])
    assert result.exit_code == 0, result.output
    assert "window" not in result.stderr
    _, meta = stored(tmp_path / "s.safetensors")
    assert "window_s" not in json.loads(meta["inputs"])["files"][0]
