"""Images and audio through the model's own processor, as its Hugging Face pipeline would.

Files are told apart by their first bytes, not their names. Pillow (`modeltap[vision]`) and
soundfile (`modeltap[audio]`) are imported only when an image or a recording is read, so text-only
runs and `modeltap --help` never need them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from modeltap.errors import InputError, first_line
from modeltap.loading.audio import (
    Audio,
    audio_padding,
    import_extra,
    read_recordings,
    sampling_rate,
)
from modeltap.loading.inputs import Inputs, _sha256


class Kind(str, Enum):
    image = "image"
    audio = "audio"


IMAGE_FORMATS = "PNG, JPEG, WebP, BMP, TIFF"
AUDIO_FORMATS = "WAV, FLAC, OGG, MP3"
_TENSOR_SUFFIXES = (".safetensors", ".npy", ".npz", ".pt", ".pth")
# Names that are meant as files: a positional value ending so that does not exist is an error,
# not a sentence about a file.
_FILE_SUFFIXES = frozenset(
    {
        *(".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".heic"),
        *(".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac"),
        *(".mp4", ".mov", ".avi", ".mkv", ".webm"),
        *_TENSOR_SUFFIXES,
    }
)
# The command-line options a hint may name; a caller passes the flags its command has
# (`offered`), None meaning all of them (the library's own use).
Offered = Collection[str] | None


def _has(offered: Offered, flag: str) -> bool:
    return offered is None or flag in offered


def _either(fixes: list[str]) -> str:
    return ", or ".join(fixes)


def _fixes(first: str, offered: Offered, flag: str, fix: str) -> str:
    """`first`, or `fix` too where the caller's command has `flag`."""
    return _either([first, fix] if _has(offered, flag) else [first])


def classify(path: str | os.PathLike[str], *, offered: Offered = None) -> Kind:
    """An image or an audio file, by its first bytes; anything else is refused with the formats
    (and the options of `offered` that would take it)."""
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(16)
    if not head:
        raise InputError(f"'{p}' is empty; give an image ({IMAGE_FORMATS}) or audio file")
    if (
        head.startswith(b"\x89PNG\r\n\x1a\n")
        or head.startswith(b"\xff\xd8\xff")
        or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
        or (head.startswith(b"BM") and head[6:10] == b"\x00\x00\x00\x00")  # reserved, zero
        or head[:4] in (b"II*\x00", b"MM\x00*")
    ):
        return Kind.image
    if (
        (head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE")
        or head.startswith((b"fLaC", b"OggS", b"ID3"))
        # an MP3 frame header without an ID3 tag: 11 sync bits, then MPEG version and layer 3
        or (head[0] == 0xFF and (head[1] & 0xE6) == 0xE2)
    ):
        return Kind.audio
    if p.suffix.lower() in _TENSOR_SUFFIXES:
        fix = f"pass --input-file {p}" if _has(offered, "--input-file") else "give text or files"
        raise InputError(f"'{p.name}' holds tensors, not an image or audio; {fix}")
    raise InputError(
        f"'{p}' is not a supported image ({IMAGE_FORMATS}) or audio ({AUDIO_FORMATS}) file; "
        + _fixes("convert it", offered, "--text", "pass it with --text to run its name as text")
    )


def looks_like_file(value: str) -> bool:
    """A value with a media or tensor file suffix and no spaces (or with a folder part)."""
    if Path(value).suffix.lower() not in _FILE_SUFFIXES:
        return False
    return "/" in value or os.sep in value or not any(c.isspace() for c in value)


@dataclass
class Media:
    """What to run: texts, image files and audio files, as sorted from the command line."""

    texts: list[str] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)
    audio: list[Path] = field(default_factory=list)

    @property
    def has_files(self) -> bool:
        return bool(self.images or self.audio)


