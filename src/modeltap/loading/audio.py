"""Recordings read for a feature extractor: mono float32 at its rate, checked against their
headers (a truncated file is refused), resampled with torchaudio's windowed sinc, and cut to the
extractor's window where it would cut them. soundfile (`modeltap[audio]`) is imported only when a
recording is read.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, first_line

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Audio:
    """One recording as mono float32 at the processor's rate, and what was done to get there."""

    wave: np.ndarray
    rate: int
    note: str | None = None
    # A recording longer than the feature extractor's window: its length, and the window kept.
    seconds: float = 0.0
    window_s: float | None = None


def read_audio(path: Path, rate: int) -> Audio:
    """Mono float32 samples at `rate`: channels averaged, other rates resampled (with a note).
    A file holding fewer frames than its header says (cut off in a copy or a download) is
    refused: libsndfile reads what is there without a word."""
    sf = import_extra("soundfile", "audio")
    try:
        with _quiet_stderr():  # mpg123 prints its own warnings about a damaged MP3
            declared = sf.info(str(path)).frames
            data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError (a RuntimeError) or others
        raise InputError(f"can't read audio '{path}' ({first_line(exc)}); check the file") from exc
    if data.shape[0] == 0:
        raise InputError(f"audio '{path}' has no samples; give a recording that is not empty")
    declared, slack = _declared_frames(path, declared)
    if declared is not None and data.shape[0] < declared - slack:
        raise InputError(
            f"audio '{path}' is truncated: its header says {declared} frames and it holds "
            f"{data.shape[0]}; give the whole file"
        )
    wave = data.mean(axis=1, dtype="float32") if data.shape[1] > 1 else data[:, 0]
    notes = []
    if data.shape[1] > 1:
        notes.append(f"{data.shape[1]} channels mixed down to mono")
    if file_rate != rate:
        wave = resample(wave, file_rate, rate)
        notes.append(f"resampled from {file_rate} Hz to {rate} Hz")
    return Audio(wave, rate, "; ".join(notes) or None)


def _declared_frames(path: Path, libsndfile_frames: int) -> tuple[int | None, int]:
    """(frames the file's header promises, how many fewer may be read) for the formats that
    say: a WAV's data chunk size (libsndfile reports what is there instead), FLAC's STREAMINFO
    total, and an MP3's Xing, Info or VBRI count (libsndfile's `frames`, with two MP3 frames of
    slack for encoder delay and padding; without such a header the count is only estimated
    from the size). None where the header holds no count."""
    with open(path, "rb") as f:
        head = f.read(12)
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            return _wav_frames(f), 0
        if head.startswith(b"fLaC"):
            return libsndfile_frames or None, 0
        if _has_frame_count(f, head):
            return libsndfile_frames or None, 2 * 1152
    return None, 0


def _has_frame_count(f: Any, head: bytes) -> bool:
    """An MP3 whose first frame is a Xing, Info or VBRI header (after any ID3v2 tag)."""
    start = 0
    if head.startswith(b"ID3") and len(head) >= 10:
        size = (head[6] & 0x7F) << 21 | (head[7] & 0x7F) << 14 | (head[8] & 0x7F) << 7
        start = 10 + (size | (head[9] & 0x7F)) + (10 if head[5] & 0x10 else 0)
    f.seek(start)
    frame = f.read(200)
    if len(frame) < 4 or frame[0] != 0xFF or (frame[1] & 0xE6) != 0xE2:
        return False
    return any(tag in frame for tag in (b"Xing", b"Info", b"VBRI"))


