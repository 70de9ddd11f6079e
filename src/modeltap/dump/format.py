"""The dump format: keys, metadata schema, version, dtype codes and the header check.

Layout: the usual safetensors header (8-byte little-endian length, JSON), then the tensor bytes.
The writer reserves header space up front, padded with spaces as the format allows, and appends each
distinct tensor as its module returns, so memory does not grow with the number of captured layers.
If the final header does not fit the reservation, or would leave it mostly padding, the data is
moved once behind a header of its own size (dump/writer.py). Either way the layout is plain
safetensors (padding is trailing spaces in the JSON), so the format version stays.

Metadata (`__metadata__`, all values strings, JSON where structured): see METADATA_KEYS and
docs/reference/dump-format.md.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path
from typing import Any

FORMAT = "modeltap"
FORMAT_VERSION = 1
GRAD_PREFIX = "grad/"
# The tensors a processor made from images or audio, as the model received them (full dumps only).
INPUTS_PREFIX = "inputs/"

# Every metadata key the writer may set; values are strings, JSON-encoded when marked.
METADATA_KEYS = {
    "format": "always 'modeltap'",
    "format_version": "integer, bumped on incompatible changes",
    "kind": "'activations', 'gradients' or both joined by '+'; 'generation'",
    "modeltap_version": "version that wrote the file",
    "model": "model id or path as given",
    "revision": "resolved commit hash of a Hub model, when known",
    "model_class": "class that loaded the model, e.g. BertModel",
    "missing_weights": "JSON list, with --allow-missing-weights: parameters the checkpoint had no "
    "weights for (randomly initialised)",
    "inputs": "JSON: texts, or input file name and sha256, and the input tensors' shapes; "
    "with images/audio: processor class, processor_sha256 and each file's name, kind, sha256",
    "dtype": "model dtype",
    "device": "device the model ran on",
    "torch": "torch version",
    "transformers": "transformers version",
    "seed": "seed set before the forward",
    "train_mode": "'true' when dropout etc. were active",
    "selection": "JSON: depth, include, exclude, inputs",
    "order": "JSON list: every key (aliases too) in the order the model produced it",
    "ops": "JSON object, with --ops: op key -> op (torch function, or a graph node's target), "
    "aten (the aten ops it ran), source (file:line), inputs ([shape, dtype] each), view, inplace; "
    "node (a graph node's name)",
    "aliases": "JSON object: alias key -> key of the stored tensor",
    "skipped": "JSON object: key -> type name of outputs that are not tensors (None is counted)",
    "skipped_none": "number of None outputs",
    "stats": "JSON object: stored key -> statistics (see stats.TensorStats)",
    "formats": "JSON list, with --formats: the formats each float tensor's statistics hold "
    "'formats' figures of (rel_rmse, sqnr_db, underflow, clipped)",
    "stats_only": "'true' when no tensor data was written",
    "dead_threshold": "threshold used for dead units",
    "grad": "JSON, with gradients: target, loss, grad_output, seed, wrt, no_path, jacobian...",
    # Written by modeltap.record, one file per recorded step and rank:
    "step": "training step the file records",
    "rank": "torch.distributed rank that wrote it (0 without a process group)",
    "world_size": "number of ranks (1 without a process group)",
    "dist_backend": "process group backend (gloo, nccl...) or 'none'",
    "record": "JSON: every, full_every, grads, params, gather, on_nonfinite, not_run",
    "placements": "JSON: key -> placements, global_shape, mesh, local_shape of a sharded tensor",
    "updates": "JSON: parameter -> ||w_after - w_before|| / ||w_before|| of the step",
    "rules": "JSON list of rule hits: rule, step, rank, key, value, message",
    "tripwire": "JSON: where the first non-finite value came from (step, phase, module...)",
    "devices": "JSON object: stored key -> device the tensor came from (cpu, cuda:0, ...)",
    "device_map": "JSON object, with --device-map: module -> device accelerate placed it on",
    "backend": "how the model ran: eager, compile, export, torchscript or fx",
    "backend_details": "JSON: the backend's details (compile: backend, graphs, graph_breaks...)",
    "unmapped": "JSON list: selected modules that produced no value (never called, or unmappable)",
    # Written by modeltap generate (kind 'generation'; keys gen/step{k}/...):
    "generate": "JSON: prompt, prompt_ids, decoder_prompt_ids (an encoder-decoder), new_ids, "
    "text, steps (token, p, runner-up), stop, forwards, unstored_forwards, full_steps, plan, kv, "
    "forced, decoding, generation_config",
}

_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}

_ALIGN = 8


@functools.cache
def _torch_dtype(code: str) -> Any:
    """safetensors dtype code -> torch dtype (None if unknown)."""
    import torch

    name = next((n for n, c in _DTYPES.items() if c == code), None)
    return getattr(torch, name, None) if name else None


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# safetensors dtype code -> the numpy dtype its bytes are read as (bfloat16: as uint16, widened).
_NUMPY = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "uint16"}
_NUMPY |= {"I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8"}
_NUMPY |= {"U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}

# Bytes per element of each safetensors dtype code modeltap writes (others are not size-checked).
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
_ITEMSIZE |= {"U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_ITEMSIZE |= {"C64": 8}


def _checked_header(path: Path) -> tuple[dict[str, str], list[str]]:
    """(metadata, tensor names sorted) of a safetensors file, checked as safetensors checks it:
    a JSON header that fits, and tensors that tile the data exactly. ValueError if not."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("file shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"header length {n} runs past the end of the file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a map of strings")
    spans = []
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            shape, code = info["shape"], info["dtype"]
            numel = math.prod(shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad entry for tensor '{name}'") from exc
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise ValueError(f"bad data offsets for tensor '{name}'")
        if code in _ITEMSIZE and numel * _ITEMSIZE[code] != end - begin:
            raise ValueError(f"tensor '{name}' has {end - begin} bytes for its shape and dtype")
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise ValueError("tensor data overlaps or leaves gaps")
        position = end
    if position != size - 8 - n:
        raise ValueError(f"{size - 8 - n} data bytes where the header describes {position}")
    return metadata, sorted(header)


def _read_header(path: Path) -> tuple[int, dict[str, Any]] | None:
    """(data start, tensor entries) of a safetensors file that safe_open already validated."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return None
        (size,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