def sort_inputs(
    positionals: Sequence[str],
    *,
    images: Sequence[str | os.PathLike[str]] = (),
    audio: Sequence[str | os.PathLike[str]] = (),
    texts: Sequence[str] = (),
    offered: Offered = None,
) -> Media:
    """Positional values that are existing files are images or audio by content, the rest text;
    `images`, `audio` and `texts` (--image, --audio, --text) are taken as given. A value named
    like a file (cat.jpg) that does not exist is an error, not text."""
    media = Media(list(texts), [Path(p) for p in images], [Path(p) for p in audio])
    for given, option in ((media.images, "--image"), (media.audio, "--audio")):
        for p in given:
            if not p.is_file():
                raise InputError(f"no file '{p}'; check {option}")
    for value in positionals:
        if os.path.isdir(value):
            fixes = [f"{flag} {value}" for flag in ("--images-dir", "--audio-dir")]
            fixes = [fix for fix in fixes if _has(offered, fix.split()[0])]
            if _has(offered, "--text"):
                fixes.append(f"--text '{value}' to run its name as text")
            fix = "pass " + _either(fixes) if fixes else "give the files in it one by one"
            raise InputError(f"'{value}' is a folder; {fix}")
        if os.path.isfile(value):
            kind = classify(value, offered=offered)
            (media.images if kind is Kind.image else media.audio).append(Path(value))
        elif looks_like_file(value):
            fixes = ["check the path"]
            if _has(offered, "--text"):
                fixes.append(f"pass --text '{value}' to run it as text")
            raise InputError(f"no file '{value}'; " + _either(fixes))
        else:
            media.texts.append(value)
    return media


def folder_files(
    folder: str | os.PathLike[str], kind: Kind, *, limit: int | None = None
) -> list[Path]:
    """The files of `kind` directly in `folder`, by name (others are passed over), at most
    `limit` of them; a folder with none is an error."""
    root = Path(folder)
    if not root.is_dir():
        option = "--images-dir" if kind is Kind.image else "--audio-dir"
        raise InputError(f"no folder '{root}'; check {option}")
    found = []
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        if limit is not None and len(found) >= limit:
            break
        try:
            if classify(path) is kind:
                found.append(path)
        except InputError:
            continue
    if not found:
        formats = IMAGE_FORMATS if kind is Kind.image else AUDIO_FORMATS
        raise InputError(f"no {kind.value} files ({formats}) in '{root}'; check the folder")
    return found


def inputs_from(
    model: str | os.PathLike[str],
    *items: str | os.PathLike[str],
    processor: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    max_length: int | None = None,
    chat: bool = False,
) -> Inputs:
    """Forward's tensors from files and texts, through the model's processor, for a script:
    `model(**modeltap.inputs_from("google/vit-base-patch16-224", "cat.jpg").kwargs)`.
    Existing files are images or audio by content; other strings are text."""
    media = sort_inputs([str(i) for i in items])
    where = processor or model
    loaded = load_processor(
        where, revision=None if processor else revision, trust_remote_code=trust_remote_code
    )
    return processor_inputs(loaded, media, max_length=max_length, chat=chat)


def read_image(path: Path) -> Any:
    """An RGB PIL image turned upright by its EXIF orientation, as transformers' load_image does."""
    pil = import_extra("PIL.Image", "vision")
    from PIL import ImageOps

    try:
        with pil.open(path) as opened:
            opened.load()  # decodes every byte now: a truncated file fails here, not later
            image = ImageOps.exif_transpose(opened)
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's kinds for a corrupt file
        raise InputError(f"can't read image '{path}' ({first_line(exc)}); check the file") from exc


def load_processor(
    where: str | os.PathLike[str],
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    offered: Offered = None,
) -> Any:
    """The model's processor: AutoProcessor, else its image processor, feature extractor or
    tokenizer alone, from the files next to the model (or `--processor`)."""
    import transformers

    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision:
        options["revision"] = revision
    quiet = transformers.logging.get_verbosity()
    # Without torchvision an image processor falls back to its Pillow twin with a warning per
    # load; the pipeline falls back the same way, so the numbers are the pipeline's.
    transformers.logging.set_verbosity_error()
    try:
        for auto in (
            transformers.AutoProcessor,
            transformers.AutoImageProcessor,
            transformers.AutoFeatureExtractor,
            transformers.AutoTokenizer,
        ):
            try:
                return auto.from_pretrained(str(where), **options)
            except (OSError, ValueError, TypeError, KeyError):
                continue
    finally:
        transformers.logging.set_verbosity(quiet)
    fix = (
        "pass --processor with a folder or id that has one"
        if _has(offered, "--processor")
        else "give a model whose folder has one"
    )
    raise InputError(f"no processor for '{where}' (not in the folder or the offline cache); {fix}")


