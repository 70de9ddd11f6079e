"""Placing a big model across GPUs, CPU and disk: accelerate decides, modeltap only asks and checks.

`--device-map auto` loads through transformers' own `device_map` / `max_memory` / `offload_folder`
(accelerate underneath). `plan` asks accelerate for the same placement on the meta-device model, so
`ls` shows where each module would go without reading a weight. The checks here turn what would be
a traceback deep in loading into one line that says what to change.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn


class DeviceMap(str, Enum):
    """transformers' placement strategies (see `from_pretrained(device_map=...)`)."""

    auto = "auto"
    balanced = "balanced"
    balanced_low_0 = "balanced_low_0"
    sequential = "sequential"


@dataclass(frozen=True)
class Placement:
    """What the user asked for: a strategy, a memory budget per device, a folder for offload."""

    device_map: DeviceMap
    max_memory: dict[int | str, int] | None = None
    offload_folder: Path | None = None

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"device_map": self.device_map.value}
        if self.max_memory is not None:
            kwargs["max_memory"] = dict(self.max_memory)
        if self.offload_folder is not None:
            kwargs["offload_folder"] = str(self.offload_folder)
        return kwargs


def placement(
    device_map: DeviceMap | str | None,
    max_memory: str | Mapping[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
) -> Placement | None:
    """Check the three placement options together; None when no device map was asked for."""
    if device_map is None:
        for flag, value in (("--max-memory", max_memory), ("--offload-folder", offload_folder)):
            if value:
                raise InputError(f"{flag} is used by a device map; add --device-map auto")
        return None
    try:
        strategy = DeviceMap(device_map)
    except ValueError:
        choices = ", ".join(m.value for m in DeviceMap)
        raise InputError(f"--device-map '{device_map}' is not one of {choices}") from None
    require_accelerate()
    folder = Path(offload_folder).expanduser() if offload_folder else None
    if folder is not None:
        check_offload_folder(folder)
    memory = parse_max_memory(max_memory) if max_memory else None
    if memory is not None:
        check_devices(memory)
    return Placement(strategy, memory, folder)


def require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise InputError(
            "--device-map needs accelerate; install the extra: pip install 'modeltap[big]'"
        ) from exc


_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMG]i?B)?$", re.IGNORECASE)


def parse_max_memory(value: str | Mapping[int | str, int | str]) -> dict[int | str, int]:
    """`0=20GiB,cpu=30GiB` (or the same as a mapping) -> {0: 21474836480, 'cpu': 32212254720}:
    bytes per device, as accelerate takes them."""
    if isinstance(value, str):
        items = []
        for item in (part.strip() for part in value.split(",")):
            device, sep, size = (s.strip() for s in item.partition("="))
            if not sep or not device or not size:
                raise InputError(
                    f"--max-memory item '{item}' is not DEVICE=SIZE; write e.g. 0=20GiB,cpu=30GiB"
                )
            items.append((device, size))
    else:
        items = [(str(k), str(v)) for k, v in value.items()]
    memory: dict[int | str, int] = {}
    for device, size in items:
        key = _device_key(device)
        if key in memory:
            raise InputError(f"--max-memory gives '{device}' twice; give each device once")
        memory[key] = _size(size, device)
    return memory


def _device_key(device: str) -> int | str:
    name = device.lower().removeprefix("cuda:")
    if name.isdigit():
        return int(name)
    if name == "cpu":
        return "cpu"
    raise InputError(
        f"--max-memory device '{device}' is unknown; use a GPU index (0, 1, ...) or cpu"
    )


def _size(size: str, device: str) -> int:
    from accelerate.utils import convert_file_size_to_int

    size = size.replace(" ", "")
    if not _SIZE.match(size):
        raise InputError(
            f"--max-memory size '{size}' for {device} is not a size; write e.g. 200MB or 20GiB"
        )
    return int(size) if size.isdigit() else convert_file_size_to_int(size.upper())


def check_devices(memory: Mapping[int | str, int]) -> None:
    """GPUs named in --max-memory must exist: accelerate would otherwise silently drop them."""
    import torch

    gpus = sorted(k for k in memory if isinstance(k, int))
    if not gpus:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InputError(
            f"--max-memory names GPU {gpus[0]}, but torch sees no CUDA GPU; give only cpu=SIZE"
        )
    if gpus[-1] >= count:
        raise InputError(
            f"--max-memory names GPU {gpus[-1]}, but torch sees {count} GPU(s) (0 to {count - 1}); "
            "fix the index"
        )


def check_offload_folder(folder: Path) -> None:
    """Create the folder if needed and write a probe file into it, before any weight is read."""
    import tempfile

    if folder.exists() and not folder.is_dir():
        raise InputError(f"offload folder '{folder}' is a file; give a folder to --offload-folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(
            f"offload folder '{folder}' is not writable ({exc.strerror or exc}); "
            "choose another with --offload-folder"
        ) from exc


