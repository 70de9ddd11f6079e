"""Models and tokenizers by Hugging Face id or local folder (the standard HF cache)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, MissingWeightsError, first_line

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import nn

    from modeltap.loading.placement import DeviceMap, Placement

# Weights of other frameworks and exports that a PyTorch run never reads.
_IGNORE_PATTERNS = [
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.onnx",
    "*.onnx_data",
    "*.tflite",
    "*.mlmodel",
    "*.gguf",
    "onnx/*",
    "openvino/*",
    "coreml/*",
    "tf_model*",
    "flax_model*",
    "rust_model*",
]


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    auto = "auto"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: the folder, and for a Hub id the id and resolved commit."""

    name: str
    path: Path
    revision: str | None = None


@dataclass
class Loaded:
    model: nn.Module
    source: ModelSource
    tokenizer: Any = None
    dtype: str = "float32"
    device: str = "cpu"
    model_class: str = ""
    notes: list[str] = field(default_factory=list)
    # Where accelerate put each module (transformers' `hf_device_map`), for a placed model.
    device_map: dict[str, int | str] | None = None
    # Parameters the checkpoint had no weights for, initialised at random (allowed by the caller).
    missing_weights: list[str] = field(default_factory=list)


def placed(model: nn.Module) -> dict[str, int | str]:
    """Where each module's own parameters and buffers are, as `hf_device_map` says it: a GPU's
    index, "cpu", or "disk" (accelerate keeps an offloaded module's weights on the meta device
    and loads them from memory, or from its folder's index, for each call). For a transformers
    version that keeps no map."""
    where: dict[str, int | str] = {}
    for name, module in model.named_modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not tensors:
            continue
        device = tensors[0].device
        if device.type == "meta":
            where[name] = "disk" if _on_disk(module) else "cpu"
        else:
            where[name] = device.index or 0 if device.type == "cuda" else device.type
    return where


def _on_disk(module: nn.Module) -> bool:
    """Whether accelerate loads the module's offloaded weights from its folder (the folder's
    index names them) rather than from memory."""
    weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    index = getattr(getattr(weights, "dataset", None), "index", None) or {}
    prefix = getattr(weights, "prefix", "")
    return any(prefix + name in index for name, _ in module.named_parameters(recurse=False))


def looks_like_path(name: str) -> bool:
    return (
        name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name.replace("/", "")
    )


def resolve_model(
    name: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> ModelSource:
    """A local folder with config.json, or a Hub id resolved through the standard HF cache."""
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file():
            raise InputError(
                f"'{name}' is a file; MODEL is a Hugging Face id or a folder holding config.json "
                "(as written by save_pretrained)"
            )
        if not (path / "config.json").is_file():
            raise InputError(
                f"folder '{name}' has no config.json; point MODEL at the folder that "
                "save_pretrained wrote"
            )
        return ModelSource(name, path)
    if looks_like_path(name):
        raise InputError(f"no folder '{name}'; check the path, or give a Hugging Face model id")
    return _from_hub(name, revision, trust_remote_code)


def _from_hub(repo_id: str, revision: str | None, trust_remote_code: bool) -> ModelSource:
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    ignore = list(_IGNORE_PATTERNS)
    if not trust_remote_code:
        ignore.append("*.py")
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, ignore_patterns=ignore
        )
    except (
        hub_errors.HFValidationError,
        hub_errors.RevisionNotFoundError,
        hub_errors.GatedRepoError,
        hub_errors.RepositoryNotFoundError,
        hub_errors.LocalEntryNotFoundError,
        hub_errors.OfflineModeIsEnabled,
        OSError,
    ) as exc:
        raise InputError(_hub_message(exc, repo_id, revision)) from exc
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise InputError(f"model '{repo_id}' has no config.json; is it a transformers model?")
    return ModelSource(repo_id, path, revision=path.name)


# What to do about snapshot_download's errors, by the first kind (huggingface_hub.errors) that
# fits: a gated repository is also one not found.
_HUB_FIXES = {
    "HFValidationError": "'{repo_id}' is neither a folder nor a valid Hugging Face id; "
    "check the spelling",
    "RevisionNotFoundError": "model '{repo_id}' has no revision '{revision}'; check --revision",
    "GatedRepoError": "model '{repo_id}' is gated; accept its terms on the Hub and log in "
    "(`hf auth login`)",
    "RepositoryNotFoundError": "no model '{repo_id}' on the Hugging Face Hub (or it is private); "
    "check the id, or log in with `hf auth login`",
}


