"""Options that cannot apply to a run are errors before anything loads, not ignored."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.cli.app import given, refuse
from modeltap.errors import InputError

if TYPE_CHECKING:
    from modeltap.config import Settings


def refuse_unused(
    s: Settings, flags: Mapping[str, Any], *, grads: bool, allow_pickle: bool | None
) -> None:
    """`flags`: each option's command-line value, None when not given. --device with --device-map
    (a config file's device is checked with the map in `check_placement`); --max-length and
    --tokenizer without TEXT; Hub options, --dtype and --device with an archive or a factory;
    gradients or --compile with an archive; --allow-pickle with anything but a .pt2."""
    device, device_map = flags.get("device"), flags.get("device_map")
    if device is not None and device_map is not None:
        raise InputError(
            f"give --device {device.value} or --device-map {device_map.value}, not both"
        )
    if not s.texts:
        refuse(given(max_length=flags.get("max_length")), "can't apply without TEXT")
        if not (grads and s.loss == "mlm"):  # the tokenizer's mask token
            refuse(given(tokenizer=flags.get("tokenizer")), "can't apply without TEXT")
    if not s.model:
        return
    from modeltap.loading.transformed import is_transformed

    if is_transformed(s.model):
        refuse(
            given(revision=flags.get("revision"), model_class=flags.get("model_class"))
            + given(device_map=device_map),
            f"can't apply to '{s.model}', an archive or a factory (they load Hugging Face models)",
        )
        if s.dtype != "float32" or s.device != "cpu":
            raise InputError("archives and factories run on cpu in float32; drop --dtype/--device")
    from modeltap.loading.archive import is_archive_path

    if is_archive_path(s.model):  # checked again once loaded; a factory may give either
        if grads:
            raise InputError(f"gradients need the eager model; dump '{s.model}' without --grads")
        if s.compile:
            raise InputError("--compile runs an nn.Module; an archive runs as it is")
    refuse_pickle_flag(s.model, allow_pickle)


def refuse_pickle_flag(model: str, allow_pickle: bool | None) -> None:
    """--allow-pickle (or --no-allow-pickle) only means something for a .pt2."""
    from modeltap.loading.archive import PT2_SUFFIXES

    if Path(model).suffix.lower() not in PT2_SUFFIXES:
        refuse(
            given(allow_pickle=allow_pickle),
            f"can't apply to '{model}' (only a .pt2 archive is unpickled)",
        )