@dataclass
class _Parts:
    image: Any = None
    audio: Any = None
    tokenizer: Any = None


def _parts(processor: Any) -> _Parts:
    import transformers

    if isinstance(processor, transformers.ProcessorMixin):
        return _Parts(
            getattr(processor, "image_processor", None),
            getattr(processor, "feature_extractor", None),
            getattr(processor, "tokenizer", None),
        )
    if isinstance(processor, transformers.BaseImageProcessor):
        return _Parts(image=processor)
    if isinstance(processor, transformers.SequenceFeatureExtractor):
        return _Parts(audio=processor)
    # An image processor that is not a BaseImageProcessor (some Pillow twins) still has this:
    if hasattr(processor, "preprocess") and hasattr(processor, "image_mean"):
        return _Parts(image=processor)
    return _Parts(tokenizer=processor)


def _check_parts(parts: _Parts, media: Media, name: str, offered: Offered) -> None:
    """Refuse images, audio or texts the processor has no part for."""
    for given, part, what, has in (
        (media.images, parts.image, "images", "an image processor"),
        (media.audio, parts.audio, "audio", "a feature extractor"),
    ):
        if given and part is None:
            fix = f"--processor with one that has {has}"
            fix = _fixes("give text", offered, "--processor", fix)
            raise InputError(f"the model's processor ({name}) takes no {what}; {fix}")
    if media.texts and parts.tokenizer is None:
        raise InputError(
            f"the model's processor ({name}) takes no text; give only image or audio files"
        )


def processor_inputs(
    processor: Any,
    media: Media,
    *,
    max_length: int | None = None,
    chat: bool = False,
    offered: Offered = None,
) -> Inputs:
    """Images, audio and texts through `processor` in one call, as one padded batch; `chat`
    first makes the one text and the files a user turn of the processor's chat template.
    Recordings longer than a feature extractor's window (Whisper's 30 s) are cut by it: each
    such file's entry says so (`window_s`, `seconds`, `note`)."""
    parts = _parts(processor)
    name = type(processor).__name__
    _check_parts(parts, media, name, offered)
    prompt = _chat_prompt(processor, media, offered) if chat else None
    images = [read_image(p) for p in media.images]
    rate = sampling_rate(parts.audio)
    sounds = read_recordings(media.audio, parts.audio)
    waves = [a.wave for a in sounds]
    texts = list(media.texts)
    if prompt is not None:
        media = Media([prompt], media.images, media.audio)
    text_options: dict[str, Any] = {"padding": len(media.texts) > 1}
    if max_length is not None:
        text_options.update(truncation=True, max_length=max_length)
    try:
        if media.images and not media.texts and not media.audio:
            encoded = parts.image(images=images, return_tensors="pt")
        elif media.audio and not media.texts and not media.images:
            encoded = parts.audio(
                waves, sampling_rate=rate, return_tensors="pt", **audio_padding(parts.audio, waves)
            )
        else:
            call: dict[str, Any] = {"return_tensors": "pt", **text_options}
            if media.texts:
                call["text"] = list(media.texts)
            if images:
                call["images"] = images
            if waves:
                call.update(audio=waves, sampling_rate=rate)
            encoded = processor(**call)
    except InputError:
        raise
    except Exception as exc:  # a processor raises ValueError, TypeError... for what it can't do
        message = _batch_message(exc, media, images, sounds)
        chat_template = getattr(processor, "chat_template", None)
        if not chat and media.texts and chat_template and _has(offered, "--chat"):
            message += "; or add --chat to build the prompt with its chat template"
        raise InputError(message) from exc
    kwargs = {k: v for k, v in dict(encoded).items() if hasattr(v, "shape")}
    description = _description(processor, media, texts, prompt, sounds, max_length)
    description["tensors"] = {k: list(v.shape) for k, v in kwargs.items()}
    return Inputs((), kwargs, description)


