"""The module tree of a Hugging Face model, cached so that a second `modeltap ls` needs neither
torch nor transformers.

Building the tree on the meta device costs little, but importing torch and transformers to do it
costs seconds. The tree depends only on the model's config, the model class, its remote code and
the transformers that builds it, so a hash of those names the cache entry: a changed config.json
(or class, code, transformers version) is another entry, never a stale one. Weights play no part.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# Bumped when what an entry holds changes: older entries are then simply not found.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class ModuleInfo:
    """What `modeltap ls` shows of one module."""

    name: str  # display name: ROOT for the model itself
    cls: str
    params: int


def cache_dir() -> Path:
    """$MODELTAP_CACHE, else $XDG_CACHE_HOME/modeltap, else ~/.cache/modeltap."""
    if os.environ.get("MODELTAP_CACHE"):
        return Path(os.environ["MODELTAP_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "modeltap"


def module_infos(model: nn.Module) -> list[ModuleInfo]:
    """Every module in registration order, with its class and parameter count."""
    from modeltap.selection import display_name

    return [
        ModuleInfo(display_name(n), type(m).__name__, sum(p.numel() for p in m.parameters()))
        for n, m in model.named_modules()
    ]


def _config_folder(name: str, revision: str | None, trust_remote_code: bool) -> Path | None:
    """The folder holding the model's config.json, found without torch, transformers or the
    network: a local folder, or a Hub id's snapshot in the Hugging Face cache (None when it is
    not there: the tree is then built the usual way, which downloads it)."""
    from modeltap.loading.hf import looks_like_path, resolve_model

    if Path(name).expanduser().exists() or looks_like_path(name):
        return resolve_model(name, trust_remote_code=trust_remote_code).path  # errors as ever
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", revision=revision)
    except ValueError:  # not a valid repo id: the usual path says so
        return None
    return Path(found).parent if isinstance(found, str) else None


def _key(folder: Path, model_class: str, trust_remote_code: bool) -> str:
    from importlib.metadata import PackageNotFoundError, version

    from modeltap._version import __version__

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = None
    material: dict[str, Any] = {
        "format": CACHE_FORMAT,
        "config": digest(folder / "config.json"),
        "model_class": model_class,
        "trust_remote_code": trust_remote_code,
        "transformers": transformers,
        "modeltap": __version__,
    }
    if trust_remote_code:  # the model's own modeling code builds the tree
        material["code"] = {p.name: digest(p) for p in sorted(folder.glob("*.py"))}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> list[ModuleInfo] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [ModuleInfo(str(n), str(c), int(p)) for n, c, p in data["modules"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, or written by something else: built again


def _write(path: Path, infos: list[ModuleInfo], model: str) -> None:
    """Store an entry whole or not at all; a cache that can't be written only costs the speed."""
    data = {"model": model, "modules": [[i.name, i.cls, i.params] for i in infos]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def module_tree(
    name: str,
    *,
    revision: str | None = None,
    model_class_name: str = "AutoModel",
    trust_remote_code: bool = False,
    use_cache: bool = True,
) -> list[ModuleInfo]:
    """The modules of a Hugging Face model (id or folder), from the cache when it holds them,
    else built on the meta device (`load_meta_model`) and stored there."""
    path = None
    if use_cache:
        folder = _config_folder(name, revision, trust_remote_code)
        if folder is not None:
            key = _key(folder, model_class_name, trust_remote_code)
            path = cache_dir() / "ls" / f"{key}.json"
            cached = _read(path)
            if cached is not None:
                return cached
    from modeltap.loading.hf import load_meta_model

    model, _ = load_meta_model(
        name,
        revision=revision,
        model_class_name=model_class_name,
        trust_remote_code=trust_remote_code,
    )
    infos = module_infos(model)
    if path is not None:
        _write(path, infos, name)
    return infos
