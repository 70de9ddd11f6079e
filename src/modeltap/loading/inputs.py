"""Inputs: sentences through a tokenizer, or tensors from a file; checked against forward."""

from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class Inputs:
    """Arguments for forward, and how to describe them in a dump's metadata."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    description: dict[str, Any]

    @property
    def attention_mask(self) -> torch.Tensor | None:
        mask = self.kwargs.get("attention_mask")
        return mask if mask is not None and mask.dim() == 2 else None

    def to(self, device: str, float_dtype: torch.dtype) -> Inputs:
        def move(t: Any) -> Any:
            if not hasattr(t, "to"):
                return t
            return t.to(device, float_dtype) if t.is_floating_point() else t.to(device)

        args = tuple(move(a) for a in self.args)
        kwargs = {k: move(v) for k, v in self.kwargs.items()}
        return Inputs(args, kwargs, self.description)


def text_inputs(tokenizer: Any, texts: list[str], *, max_length: int | None = None) -> Inputs:
    """Sentences as one padded batch with attention mask; `max_length` truncates each one."""
    notes = {}
    if getattr(tokenizer, "pad_token", None) is None and len(texts) > 1:
        if getattr(tokenizer, "eos_token", None) is None:
            raise InputError("the tokenizer has no pad token to batch several texts; give one text")
        tokenizer.pad_token = tokenizer.eos_token
        notes["pad_token"] = "eos_token"
    # One text needs no padding, and a tokenizer without a pad token (GPT-2) refuses to pad.
    options: dict[str, Any] = {"padding": len(texts) > 1}
    if max_length is not None:
        options.update(truncation=True, max_length=max_length)
        notes["max_length"] = max_length
    # verbose=False: transformers' own "sequence length is longer than..." warning would come
    # before check_length's one-line error that names the fix.
    encoded = tokenizer(list(texts), return_tensors="pt", verbose=False, **options)
    kwargs = dict(encoded)
    description: dict[str, Any] = {"texts": list(texts), **notes}
    description["tensors"] = {k: list(v.shape) for k, v in kwargs.items()}
    return Inputs((), kwargs, description)


def file_inputs(path: str | os.PathLike[str]) -> Inputs:
    """Tensors from .safetensors, .npy/.npz or .pt (weights_only): named ones become keywords."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise InputError(f"no input file '{p}'; check --input-file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded: Any = load_file(str(p))
        elif suffix in (".npy", ".npz"):
            import numpy as np

            raw = np.load(p, allow_pickle=False)
            if suffix == ".npy":
                loaded = torch.from_numpy(np.ascontiguousarray(raw))
            else:
                loaded = {k: torch.from_numpy(np.ascontiguousarray(raw[k])) for k in raw.files}
        elif suffix in (".pt", ".pth"):
            loaded = torch.load(p, map_location="cpu", weights_only=True)
        else:
            raise InputError(
                f"input file '{p.name}' has an unknown type; use .safetensors, .npy, .npz or .pt"
            )
    except InputError:
        raise
    except Exception as exc:  # each reader raises its own kinds for a corrupt file
        if _needs_pickle(exc):
            # The reader's own hint (weights_only=False, allow_pickle=True) names options modeltap
            # does not have, and running a file's code is not something it will do.
            raise InputError(
                f"input file '{p.name}' holds Python objects, not just tensors, and modeltap "
                "never unpickles them; save the inputs with safetensors.torch.save_file (or "
                "torch.save of a tensor or a dict of tensors) and pass that file"
            ) from exc
        raise InputError(f"can't read input file '{p}' ({first_line(exc)}); check it") from exc
    description: dict[str, Any] = {"file": p.name, "sha256": _sha256(p)}
    if isinstance(loaded, torch.Tensor):
        description["tensors"] = {"0": list(loaded.shape)}
        return Inputs((loaded,), {}, description)
    if (
        isinstance(loaded, dict)
        and loaded
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items())
    ):
        description["tensors"] = {k: list(v.shape) for k, v in loaded.items()}
        return Inputs((), dict(loaded), description)
    raise InputError(f"input file '{p.name}' must hold one tensor or a mapping of names to tensors")


def _needs_pickle(exc: BaseException) -> bool:
    import pickle

    text = str(exc)
    return (
        isinstance(exc, pickle.UnpicklingError)
        or "allow_pickle" in text
        or ("weights_only" in text)
    )