def _hub_message(exc: Exception, repo_id: str, revision: str | None) -> str:
    """The one line for `exc`, raised by snapshot_download; otherwise the Hub is out of reach."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hub_errors

    for kind, message in _HUB_FIXES.items():
        if isinstance(exc, getattr(hub_errors, kind)):
            return message.format(repo_id=repo_id, revision=revision)
    return (
        f"model '{repo_id}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
        "Hub can't be reached; download it once while online, or give a local folder"
    )


def model_class(name: str) -> Any:
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise InputError(
            f"--model-class '{name}' is not a transformers model class; "
            "use e.g. AutoModel, AutoModelForCausalLM or AutoModelForMaskedLM"
        )
    return cls


def pick_device(device: Device | str) -> str:
    import torch

    device = Device(device)
    if device is Device.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device is Device.cuda and not torch.cuda.is_available():
        raise InputError("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
    return device.value


def load_model(
    name: str,
    *,
    revision: str | None = None,
    model_class_name: str = "AutoModel",
    dtype: DType | str = DType.float32,
    device: Device | str = Device.cpu,
    trust_remote_code: bool = False,
    device_map: DeviceMap | str | None = None,
    max_memory: str | Mapping[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    allow_missing_weights: bool = False,
) -> Loaded:
    """Load a transformers model by Hub id or local folder, in eval mode, on the chosen device.

    With a `device_map` ('auto', 'balanced', ...), transformers places it across GPUs, CPU and
    disk instead (accelerate underneath), within `max_memory` ('0=20GiB,cpu=30GiB' or a mapping),
    offloading to `offload_folder`; the returned `device` is where inputs go, the first module's.

    A checkpoint without weights for some of the class's parameters (a head it was not saved
    with) raises MissingWeightsError: transformers would initialise them at random. With
    `allow_missing_weights` the model loads and `missing_weights` lists them.
    """
    import transformers

    from modeltap.loading import placement as placing

    source = resolve_model(name, revision=revision, trust_remote_code=trust_remote_code)
    cls = model_class(model_class_name)
    dtype = DType(dtype)
    # Its per-tensor "Loading weights" bar would fight our status line on stderr.
    transformers.utils.logging.disable_progress_bar()
    placement = placing.placement(device_map, max_memory, offload_folder)
    extra: dict[str, Any] = {}
    if placement is None:
        target = pick_device(device)
        placing.check_dtype(dtype.value, target)
    else:
        _check_placement(
            placement,
            name,
            revision=revision,
            model_class_name=model_class_name,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
        )
        extra = placement.from_pretrained_kwargs()
    model, info, held = _from_pretrained(
        cls, source, name, model_class_name, dtype, trust_remote_code, extra
    )
    missing = missing_parameters(model, info.get("missing_keys") or ())
    if missing and not allow_missing_weights:
        raise MissingWeightsError(
            _missing_message(name, type(model).__name__, missing, source.path),
            model_class=type(model).__name__,
            missing=missing,
        )
    held.let_through()
    device_map_used = None
    if placement is None:
        model.to(target).eval()
    else:
        model.eval()
        target = str(placing.input_device(model))
        device_map_used = dict(getattr(model, "hf_device_map", None) or {}) or placed(model)
    return Loaded(
        model,
        source,
        dtype=dtype.value,
        device=target,
        model_class=type(model).__name__,
        device_map=device_map_used,
        missing_weights=missing,
    )


def _check_placement(
    placement: Placement,
    name: str,
    *,
    revision: str | None,
    model_class_name: str,
    trust_remote_code: bool,
    dtype: DType,
) -> None:
    """Refuse a device map that can't hold the model: a dtype the GPU lacks, too little memory."""
    import torch

    from modeltap.loading import placement as placing

    memory = placement.max_memory
    if torch.cuda.is_available() and (memory is None or any(isinstance(k, int) for k in memory)):
        placing.check_dtype(dtype.value, "cuda")
    if memory is not None:
        meta, _ = load_meta_model(
            name,
            revision=revision,
            model_class_name=model_class_name,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
        )
        placing.check_fits(meta, memory)
        del meta


def _from_pretrained(
    cls: Any,
    source: ModelSource,
    name: str,
    model_class_name: str,
    dtype: DType,
    trust_remote_code: bool,
    extra: dict[str, Any],
) -> tuple[Any, dict[str, Any], _HeldLogs]:
    """`cls.from_pretrained` with its loading info, transformers' log held back (returned)."""
    import torch

    # accelerate warns that offloaded weights sit on the meta device: that is the plan, not news.
    quiet = logging.getLogger("accelerate.big_modeling")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    # transformers' log while loading is held back: a refused load says why in one line, and
    # its table of missing and unused weights is said here (missing) or changes nothing
    # (unused); the rest is let through after a load that goes on.
    held = _HeldLogs()
    transformers_log = logging.getLogger("transformers")
    handlers, propagate = transformers_log.handlers[:], transformers_log.propagate
    transformers_log.handlers, transformers_log.propagate = [held], False
    try:
        model, info = cls.from_pretrained(
            str(source.path),
            dtype=getattr(torch, dtype.value),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **extra,
        )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise InputError(_uncovered_message(name, source.path, model_class_name)) from exc
        if "trust_remote_code" in str(exc):
            raise InputError(
                f"model '{name}' needs its own code; rerun with --trust-remote-code if you trust it"
            ) from exc
        if "offload_folder" in str(exc) or "offload folder" in str(exc):
            raise InputError(
                f"the device map puts part of '{name}' on disk; give a folder with --offload-folder"
            ) from exc
        raise InputError(f"can't load '{name}' as {model_class_name}: {first_line(exc)}") from exc
    except (OSError, KeyError) as exc:
        raise InputError(f"can't load '{name}' as {model_class_name}: {first_line(exc)}") from exc
    except BaseException:
        # transformers' own error (weights of other shapes...) points at its report: show it
        transformers_log.handlers, transformers_log.propagate = handlers, propagate
        held.let_through(report=True)
        raise
    finally:
        quiet.setLevel(level)
        transformers_log.handlers, transformers_log.propagate = handlers, propagate
    return model, info, held


