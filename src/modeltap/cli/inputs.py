"""The command being run, as the library's messages need it (its name, the flags it has), and the
positional values of a command sorted into texts, images and audio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modeltap.errors import InputError


def _current_context() -> Any:
    """The click context of the command being run, or None outside one."""
    try:  # typer 0.2x runs on its own copy of click
        from typer._click.globals import get_current_context
    except ImportError:
        from click import get_current_context
    return get_current_context(silent=True)


def command_name() -> str:
    """The command being run (dump, grads, compare...), for messages that show one."""
    ctx = _current_context()
    return (ctx.info_name if ctx is not None else None) or "dump"


def offered_flags() -> frozenset[str] | None:
    """Every flag of the command being run, so that a hint names only options it has; None
    outside a command (every hint)."""
    ctx = _current_context()
    if ctx is None:
        return None
    return frozenset(
        opt
        for param in ctx.command.params
        if param.param_type_name == "option"
        for opt in (*param.opts, *param.secondary_opts)
    )


def sorted_inputs(
    positionals: list[str] | None,
    images: list[Path] | None,
    audio: list[Path] | None,
    texts: list[str] | None,
    images_dir: Path | None = None,
    audio_dir: Path | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """Positional values sorted into texts, images and audio (files by content), with the files
    of --images-dir / --audio-dir, for settings(); nothing given stays unset, so a config file's
    `texts` still applies."""
    from modeltap.loading.processors import Kind, folder_files, sort_inputs

    if limit is not None and images_dir is None and audio_dir is None:
        raise InputError(
            "--batch/--limit counts the files of --images-dir or --audio-dir; give one"
        )
    media = sort_inputs(
        positionals or [],
        images=images or [],
        audio=audio or [],
        texts=texts or [],
        offered=offered_flags(),
    )
    if images_dir is not None:
        media.images += folder_files(images_dir, Kind.image, limit=limit)
    if audio_dir is not None:
        media.audio += folder_files(audio_dir, Kind.audio, limit=limit)
    return {
        "texts": media.texts or None,
        "images": [str(p) for p in media.images] or None,
        "audio": [str(p) for p in media.audio] or None,
    }