def _wav_frames(f: Any) -> int | None:
    """The frame count of a RIFF WAVE's data chunk size, read after the 12-byte RIFF header;
    None for a streaming writer's placeholder size (0 or 0xFFFFFFFF)."""
    import struct

    block_align = None
    while True:
        chunk = f.read(8)
        if len(chunk) < 8:
            return None
        name, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
        if name == b"fmt ":
            fmt = f.read(size + (size & 1))
            if len(fmt) < 14:
                return None
            block_align = struct.unpack("<H", fmt[12:14])[0]
            continue
        if name == b"data":
            if block_align in (None, 0) or size in (0, 0xFFFFFFFF):
                return None
            return size // block_align
        f.seek(size + (size & 1), os.SEEK_CUR)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: C libraries write their warnings there directly."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def resample(wave: np.ndarray, orig: int, new: int) -> np.ndarray:
    """Windowed-sinc resampling, the same numbers as torchaudio.functional.resample's defaults
    (Hann window, 6 zero crossings, rolloff 0.99), which the audio pipelines use."""
    import numpy as np
    import torch

    gcd = math.gcd(int(orig), int(new))
    orig, new = int(orig) // gcd, int(new) // gcd
    width_zeros, rolloff = 6, 0.99
    base = min(orig, new) * rolloff
    width = math.ceil(width_zeros * orig / base)
    x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
    idx = torch.arange(-width, width + orig, dtype=x.dtype)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=x.dtype)[:, None, None] / new + idx
    t *= base
    t = t.clamp_(-width_zeros, width_zeros)
    window = torch.cos(t * math.pi / width_zeros / 2) ** 2
    t *= math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernel *= window * (base / orig)
    padded = torch.nn.functional.pad(x[None], (width, width + orig))
    out = torch.nn.functional.conv1d(padded[:, None], kernel, stride=orig)
    out = out.transpose(1, 2).reshape(1, -1)[0]
    return out[: math.ceil(new * x.shape[0] / orig)].numpy()


def read_recordings(paths: Sequence[Path], extractor: Any) -> list[Audio]:
    """Each file through `read_audio` at the feature extractor's rate (16 kHz without one); a
    recording longer than the extractor's window says it was cut (`seconds`, `window_s`, note)."""
    rate = sampling_rate(extractor)
    sounds = [read_audio(p, rate) for p in paths]
    kept = window(extractor)
    for sound in sounds:
        if kept is not None and len(sound.wave) > kept:
            sound.seconds, sound.window_s = len(sound.wave) / rate, kept / rate
            cut = f"cut to the feature extractor's {sound.window_s:g} s window"
            sound.note = f"{sound.note}; {cut}" if sound.note else cut
    return sounds


def sampling_rate(extractor: Any) -> int:
    """The rate a feature extractor takes recordings at; 16 kHz without one."""
    return int(getattr(extractor, "sampling_rate", 0) or 16000)


def window(extractor: Any) -> int | None:
    """Samples a feature extractor keeps of a longer recording: Whisper's `n_samples` (30 s),
    where its call truncates by default; None for extractors that take any length."""
    window = getattr(extractor, "n_samples", None)
    if not isinstance(window, int) or window <= 0:
        return None
    try:
        truncates = inspect.signature(extractor.__call__).parameters["truncation"].default
    except (KeyError, TypeError, ValueError):
        return None
    return window if truncates is True else None


def audio_padding(extractor: Any, waves: list[Any]) -> dict[str, Any]:
    """Recordings of different lengths pad to the longest where the extractor would not pad
    (Wav2Vec2's default); Whisper's own default pads every one to 30 s and is kept."""
    if len({len(w) for w in waves}) < 2:
        return {}
    try:
        default = inspect.signature(extractor.__call__).parameters["padding"].default
    except (KeyError, TypeError, ValueError):
        return {}
    return {"padding": True} if default in (False, "do_not_pad") else {}


def import_extra(module: str, extra: str) -> Any:
    """`module`, or an InputError naming the pip extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = {"vision": "Pillow", "audio": "soundfile"}[extra]
        raise InputError(
            f"reading {'images' if extra == 'vision' else 'audio'} needs {package}; "
            f"pip install 'modeltap[{extra}]'"
        ) from exc
