"""The one resolver every command calls: settings -> the loaded model, its inputs (text through the
tokenizer, files through the processor, tensor files, an archive's example), the tokenizer, and the
backend an archive or a graph runs on; with the run's placement check and metadata.

Notes for the user (a model loaded with weights missing, audio beyond the extractor's window) go
through `note`, a function the caller gives (the CLI prints them on stderr); `offered` is the set of
flags the calling command has, so that a hint names only options it takes (None: all of them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError
from modeltap.loading.transformed import is_transformed, load_transformed

if TYPE_CHECKING:
    from modeltap.config import Settings
    from modeltap.loading.hf import Loaded
    from modeltap.loading.inputs import Inputs

Note = Callable[[str], None]
# what shows a long step on the way (the CLI's spinner on stderr): status("loading x") -> a context
Status = Callable[[str], AbstractContextManager[Any]]


def no_status(_: str) -> AbstractContextManager[Any]:
    """A `Status` that shows nothing."""
    return contextlib.nullcontext()


@dataclass
class Resolved:
    """A command's model and inputs, ready to run: `inputs` on the model's device and dtype;
    `backend` set for an archive or a graph module (None: the eager nn.Module)."""

    loaded: Loaded
    inputs: Inputs
    tokenizer: Any = None
    backend: Any = None


def resolve(
    s: Settings,
    *,
    command: str = "modeltap dump",
    allow_pickle: bool = False,
    need_tokenizer: bool = False,
    prepared: Inputs | None = None,
    offered: frozenset[str] | None = None,
    note: Note | None = None,
) -> Resolved:
    """Load `s.model` (a Hub id or folder, an archive or a factory) and its inputs from `s`.
    `prepared`: inputs already read (see `prepare_inputs`); `command` names the command in
    messages."""
    if is_transformed(s.model or ""):
        return _resolve_transformed(s, allow_pickle=allow_pickle, offered=offered, note=note)
    return _resolve_loaded(
        s,
        command=command,
        need_tokenizer=need_tokenizer,
        prepared=prepared,
        offered=offered,
        note=note,
    )


def prepare_inputs(
    s: Settings, *, offered: frozenset[str] | None = None, note: Note | None = None
) -> Inputs | None:
    """What can be checked without the weights is checked first, not after seconds of loading:
    the input file (read now, returned), and the selection globs against the module tree built
    on the meta device."""
    from modeltap.loading import file_inputs, load_meta_model
    from modeltap.selection import Selection, select_modules

    if s.input_file:
        inputs_ = file_inputs(s.input_file)
    else:
        inputs_ = processed_inputs(s, offered=offered, note=note)
    if s.include or s.exclude or s.depth is not None:
        try:
            meta_model, _ = load_meta_model(
                s.model or "",
                revision=s.revision,
                model_class_name=s.model_class,
                trust_remote_code=s.trust_remote_code,
            )
        except Exception:  # noqa: BLE001 - the real load reports what is wrong with the model
            return inputs_
        select_modules(meta_model, Selection(s.depth, tuple(s.include), tuple(s.exclude)))
    return inputs_


def processed_inputs(
    s: Settings,
    where: str | None = None,
    *,
    offered: frozenset[str] | None = None,
    note: Note | None = None,
) -> Inputs | None:
    """Images and audio (with any texts) through the model's processor, or None without files,
    --processor or --chat: a bad file or a processor that can't take them is found before the
    weights load."""
    if not (s.images or s.audio or s.processor or s.chat):
        return None
    from modeltap.loading.processors import Media, load_processor, processor_inputs

    processor = load_processor(
        s.processor or where or s.model or "",
        revision=None if s.processor else s.revision,
        trust_remote_code=s.trust_remote_code,
        offered=offered,
    )
    media = Media(list(s.texts), [Path(p) for p in s.images], [Path(p) for p in s.audio])
    inputs_ = processor_inputs(
        processor, media, max_length=s.max_length, chat=s.chat, offered=offered
    )
    for entry in inputs_.description.get("files", []):
        if "window_s" in entry and note is not None:
            note(
                f"note: {entry['file']} is {entry['seconds']:g} s long and the feature "
                f"extractor takes its first {entry['window_s']:g} s only (its window; recorded "
                "in the dump's inputs)"
            )
    return inputs_


def check_placement(s: Settings) -> Any:
    """Placement options checked together, before any work (load_model checks them again): the
    accelerate placement they ask for, or None."""
    from modeltap.loading.placement import placement

    if s.device_map and s.device != "cpu":
        raise InputError(f"give --device {s.device} or --device-map {s.device_map}, not both")
    return placement(s.device_map, s.max_memory, s.offload_folder)


def missing_weights_note(loaded: Any) -> str | None:
    """The line saying that a model loaded with --allow-missing-weights lacked some, or None."""
    missing = getattr(loaded, "missing_weights", None)
    if not missing:
        return None
    from modeltap.loading.hf import describe_names

    return (
        f"note: {loaded.source.name} has no weights for {len(missing)} parameter(s) "
        f"of {loaded.model_class} ({describe_names(missing)}): they run randomly "
        "initialised (--allow-missing-weights; listed as missing_weights in the metadata)"
    )


def run_metadata(s: Settings, loaded: Any) -> dict[str, str]:
    """The run's model entries of a dump's metadata: model, dtype, device, placement, revision,
    missing weights."""
    import json

    meta = {"model": s.model or "", "dtype": loaded.dtype, "device": loaded.device}
    if loaded.device_map is not None:
        meta["device_map"] = json.dumps({k: str(v) for k, v in loaded.device_map.items()})
    if loaded.source.revision:
        meta["revision"] = loaded.source.revision
    if getattr(loaded, "missing_weights", None):
        meta["missing_weights"] = json.dumps(loaded.missing_weights)
    return meta


def load_hf(s: Settings, *, model: str | None = None, note: Note | None = None, **kw: Any) -> Any:
    """`load_model` of `model` (default `s.model`) with the loading settings of `s`, saying
    through `note` when weights are missing; `kw` overrides (model_class_name...)."""
    from modeltap.loading import load_model

    options: dict[str, Any] = {
        "revision": s.revision,
        "model_class_name": s.model_class,
        "dtype": s.dtype,
        "device": s.device,
        "trust_remote_code": s.trust_remote_code,
        "device_map": s.device_map,
        "max_memory": s.max_memory,
        "offload_folder": s.offload_folder,
        "allow_missing_weights": s.allow_missing_weights,
    }
    loaded = load_model(model if model is not None else s.model or "", **{**options, **kw})
    said = missing_weights_note(loaded)
    if said and note is not None:
        note(said)
    return loaded


def _resolve_loaded(
    s: Settings,
    *,
    command: str,
    need_tokenizer: bool,
    prepared: Inputs | None,
    offered: frozenset[str] | None,
    note: Note | None,
) -> Resolved:
    import torch

    from modeltap.loading import (
        add_decoder_inputs,
        check_length,
        check_paired_inputs,
        file_inputs,
        load_tokenizer,
        text_inputs,
    )

    loaded = load_hf(s, note=note)
    if prepared is None and not s.input_file:
        prepared = processed_inputs(s, str(loaded.source.path), offered=offered, note=note)
    tok = None
    if (s.texts and prepared is None) or need_tokenizer:
        where = s.tokenizer or loaded.source.path
        tok = load_tokenizer(where, trust_remote_code=s.trust_remote_code)
    if prepared is not None:
        inputs_ = prepared
    elif s.texts:
        inputs_ = text_inputs(tok, s.texts, max_length=s.max_length)
    else:
        inputs_ = file_inputs(s.input_file or "")
    check_length(loaded.model, inputs_)
    check_paired_inputs(loaded.model, inputs_, command=command)
    inputs_ = add_decoder_inputs(loaded.model, inputs_)
    return Resolved(loaded, inputs_.to(loaded.device, getattr(torch, loaded.dtype)), tok)


def _resolve_transformed(
    s: Settings, *, allow_pickle: bool, offered: frozenset[str] | None, note: Note | None
) -> Resolved:
    """An archive or a factory, with the inputs given or the example it carries."""
    import torch

    from modeltap.loading import file_inputs, load_tokenizer, text_inputs

    model_name = s.model or ""
    loaded, example, backend = load_transformed(model_name, allow_pickle=allow_pickle)
    tok = None
    if s.images or s.audio:
        if not s.processor:
            raise InputError(
                f"'{model_name}' holds no processor for images or audio; pass --processor "
                "(e.g. the model's folder) or give tensors with --input-file"
            )
        inputs_ = processed_inputs(s, offered=offered, note=note)
    elif s.texts:
        if not s.tokenizer:
            raise InputError(
                f"'{model_name}' holds no tokenizer; pass --tokenizer (e.g. the model's folder) "
                "or give tensors with --input-file"
            )
        tok = load_tokenizer(s.tokenizer, trust_remote_code=s.trust_remote_code)
        inputs_ = text_inputs(tok, s.texts, max_length=s.max_length)
    elif s.input_file:
        inputs_ = file_inputs(s.input_file)
    elif example is not None:
        inputs_ = example
    else:
        raise InputError(f"'{model_name}' has no example inputs; give TEXT or --input-file")
    if s.dtype != "float32" or s.device != "cpu":
        raise InputError("archives and factories run on cpu in float32; drop --dtype/--device")
    assert inputs_ is not None  # floats in the model's dtype (a factory's may be bfloat16)
    return Resolved(loaded, inputs_.to("cpu", getattr(torch, loaded.dtype)), tok, backend)
