"""Model archives: torch.export `.pt2` and TorchScript `.pt`, told apart by their zip entries.

`torch.export.load` unpickles in two places: weights or constants marked `use_pickle` (loaded with
`weights_only=False`), and the sample inputs, retried with `weights_only=False` when the safe load
fails. A crafted archive runs its payload there. So a `.pt2` is scanned first, reading only zip
entry names, the `*_config.json` files and the sample inputs with `weights_only=True`, and an
archive that needs a full unpickle is refused before anything is unpickled, unless `allow_pickle`.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from modeltap.errors import InputError, first_line

PT2_SUFFIXES = (".pt2",)
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ptl", ".torchscript")


class ArchiveKind(str, Enum):
    export = "export"
    torchscript = "torchscript"


def is_archive_path(name: str) -> bool:
    return Path(name).suffix.lower() in (*PT2_SUFFIXES, *TORCHSCRIPT_SUFFIXES)


def archive_kind(path: Path) -> ArchiveKind:
    """What a zip holds: a torch.export program, a TorchScript module, or neither (an error)."""
    if not path.is_file():
        raise InputError(f"no archive '{path}'; check the path")
    if not zipfile.is_zipfile(path):
        raise InputError(
            f"'{path.name}' is not a zip archive; MODEL is a .pt2 from torch.export.save or "
            "`modeltap export`, or a TorchScript .pt from torch.jit.save"
        )
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    if any(re.search(r"(^|/)models/[^/]+\.json$", n) for n in names):
        return ArchiveKind.export
    if any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in names) and any(
        "/code/" in n or n.startswith("code/") for n in names
    ):
        return ArchiveKind.torchscript
    if any(n.endswith("data.pkl") for n in names):
        raise InputError(
            f"'{path.name}' is a torch.save file, not a model archive; save the module with "
            "torch.jit.save (TorchScript) or torch.export.save (.pt2), or give a factory "
            "pkg.module:function"
        )
    raise InputError(
        f"'{path.name}' is neither a torch.export .pt2 nor a TorchScript archive; re-save it "
        "with torch.export.save or torch.jit.save"
    )


@dataclass
class PickleScan:
    """Entries of a .pt2 that only a full unpickle can read (empty: safe to load)."""

    needs_pickle: list[str] = field(default_factory=list)


def scan_pt2(path: Path) -> PickleScan:
    """Find what in a .pt2 would be unpickled with weights_only=False, unpickling nothing."""
    import torch

    scan = PickleScan()
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        models = [n for n in names if re.search(r"(^|/)models/[^/]+\.json$", n)]
        if not models:
            scan.needs_pickle.append("(legacy archive layout, loaded with torch.load)")
            return scan
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if re.search(r"/data/(weights|constants)/[^/]+\.pt$", name):
                scan.needs_pickle.append(name)  # legacy weight files
            elif base.endswith("_config.json") and "/data/" in name:
                try:
                    config = json.loads(z.read(name)).get("config", {})
                except (ValueError, AttributeError) as exc:
                    raise InputError(
                        f"'{path.name}': unreadable {name} ({exc}); re-export"
                    ) from exc
                for fqn, payload in config.items():
                    pathname = str(payload.get("path_name", ""))
                    if payload.get("use_pickle") or pathname.startswith(("custom_obj", "opaque")):
                        scan.needs_pickle.append(f"{name}: {fqn}")
            elif "/data/sample_inputs/" in name:
                data = z.read(name)
                if data:
                    try:
                        torch.load(io.BytesIO(data), weights_only=True)
                    except Exception:  # any failure here means torch would retry unsafely
                        scan.needs_pickle.append(name)
    return scan


def _import_pytree_types(path: Path) -> None:
    """Output types (transformers ModelOutputs) must be registered with pytree before loading."""
    import importlib

    with zipfile.ZipFile(path) as z:
        text = " ".join(
            z.read(n).decode("utf-8", "replace")
            for n in z.namelist()
            if re.search(r"(^|/)models/[^/]+\.json$", n)
        )
    for module in sorted(set(re.findall(r"(transformers(?:\.\w+)+)\.\w+", text))):
        try:
            importlib.import_module(module)
        except ImportError:
            continue


def load_pt2(path: str | Path, *, allow_pickle: bool = False) -> Any:
    """A scanned, then loaded, ExportedProgram."""
    import torch

    path = Path(path)
    if archive_kind(path) is not ArchiveKind.export:
        raise InputError(
            f"'{path.name}' is a TorchScript archive, not a torch.export .pt2; rename it to .pt"
        )
    if not allow_pickle:
        scan = scan_pt2(path)
        if scan.needs_pickle:
            raise InputError(
                f"'{path.name}' needs a full unpickle to load ({scan.needs_pickle[0]}), which runs "
                "any code it holds; re-export it without pickled objects, or pass --allow-pickle "
                "if you trust the file"
            )
    _import_pytree_types(path)
    try:
        return torch.export.load(str(path))
    except Exception as exc:  # deserialization failures come in many kinds
        raise InputError(
            f"can't load '{path.name}' with torch.export.load ({first_line(exc)}); export it "
            f"again with this torch ({torch.__version__})"
        ) from exc


def load_torchscript(path: str | Path) -> Any:
    import torch

    path = Path(path)
    if archive_kind(path) is not ArchiveKind.torchscript:
        raise InputError(
            f"'{path.name}' is a torch.export archive, not TorchScript; rename it to .pt2"
        )
    try:
        return torch.jit.load(str(path), map_location="cpu").eval()
    except Exception as exc:
        raise InputError(
            f"can't load '{path.name}' with torch.jit.load ({first_line(exc)})"
        ) from exc


def torchscript_outputs(path: str | Path) -> dict | None:
    """The record of the modules' eager output structure that `save_traced` keeps in a
    TorchScript archive (`extra/modeltap/outputs.json`), or None (traced or scripted elsewhere)."""
    from modeltap.capture.structure import STRUCTURE_FILE

    with zipfile.ZipFile(path) as z:
        entry = next((n for n in z.namelist() if n.endswith(f"/extra/{STRUCTURE_FILE}")), None)
        if entry is None:
            return None
        try:
            record = json.loads(z.read(entry))
        except ValueError as exc:
            raise InputError(
                f"'{Path(path).name}': unreadable {entry} ({exc}); save it again"
            ) from exc
    if not isinstance(record, dict) or record.get("format") != 1:
        raise InputError(
            f"'{Path(path).name}': {entry} is not an output record this modeltap reads; "
            "save the archive again"
        )
    return record


def pt2_module_classes(path: str | Path) -> dict[str, str] | None:
    """Every module's class name as `modeltap export` keeps it in a .pt2 (read from the zip,
    nothing unpickled), or None for a program exported elsewhere."""
    from modeltap.capture.export import MODULES_FILE

    with zipfile.ZipFile(path) as z:
        entry = next((n for n in z.namelist() if n.endswith(f"/extra/{MODULES_FILE}")), None)
        if entry is None:
            return None
        try:
            record = json.loads(z.read(entry))
        except ValueError as exc:
            raise InputError(f"'{Path(path).name}': unreadable {entry} ({exc}); re-export") from exc
    if not isinstance(record, dict) or not all(isinstance(v, str) for v in record.values()):
        raise InputError(f"'{Path(path).name}': {entry} is not a module record; re-export")
    return record


def example_inputs(program: Any) -> Any:
    """The inputs a .pt2 was exported with (loaded with weights_only=True), as Inputs, or None."""
    import torch

    from modeltap.loading.inputs import Inputs

    example = getattr(program, "example_inputs", None)
    if not example:
        return None
    args, kwargs = example
    shapes = {
        **{str(i): list(a.shape) for i, a in enumerate(args) if isinstance(a, torch.Tensor)},
        **{k: list(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)},
    }
    return Inputs(tuple(args), dict(kwargs), {"example_inputs": "archive", "tensors": shapes})