def check_length(model: nn.Module, inputs: Inputs) -> None:
    """Token ids beyond the model's positions fail deep inside it with a shape error: say so.

    A limit below 1 is no limit: XLNet's config answers -1, as models with relative or rotary
    positions may."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    ids = inputs.kwargs.get("input_ids")
    if not isinstance(limit, int) or limit < 1:
        return
    if ids is None or ids.dim() != 2 or ids.shape[1] <= limit:
        return
    raise InputError(
        f"{type(model).__name__} takes at most {limit} tokens and the input has {ids.shape[1]}; "
        f"shorten it, or pass --max-length {limit} to truncate"
    )


def check_forward_names(model: nn.Module, inputs: Inputs) -> None:
    """Named inputs must be arguments of forward: say which ones are, before running anything."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        unknown = [k for k in inputs.kwargs if k not in params]
        # **kwargs swallows anything, but a name close to a real argument is almost surely a typo.
        from modeltap.selection import suggest

        for name in unknown:
            guess = suggest(name, accepted)
            if guess:
                raise InputError(
                    f"input '{name}' is not an argument of {type(model).__name__}.forward; "
                    f"did you mean '{guess}'?"
                )
        return
    unknown = [k for k in inputs.kwargs if k not in params]
    if unknown:
        names = ", ".join(n for n in params if n != "self")
        raise InputError(
            f"input '{unknown[0]}' is not an argument of {type(model).__name__}.forward; "
            f"rename it to one of: {names}"
        )


# A contrastive dual encoder (CLIP, SigLIP, CLAP, X-CLIP...) scores text against an image, a
# recording or a video in its forward, whose output says so with `logits_per_<kind>`: it needs
# both inputs, while a vision-language model that merely accepts pixel_values does not.
_PAIRED = {
    "logits_per_image": ("pixel_values", "an image"),
    "logits_per_audio": ("input_features", "audio"),
    "logits_per_video": ("pixel_values", "a video"),
}


def check_paired_inputs(
    model: nn.Module, inputs: Inputs, *, command: str = "modeltap dump"
) -> None:
    """A model whose forward compares text with an image (or audio) needs both: say which is
    missing before the forward fails inside a tower on None."""
    paired = _paired_input(model)
    if paired is None:
        return
    other, kind = paired
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return
    given = set(inputs.kwargs) | set(names[: len(inputs.args)])
    if other not in names or "input_ids" not in names:
        return
    cls = type(model).__name__
    tower = _tower_class(cls, "Text" if "input_ids" in given else kind)
    alone = f", or --model-class {tower} for that tower alone" if tower else ""
    example = f'{command} MODEL {"speech.wav" if kind == "audio" else "cat.jpg"} "a cat"'
    if "input_ids" not in given:
        raise InputError(
            f"{cls} compares text with {kind} in its forward and got no text; give a TEXT "
            f"beside the file (`{example}`){alone}"
        )
    if other not in given:
        raise InputError(
            f"{cls} compares text with {kind} in its forward and got only text; give "
            f"{kind} FILE beside the TEXT (`{example}`){alone}"
        )


def _paired_input(model: nn.Module) -> tuple[str, str] | None:
    """(the other input, its kind) for a forward that returns `logits_per_<kind>`."""
    import dataclasses
    import typing

    try:
        returned = inspect.signature(type(model).forward).return_annotation
    except (TypeError, ValueError):
        return None
    for candidate in (returned, *typing.get_args(returned)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            fields = {f.name for f in dataclasses.fields(candidate)}
            for field_name, paired in _PAIRED.items():
                if field_name in fields:
                    return paired
    return None


def _tower_class(cls: str, kind: str) -> str | None:
    """CLIPModel -> CLIPTextModel / CLIPVisionModel, where transformers has that class."""
    import transformers

    if not cls.endswith("Model"):
        return None
    part = {"Text": "Text", "an image": "Vision", "audio": "Audio", "a video": "Vision"}[kind]
    name = f"{cls[: -len('Model')]}{part}Model"
    return name if hasattr(transformers, name) else None


def add_decoder_inputs(model: nn.Module, inputs: Inputs) -> Inputs:
    """Models whose forward takes `decoder_input_ids` get the decoder start token if none given.

    The forward's signature decides, not `config.is_encoder_decoder`: DETR and other models that
    decode from learned queries are encoder-decoders with no decoder token ids to give.
    """
    import torch

    config = getattr(model, "config", None)
    if config is None or not _takes_decoder_ids(model, config):
        return inputs
    if any(k.startswith("decoder_") and "input" in k for k in inputs.kwargs):
        return inputs
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(config, "decoder", None), "bos_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None)
    if start is None:
        raise InputError(
            f"{type(model).__name__} needs decoder inputs and its config has no "
            "decoder_start_token_id; give decoder_input_ids in --input-file"
        )
    batch = _batch_size(inputs)
    kwargs = dict(inputs.kwargs)
    kwargs["decoder_input_ids"] = torch.full((batch, 1), int(start), dtype=torch.long)
    description = dict(inputs.description, decoder_input_ids=f"decoder start token {start}")
    return Inputs(inputs.args, kwargs, description)


def _takes_decoder_ids(model: nn.Module, config: Any) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no readable signature: trust the config
        return bool(getattr(config, "is_encoder_decoder", False))
    return "decoder_input_ids" in params


def _batch_size(inputs: Inputs) -> int:
    for value in (*inputs.args, *inputs.kwargs.values()):
        if hasattr(value, "shape") and len(value.shape):
            return int(value.shape[0])
    return 1


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
