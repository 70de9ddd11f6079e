"""Where models and inputs come from: `hf` (Hub id or folder), `inputs` (text, tensor files)."""

from __future__ import annotations

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
    file_inputs,
    text_inputs,
)

__all__ = [
    "DType",
    "Device",
    "Inputs",
    "Loaded",
    "ModelSource",
    "add_decoder_inputs",
    "check_forward_names",
    "check_length",
    "file_inputs",
    "load_meta_model",
    "load_model",
    "load_tokenizer",
    "looks_like_path",
    "model_class",
    "pick_device",
    "resolve_model",
    "text_inputs",
]
