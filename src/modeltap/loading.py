"""Model and tokenizer by Hugging Face id or local folder; inputs from sentences or tensor files."""

from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

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
    except hub_errors.HFValidationError as exc:
        raise InputError(
            f"'{repo_id}' is neither a folder nor a valid Hugging Face id; check the spelling"
        ) from exc
    except hub_errors.RevisionNotFoundError as exc:
        raise InputError(
            f"model '{repo_id}' has no revision '{revision}'; check --revision"
        ) from exc
    except hub_errors.GatedRepoError as exc:
        raise InputError(
            f"model '{repo_id}' is gated; accept its terms on the Hub and log in (`hf auth login`)"
        ) from exc
    except hub_errors.RepositoryNotFoundError as exc:
        raise InputError(
            f"no model '{repo_id}' on the Hugging Face Hub (or it is private); check the id, "
            "or log in with `hf auth login`"
        ) from exc
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError) as exc:
        cache = huggingface_hub.constants.HF_HUB_CACHE
        raise InputError(
            f"model '{repo_id}' is not in the Hugging Face cache ({cache}) and the Hub can't be "
            "reached; download it once while online, or give a local folder"
        ) from exc
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise InputError(f"model '{repo_id}' has no config.json; is it a transformers model?")
    return ModelSource(repo_id, path, revision=path.name)


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
) -> Loaded:
    """Load a transformers model by Hub id or local folder, in eval mode, on the chosen device."""
    import torch
    import transformers

    source = resolve_model(name, revision=revision, trust_remote_code=trust_remote_code)
    cls = model_class(model_class_name)
    dtype = DType(dtype)
    # Its per-tensor "Loading weights" bar would fight our status line on stderr.
    transformers.utils.logging.disable_progress_bar()
    target = pick_device(device)
    try:
        model = cls.from_pretrained(
            str(source.path),
            dtype=getattr(torch, dtype.value),
            trust_remote_code=trust_remote_code,
        )
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise InputError(
                f"model '{name}' needs its own code; rerun with --trust-remote-code if you trust it"
            ) from exc
        raise InputError(f"can't load '{name}' as {model_class_name}: {first_line(exc)}") from exc
    except (OSError, KeyError) as exc:
        raise InputError(f"can't load '{name}' as {model_class_name}: {first_line(exc)}") from exc
    model.to(target).eval()
    return Loaded(model, source, dtype=dtype.value, device=target, model_class=type(model).__name__)


def load_meta_model(
    name: str,
    *,
    revision: str | None = None,
    model_class_name: str = "AutoModel",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, ModelSource]:
    """The model's module tree on the meta device: no weights read, instant for any size."""
    import torch
    import transformers

    source = resolve_model(name, revision=revision, trust_remote_code=trust_remote_code)
    cls = model_class(model_class_name)
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(source.path), trust_remote_code=trust_remote_code
        )
        with torch.device("meta"):
            if hasattr(cls, "from_config"):
                model = cls.from_config(config, trust_remote_code=trust_remote_code)
            else:
                model = cls(config)
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
    # transformers 5 builds a tokenizer of special tokens only when a folder has no vocabulary:
    # every word would become [UNK] without a word of warning.
    specials = set(getattr(tokenizer, "all_special_tokens", []))
    if tokenizer is None or len(set(tokenizer.get_vocab()) - specials) == 0:
        raise InputError(f"no tokenizer at '{path}'; pass --tokenizer, or give --input-file")
    return tokenizer


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


def text_inputs(tokenizer: Any, texts: list[str]) -> Inputs:
    """Sentences as one padded batch with attention mask."""
    notes = {}
    if getattr(tokenizer, "pad_token", None) is None and len(texts) > 1:
        if getattr(tokenizer, "eos_token", None) is None:
            raise InputError("the tokenizer has no pad token to batch several texts; give one text")
        tokenizer.pad_token = tokenizer.eos_token
        notes["pad_token"] = "eos_token"
    encoded = tokenizer(list(texts), return_tensors="pt", padding=True)
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


def add_decoder_inputs(model: nn.Module, inputs: Inputs) -> Inputs:
    """Encoder-decoder models get the decoder start token when no decoder input was given."""
    import torch

    config = getattr(model, "config", None)
    if config is None or not getattr(config, "is_encoder_decoder", False):
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