def _description(
    processor: Any,
    media: Media,
    texts: list[str],
    prompt: str | None,
    sounds: list[Audio],
    max_length: int | None,
) -> dict[str, Any]:
    """The dump's `inputs` entry for a processor's batch: the processor, texts, files."""
    description: dict[str, Any] = {
        "processor": type(processor).__name__,
        "processor_sha256": processor_hash(processor),
        "processor_settings": processor_settings(processor),
    }
    if texts:
        description["texts"] = texts
    if prompt is not None:
        description["chat_prompt"] = prompt
    files = [_file_entry(p, "image") for p in media.images]
    for p, a in zip(media.audio, sounds, strict=True):
        entry = _file_entry(p, "audio")
        if a.window_s is not None:
            entry.update(seconds=round(a.seconds, 3), window_s=a.window_s)
        files.append({**entry, **({"note": a.note} if a.note else {})})
    description["files"] = files
    if max_length is not None:
        description["max_length"] = max_length
    return description


def _chat_prompt(processor: Any, media: Media, offered: Offered = None) -> str:
    """The one text and every file as one user turn, through the chat template, with the
    generation prompt after it (as the model's chat pipeline builds it)."""
    if len(media.texts) != 1:
        raise InputError(f"--chat makes one user turn; give one TEXT (got {len(media.texts)})")
    if not getattr(processor, "chat_template", None):
        raise InputError(
            f"the model's processor ({type(processor).__name__}) has no chat template; "
            + _fixes("drop --chat", offered, "--processor", "pass --processor with one that has")
        )
    text = media.texts[0]
    content: Any = text
    if media.has_files:
        content = [{"type": "image"} for _ in media.images]
        content += [{"type": "audio"} for _ in media.audio]
        content.append({"type": "text", "text": text})
    messages = [{"role": "user", "content": content}]
    try:
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template raises what its Jinja code raises
        raise InputError(
            f"the processor's chat template failed ({first_line(exc)}); drop --chat"
        ) from exc


def _batch_message(exc: Exception, media: Media, images: list[Any], sounds: list[Audio]) -> str:
    sizes = ""
    if len(images) > 1 and len({im.size for im in images}) > 1:
        sizes = "images of sizes " + ", ".join(f"{w}x{h}" for w, h in (im.size for im in images))
    elif len(sounds) > 1 and len({len(a.wave) for a in sounds}) > 1:
        sizes = "recordings of " + ", ".join(str(len(a.wave)) for a in sounds) + " samples"
    if sizes:
        return (
            f"the processor can't batch {sizes} ({first_line(exc)}); give files of one size, "
            "or one file per run"
        )
    return f"the processor refused the inputs ({first_line(exc)}); check them against the model"


def _file_entry(path: Path, kind: str) -> dict[str, Any]:
    return {"file": path.name, "kind": kind, "sha256": _sha256(path)}


def processor_hash(processor: Any) -> str:
    """sha256 of the processor's configuration: the same settings give the same hash."""
    to_dict = getattr(processor, "to_dict", None)
    if callable(to_dict):
        try:
            config: Any = to_dict()
        except Exception:  # noqa: BLE001 - some processors can't serialise a part; fall back
            config = None
        if config is not None:
            text = json.dumps(config, sort_keys=True, default=str)
            return hashlib.sha256(text.encode()).hexdigest()
    vocab = processor.get_vocab() if hasattr(processor, "get_vocab") else {}
    text = json.dumps([type(processor).__name__, sorted(vocab.items())], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def processor_settings(processor: Any) -> dict[str, Any]:
    """The processor's settings that fit on a line (nested ones dotted: `image_processor.resample`),
    so that `diff` can say which one changed; long values (vocabularies, filters, templates) are
    left to the hash."""
    settings: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, (bool, int, float, type(None))) or (
            isinstance(value, str) and len(value) <= 80
        ):
            settings[path] = value
        elif isinstance(value, (list, tuple)) and len(value) <= 8:
            if all(isinstance(v, (bool, int, float, str, type(None))) for v in value):
                settings[path] = list(value)

    try:
        walk(processor.to_dict(), "")
    except Exception:  # noqa: BLE001 - some processors can't serialise a part: no settings
        return {}
    return settings