def format_bytes(size: float) -> str:
    """Sizes as people write them for memory: 1.5 GiB, 200.0 MiB, 12.3 KiB, 512 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{int(size)} B"


def _device_name(device: int | str) -> str:
    return "cpu" if device == "cpu" else f"gpu {device}" if isinstance(device, int) else str(device)


def plan(model: nn.Module, p: Placement) -> dict[str, int | str]:
    """Where `from_pretrained(device_map=...)` will put each module of `model` (on meta).

    The calls from_pretrained makes: the (balanced) memory budget, then `infer_auto_device_map`
    with the model's no-split classes. transformers 5 ships its own copies of accelerate's two
    functions (90% of the CPU when no budget is given, tied weights from the model's own list);
    they are used where present, so `ls` shows what loading will do.
    """
    try:
        from transformers.integrations.accelerate import (
            get_balanced_memory,
            get_max_memory,
            infer_auto_device_map,
        )

        extra = {"no_placement_params": getattr(model, "_no_placement_params", None)}
    except ImportError:  # transformers 4: from_pretrained calls accelerate's
        from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

        extra = {}
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    memory = dict(p.max_memory) if p.max_memory is not None else None
    check_fits(model, memory, no_split)
    if p.device_map is DeviceMap.sequential:
        budget = get_max_memory(memory)
    else:
        budget = get_balanced_memory(
            model,
            max_memory=memory,
            no_split_module_classes=no_split,
            low_zero=p.device_map is DeviceMap.balanced_low_0,
        )
    return dict(
        infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, **extra)
    )


def check_fits(
    model: nn.Module, memory: dict[int | str, int] | None, no_split: list[str] | None = None
) -> None:
    """The device that runs the model must hold its largest layer: accelerate brings each
    offloaded layer back whole, so below that even disk offload can't run it."""
    if not memory:
        return
    from accelerate.utils import compute_module_sizes
    from accelerate.utils.modeling import get_max_layer_size

    if no_split is None:
        no_split = list(getattr(model, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(model)
    largest, names = get_max_layer_size(list(model.named_children()), sizes, no_split)
    gpus = sorted(k for k in memory if isinstance(k, int))
    runner = gpus[0] if gpus else "cpu"
    budget = memory.get(runner)
    if budget is not None and budget < largest:
        flag = f"{runner}={format_bytes(budget)}"
        raise InputError(
            f"--max-memory {flag} can't hold the largest layer ({names[0] if names else 'model'},"
            f" {format_bytes(largest)}) that must be loaded to run it, even with disk offload; "
            f"give {_device_name(runner)} at least {format_bytes(largest)}"
        )


def module_devices(device_map: Mapping[str, int | str], names: list[str]) -> dict[str, str]:
    """Device of each module (or parameter) name: from its own entry or its nearest ancestor's, or
    the devices of the entries inside it joined by '+' (a module split across devices)."""
    from modeltap.selection import ROOT

    out = {}
    for name in names:
        module = "" if name == ROOT else name
        covering = [
            key for key in device_map if key in ("", module) or module.startswith(key + ".")
        ]
        if covering:
            out[name] = str(device_map[max(covering, key=len)])
            continue
        inside = [str(d) for k, d in device_map.items() if not module or k.startswith(module + ".")]
        out[name] = "+".join(dict.fromkeys(inside)) if inside else "?"
    return out


def bytes_per_device(model: nn.Module, device_map: Mapping[str, int | str]) -> dict[str, int]:
    """Parameter and buffer bytes placed on each device, in the order devices appear in the map."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    where = module_devices(device_map, list(params))
    totals: dict[str, int] = {str(d): 0 for d in device_map.values()}
    for name, tensor in params.items():
        totals[where[name]] = totals.get(where[name], 0) + tensor.numel() * tensor.element_size()
    return totals


def module_bytes(model: nn.Module, names: list[str]) -> dict[str, int]:
    """Parameter and buffer bytes of each module, as accelerate counts them for placement."""
    from accelerate.utils import compute_module_sizes

    from modeltap.selection import ROOT

    sizes = compute_module_sizes(model)
    return {name: int(sizes.get("" if name == ROOT else name, 0)) for name in names}


def input_device(model: nn.Module) -> torch.device:
    """Where inputs go: the execution device of accelerate's hook on the model (or on its first
    hooked module), which is where a dispatched model runs its first module; without hooks, where
    the first parameter lives."""
    import torch

    for module in model.modules():  # the model itself first
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


def offloaded(model: nn.Module) -> bool:
    """Whether accelerate swaps some of the model's weights in per forward (CPU or disk offload)."""
    return any(getattr(getattr(m, "_hf_hook", None), "offload", False) for m in model.modules())


def return_freed_memory() -> None:
    """Let large freed blocks go back to the system (glibc only; the CLI calls it for placed runs).

    glibc raises its mmap threshold after the first large free; from then on the weights that
    accelerate swaps in for each offloaded layer come from the heap and stay with the process. On
    bert-base with `--max-memory cpu=200MB` that added 0 to 110 MB to the peak, varying run to run.
    A fixed threshold keeps every block above it mmapped, returned to the system when freed.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    m_mmap_threshold = -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 128 * 1024)


def check_dtype(dtype: str, device: str) -> None:
    """Half precision the device can't compute in fails deep inside the forward: say so first."""
    import torch

    if device.startswith("cuda") and dtype == "bfloat16" and torch.cuda.is_available():
        if not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name()
            raise InputError(
                f"the GPU ({name}) does not support bfloat16; use --dtype float16 or float32"
            )
