"""Where models and inputs come from: `hf` (Hub id or folder), `inputs` (text, tensor files),
`processors` (images, audio), `archive` and `factory` (with `transformed`: a .pt2, a TorchScript
archive or a `pkg.module:factory` and the backend it runs on), `placement`; `resolve`, the one
resolver every command calls (settings -> model, inputs, tokenizer, backend, run metadata), and
`generator` (a model that generates, with its tokenizer).

Each module is imported when one of its names is first used: the CLI's option declarations need the
`hf` enums, not the input readers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap._lazy import lazy_names

if TYPE_CHECKING:
    from modeltap.loading.hf import (
        Device,
        DType,
        Loaded,
        ModelSource,
        load_meta_model,
        load_model,
        load_tokenizer,
        looks_like_path,
        model_class,
        pick_device,
        resolve_model,
    )
    from modeltap.loading.inputs import (
        Inputs,
        add_decoder_inputs,
        check_forward_names,
        check_length,
        check_paired_inputs,
        file_inputs,
        text_inputs,
    )

_HOMES = {
    **dict.fromkeys(
        [
            "DType",
            "Device",
            "Loaded",
            "ModelSource",
            "load_meta_model",
            "load_model",
            "load_tokenizer",
            "looks_like_path",
            "model_class",
            "pick_device",
            "resolve_model",
        ],
        "hf",
    ),
    **dict.fromkeys(
        [
            "Inputs",
            "add_decoder_inputs",
            "check_forward_names",
            "check_length",
            "check_paired_inputs",
            "file_inputs",
            "text_inputs",
        ],
        "inputs",
    ),
}


__getattr__ = lazy_names(__name__, _HOMES)


# _HOMES declares the names; the imports under TYPE_CHECKING repeat them for type checkers
# (tests/test_architecture.py checks that they match).
__all__ = sorted(_HOMES)