class _HeldLogs(logging.Handler):
    """transformers' log records, kept to be let through later (or dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def let_through(self, *, report: bool = False) -> None:
        """Each record to the handlers it was meant for, but the report of missing and unused
        weights (5.x: one 'LOAD REPORT' table; 4.x: 'Some weights of ...' paragraphs) unless
        `report`."""
        for record in self.records:
            message = record.getMessage()
            if report or not ("LOAD REPORT" in message or message.startswith("Some weights of")):
                logging.getLogger(record.name).handle(record)
        self.records.clear()


def missing_parameters(model: nn.Module, missing_keys: Any) -> list[str]:
    """The parameters among transformers' `missing_keys` that really start at random: not
    buffers (rebuilt in `__init__`, as position_ids and rotary inv_freq are) and not a
    parameter tied to one that was loaded (an LM head sharing the input embeddings)."""
    aliases: dict[int, list[str]] = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(key)
    names = {key: group for group in aliases.values() for key in group}
    missing = set(missing_keys)
    return sorted(
        key for key in missing if key in names and all(alias in missing for alias in names[key])
    )


def _architectures(path: Path) -> list[str]:
    import json

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    found = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def describe_names(names: list[str], limit: int = 3) -> str:
    """'cls.predictions.*' when the names share a dotted prefix, else the first few."""
    prefix = os.path.commonprefix([n.split(".") for n in names]) if len(names) > 1 else []
    if prefix:
        return ".".join(prefix) + ".*"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _missing_message(name: str, class_name: str, missing: list[str], path: Path) -> str:
    saved = [a for a in _architectures(path) if a != class_name]
    fix = (
        f"it was saved as {saved[0]}: pass --model-class {saved[0]}"
        if saved
        else "pass --model-class with the class it was saved as"
    )
    return (
        f"'{name}' has no weights for {len(missing)} parameter(s) of {class_name} "
        f"({describe_names(missing)}), which would run randomly initialised; {fix}, or "
        "--allow-missing-weights to run them anyway"
    )


def _uncovered_message(name: str, path: Path, model_class_name: str) -> str:
    """transformers' 'Unrecognized configuration class ...' as one line naming the fix."""
    saved = _architectures(path)
    fix = (
        f"pass --model-class {saved[0]} (the class it was saved as) or another for it"
        if saved
        else "pass --model-class with a class for it"
    )
    return f"{model_class_name} has no class for the model '{name}'; {fix}"


def load_meta_model(
    name: str,
    *,
    revision: str | None = None,
    model_class_name: str = "AutoModel",
    trust_remote_code: bool = False,
    dtype: DType | str | None = None,
) -> tuple[nn.Module, ModelSource]:
    """The model's module tree on the meta device: no weights read, instant for any size.

    `dtype` gives the parameters the dtype loading would (their sizes matter for placement).
    """
    import torch
    import transformers

    source = resolve_model(name, revision=revision, trust_remote_code=trust_remote_code)
    cls = model_class(model_class_name)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, DType(dtype).value)
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(source.path), trust_remote_code=trust_remote_code
        )
        with torch.device("meta"):
            if hasattr(cls, "from_config"):
                model = cls.from_config(config, **kwargs)
            else:
                model = cls(config)
                if dtype is not None:
                    model.to(kwargs["dtype"])
    except ValueError as exc:
        raise InputError(f"can't build '{name}' as {model_class_name}: {first_line(exc)}") from exc
    return model, source


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(
            f"no tokenizer at '{path}'; pass --tokenizer, or give tensors with --input-file"
        ) from exc
    # every word would become [UNK] without a word of warning.
    specials = set(getattr(tokenizer, "all_special_tokens", []))
    if tokenizer is None or len(set(tokenizer.get_vocab()) - specials) == 0:
        raise InputError(f"no tokenizer at '{path}'; pass --tokenizer, or give --input-file")
    return tokenizer
