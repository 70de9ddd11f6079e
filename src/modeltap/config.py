"""Settings, merged in this order, later wins:

defaults < --config FILE < ./modeltap.toml or [tool.modeltap] < MODELTAP_* env < flags.

A TOML file holds keys for every command at its top level and per-command keys in a table named
after the command (`[dump]`), which win over the top level.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeltap.errors import InputError
from modeltap.selection import suggest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

COMMANDS = ("dump", "grads", "diff", "show", "ls", "compare", "export", "generate")
PROJECT_FILE = "modeltap.toml"


@dataclass
class Settings:
    model: str | None = None
    texts: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    audio: list[str] = field(default_factory=list)
    processor: str | None = None
    # dump/grads: the TEXT and files as a user turn of the processor's chat template;
    # generate: each prompt through the tokenizer's chat template
    chat: bool = False
    input_file: str | None = None
    depth: int | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    inputs: bool = False
    out: str | None = None
    stats_only: bool = False
    hist: bool = False
    revision: str | None = None
    model_class: str = "AutoModel"
    tokenizer: str | None = None
    max_length: int | None = None
    trust_remote_code: bool = False
    # run a checkpoint lacking weights for some of the class's parameters (they start at random)
    allow_missing_weights: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    train_mode: bool = False
    dead_threshold: float = 0.0
    # diff
    atol: float = 1e-8
    rtol: float = 1e-5
    preset: str | None = None
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)
    map: list[str] = field(default_factory=list)
    equal_nan: bool = False
    upcast: bool = False
    strict: bool = False
    # grads (and dump --grads)
    grads: bool = False
    target: str | None = None
    wrt: list[str] = field(default_factory=list)
    loss: str = "sum"
    grad_output: str = "ones"
    params: bool = False
    jacobian_norm: int = 0
    probes: str = "rademacher"
    vanishing: float = 1e-7
    exploding: float = 1e3
    # compare (scaled_atol and min_cosine are tolerances of diff too)
    against: str | None = None
    candidate: str | None = None
    out_dir: str | None = None
    use_cache: bool = False
    scaled_atol: float = 0.0
    min_cosine: float | None = None
    # compare only: scale-relative allowance for rounding accumulated from module to module
    accumulated_scaled_atol: float = 0.0

    # big models: placement across GPUs, CPU and disk (dump, grads, ls)
    device_map: str | None = None
    max_memory: str | None = None
    offload_folder: str | None = None

    # transformed models (dump --compile, .pt2 / TorchScript archives, factories; export)
    compile: bool = False
    compile_backend: str = "inductor"
    fullgraph: bool = False
    dynamic: bool = True

    # performance (#12): MiB the dump writer's thread may hold copied but not yet written
    max_inflight_mb: int = 32

    # generate (and compare --generate N): decoding, and which steps keep tensors; None: what
    # the model's generation config says (max_new_tokens: its own, else 20)
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    num_beams: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    full: bool = False
    steps: str | None = None
    kv: bool = False


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
# Scalar types of each field, for checking TOML values and parsing environment variables.
_TYPES: dict[str, type] = {
    "texts": list,
    "images": list,
    "audio": list,
    "chat": bool,
    "include": list,
    "exclude": list,
    "inputs": bool,
    "stats_only": bool,
    "hist": bool,
    "trust_remote_code": bool,
    "allow_missing_weights": bool,
    "train_mode": bool,
    "depth": int,
    "seed": int,
    "max_length": int,
    "dead_threshold": float,
    "atol": float,
    "rtol": float,
    "overrides": dict,
    "map": list,
    "equal_nan": bool,
    "upcast": bool,
    "strict": bool,
    "grads": bool,
    "wrt": list,
    "params": bool,
    "jacobian_norm": int,
    "vanishing": float,
    "exploding": float,
    "use_cache": bool,
    "scaled_atol": float,
    "min_cosine": float,
    "accumulated_scaled_atol": float,
    "compile": bool,
    "fullgraph": bool,
    "dynamic": bool,
    "max_inflight_mb": int,
    "max_new_tokens": int,
    "do_sample": bool,
    "num_beams": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "full": bool,
    "kv": bool,
}


def _check(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            guess = suggest(name, _FIELDS)
            hint = f"did you mean '{guess}'?" if guess else "see the README for the keys"
            raise InputError(f"{where}: unknown setting '{key}'; {hint}")
        expected = _TYPES.get(name, str)
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if expected is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if expected is dict:
            value = _check_overrides(value, f"{where}: '{key}'")
        if not ok:
            raise InputError(
                f"{where}: '{key}' must be "
                f"{'a list of strings' if expected is list else expected.__name__}"
                f", got {value!r}"
            )
        checked[name] = value
    return checked


def _check_overrides(value: Any, where: str) -> dict[str, dict[str, float]]:
    """`{glob = {atol = .., rtol = ..}}`: per-key tolerances for diff."""
    if not isinstance(value, Mapping):
        raise InputError(f'{where} must be a table of globs, e.g. "pooler.*" = {{ atol = 1e-3 }}')
    checked = {}
    for glob, tol in value.items():
        if (
            not isinstance(tol, Mapping)
            or not set(tol) <= {"atol", "rtol"}
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in tol.values()
            )
        ):
            raise InputError(f"{where}: '{glob}' must be {{ atol = number, rtol = number }}")
        checked[glob] = {k: float(v) for k, v in tol.items()}
    return checked


def _table(data: Mapping[str, Any], command: str, where: str) -> dict[str, Any]:
    top = {k: v for k, v in data.items() if k not in COMMANDS}
    section = data.get(command, {})
    if not isinstance(section, Mapping):
        raise InputError(f"{where}: [{command}] must be a table")
    return {**_check(top, where), **_check(section, f"{where} [{command}]")}


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise InputError(f"can't read config '{path}' ({exc.strerror}); check --config") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"config '{path}' is not valid TOML ({exc}); fix it") from exc


def project_config(cwd: Path) -> tuple[dict[str, Any], str] | None:
    """./modeltap.toml, else [tool.modeltap] of ./pyproject.toml, if either exists."""
    own = cwd / PROJECT_FILE
    if own.is_file():
        return read_toml(own), str(own)
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        tool = read_toml(pyproject).get("tool", {}).get("modeltap")
        if isinstance(tool, Mapping):
            return dict(tool), f"{pyproject} [tool.modeltap]"
    return None


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in _FIELDS:
        raw = env.get(f"MODELTAP_{name.upper()}")
        if raw is None or _TYPES.get(name) in (list, dict):
            continue
        kind = _TYPES.get(name, str)
        try:
            if kind is bool:
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(raw)
                values[name] = raw.lower() in ("1", "true", "yes")
            else:
                values[name] = kind(raw)
        except ValueError as exc:
            raise InputError(
                f"MODELTAP_{name.upper()}={raw!r} is not a valid {kind.__name__}; fix or unset it"
            ) from exc
    return values


def load_settings(
    command: str,
    *,
    config_file: str | os.PathLike[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Merge every source; `flags` holds only what the user typed (None and [] mean unset)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise InputError(f"no config file '{path}'; check --config")
        merged.update(_table(read_toml(path), command, str(path)))
    project = project_config(cwd or Path.cwd())
    if project is not None:
        merged.update(_table(project[0], command, project[1]))
    merged.update(_from_env(os.environ if env is None else env))
    merged.update({k: v for k, v in (flags or {}).items() if v is not None and v != []})
    return Settings(**merged)


TOLERANCE_FILE = "tolerances.toml"
TOLERANCE_KEYS = ("atol", "rtol", "scaled_atol", "min_cosine")
# compare's allowance for rounding accumulated from module to module; a preset may hold it
ACCUMULATED_KEY = "accumulated_scaled_atol"
# What a preset may hold besides tolerances: `upcast = true` for presets made to compare dtypes,
# and compare's allowance.
PRESET_KEYS = (*TOLERANCE_KEYS, "upcast", ACCUMULATED_KEY)


def config_dirs(cwd: Path | None = None) -> list[Path]:
    """Folders whose tolerances.toml replaces the shipped one: $MODELTAP_CONFIGS, ./configs."""
    dirs = []
    if os.environ.get("MODELTAP_CONFIGS"):
        dirs.append(Path(os.environ["MODELTAP_CONFIGS"]))
    dirs.append((cwd or Path.cwd()) / "configs")
    return dirs


def shipped_presets() -> Any:
    """The tolerances.toml inside the package (importlib.resources: a wheel, a zip or a checkout
    alike), the one read when no folder of `config_dirs` holds one."""
    from importlib.resources import files

    return files("modeltap") / TOLERANCE_FILE


def _presets(cwd: Path | None) -> tuple[dict[str, Any], str]:
    """(the presets, where they came from): the first tolerances.toml of `config_dirs`, else the
    shipped one."""
    for folder in config_dirs(cwd):
        path = folder / TOLERANCE_FILE
        if path.is_file():
            return read_toml(path), str(path)
    if os.environ.get("MODELTAP_CONFIGS"):  # asked for, so not silently the shipped ones
        raise InputError(
            f"MODELTAP_CONFIGS={os.environ['MODELTAP_CONFIGS']!r} holds no {TOLERANCE_FILE}; "
            "add one there or unset it"
        )
    shipped = shipped_presets()
    return tomllib.loads(shipped.read_text(encoding="utf-8")), f"modeltap's own {TOLERANCE_FILE}"


def preset_names(cwd: Path | None = None) -> list[str]:
    """The names of the tolerance presets in force (a user's tolerances.toml, else modeltap's)."""
    return list(_presets(cwd)[0])


def read_preset(name: str, cwd: Path | None = None) -> dict[str, Any]:
    """Every value of preset `name`: its tolerances and, if it says so, `upcast`."""
    presets, where = _presets(cwd)
    if name not in presets:
        guess = suggest(name, presets)
        hint = f"did you mean '{guess}'?" if guess else "choose one of " + ", ".join(presets)
        raise InputError(f"no tolerance preset '{name}' in {where}; {hint}")
    values = _check(presets[name], f"{where} [{name}]")
    if not set(values) <= set(PRESET_KEYS):
        raise InputError(f"{where} [{name}]: a preset holds only " + ", ".join(PRESET_KEYS))
    return values


def tolerance_preset(name: str, cwd: Path | None = None) -> dict[str, float]:
    """atol/rtol (and scaled_atol, min_cosine when set) of preset `name`."""
    return {k: v for k, v in read_preset(name, cwd).items() if k in TOLERANCE_KEYS}


def tolerance_values(
    s: Settings, *, atol: float | None = None, rtol: float | None = None, preset: str | None = None
) -> dict[str, Any]:
    """Tolerances by precedence: settings files and env < preset < --atol/--rtol."""
    values: dict[str, Any] = {
        "atol": s.atol,
        "rtol": s.rtol,
        "scaled_atol": s.scaled_atol,
        "min_cosine": s.min_cosine,
    }
    if preset:
        values.update({k: v for k, v in tolerance_preset(preset).items() if k in TOLERANCE_KEYS})
    values.update({k: v for k, v in {"atol": atol, "rtol": rtol}.items() if v is not None})
    if values["atol"] < 0 or values["rtol"] < 0 or values["scaled_atol"] < 0:
        raise InputError("--atol, --rtol and scaled_atol must be 0 or more")
    return values


def accumulated_allowance(s: Settings, preset: str | None = None) -> float:
    """compare's `accumulated_scaled_atol` by precedence: settings files and env < preset."""
    value = s.accumulated_scaled_atol
    if preset:
        value = float(read_preset(preset).get(ACCUMULATED_KEY, value))
    if value < 0:
        raise InputError(f"{ACCUMULATED_KEY} must be 0 or more")
    return value
